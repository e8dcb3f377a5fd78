# Helpers shared by the CI scripts in tools/ (sourced, not run).

# The repository root.
EMCL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf 'ERROR: %s\n' "$*" >&2; exit 1; }

# copy_checkout DEST: the repository's files (tracked, and untracked but not ignored) without
# build outputs, so that an install there cannot touch the checkout's own emcl_kernels/_C*.so.
copy_checkout() {
    local dest="$1"
    mkdir -p "$dest"
    (cd "$EMCL_ROOT" && { git ls-files -z; git ls-files -z --others --exclude-standard; } \
        | { grep -zv '^emcl_kernels/_C' || true; } | tar --null -cf - -T -) | tar -xf - -C "$dest"
}

# cuda_home: the CUDA toolkit root to build with (CUDA_HOME if set, else where the nvcc on PATH
# really lives: a wrapper script's --dryrun prints _HERE_=<root>/bin), or nothing.
cuda_home() {
    if [ -n "${CUDA_HOME:-}" ]; then echo "$CUDA_HOME"; return; fi
    command -v nvcc >/dev/null 2>&1 || return 0
    nvcc --dryrun x.cu 2>&1 | sed -n 's/^#\$ _HERE_=\(.*\)\/bin$/\1/p' | head -n 1
}

# venv_site PYTHON: that interpreter's site-packages.
venv_site() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# check_backends PYTHON SRC [--cuda-kernels]: emcl_kernels imports from SRC (the editable
# install) when run outside the checkout, and its compiled "cpu" backend is available.
check_backends() {
    local py="$1" src="$2"; shift 2
    (cd / && "$py" "$EMCL_ROOT/tools/check_install.py" --from "$src" "$@")
}
