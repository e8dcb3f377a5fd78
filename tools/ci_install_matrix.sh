#!/usr/bin/env bash
# CI: install the package with the README's exact command,
#     pip install --no-build-isolation -e .
# into fresh virtual environments with different pip/setuptools versions, and fail unless the
# compiled "cpu" backend is available afterwards (pip 23.x/24.x with a recent setuptools used to
# end "successfully" without it).
#
# Each environment is a plain venv that gets its own pip and setuptools, and sees the main
# environment's packages (torch, numpy, ninja, ...) through a .pth file instead of installing
# them again (a .pth line appends to sys.path, so the venv's own pip/setuptools come first).
# Each installs a copy of the checkout, so the checkout's own build stays as it is.
# The CPU kernels only (EMCL_NO_CUDA=1): `make setup` and tools/ci_torch211.sh compile the CUDA
# part; what differs here is pip and setuptools, not the compiler.
#
# Usage: tools/ci_install_matrix.sh [BASE_PYTHON]   (default .venv/bin/python, made by make setup)
# Env:   EMCL_CI_WORK (scratch folder, default a new temp folder, removed at the end),
#        EMCL_CI_LOGS (build logs, default build/ci)
set -euo pipefail
source "$(dirname "$0")/ci_lib.sh"
cd "$EMCL_ROOT"

BASE_PY="${1:-.venv/bin/python}"
[ -x "$BASE_PY" ] || die "no $BASE_PY: run 'make setup' first (the environments share its torch)"
BASE_PY="$(cd "$(dirname "$BASE_PY")" && pwd)/$(basename "$BASE_PY")"
SHARED_SITE="$(venv_site "$BASE_PY")"
WORK="${EMCL_CI_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/emcl-matrix.XXXXXX")}"
LOGS="${EMCL_CI_LOGS:-$EMCL_ROOT/build/ci}"
mkdir -p "$WORK" "$LOGS"
LOGS="$(cd "$LOGS" && pwd)"
[ -n "${EMCL_CI_WORK:-}" ] || trap 'rm -rf "$WORK"' EXIT

# name | pip | setuptools | index during the install
MATRIX=(
    "pip23-setuptools84|pip==23.2.1|setuptools==84.2.1|online"
    "pip24-setuptools80|pip==24.0|setuptools==80.9.0|offline"
)

# The pip and setuptools wheels, fetched while the registry is reachable.
WHEELS="$WORK/wheels"
log "fetching the pip and setuptools versions of the matrix into $WHEELS"
for entry in "${MATRIX[@]}"; do
    IFS='|' read -r _ pip_spec st_spec _ <<<"$entry"
    "$BASE_PY" -m pip download -q --no-deps -d "$WHEELS" "$pip_spec" "$st_spec" \
        2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
    ls "$WHEELS"/"${pip_spec%%==*}"-"${pip_spec##*==}"-*.whl >/dev/null \
        || die "could not download $pip_spec"
done

summary=()
for entry in "${MATRIX[@]}"; do
    IFS='|' read -r name pip_spec st_spec index <<<"$entry"
    t0=$(date +%s)
    venv="$WORK/venv-$name"
    src="$WORK/src-$name"
    log "== $name: $pip_spec $st_spec, $index"
    "$(dirname "$BASE_PY")/python" -m venv "$venv"
    # (no separate `wheel`: setuptools >= 70.1 builds wheels itself)
    "$venv/bin/python" -m pip install -q --no-index --find-links "$WHEELS" "$pip_spec" "$st_spec"
    echo "$SHARED_SITE" >"$(venv_site "$venv/bin/python")/_emcl_ci_shared_env.pth"
    copy_checkout "$src"
    log "$("$venv/bin/python" -m pip --version); setuptools $("$venv/bin/python" -c \
        'import setuptools; print(setuptools.__version__)')"

    if [ "$index" = online ]; then
        # With build isolation (the README's flag left out) the build cannot see torch: it must
        # fail and say what to do, never install without the extension.
        log "$name: without --no-build-isolation the install must fail"
        if (cd "$src" && source "$venv/bin/activate" && pip install -e .) \
                >"$LOGS/$name-isolated.log" 2>&1; then
            tail -n 40 "$LOGS/$name-isolated.log"
            die "$name: 'pip install -e .' with build isolation succeeded; it must fail"
        fi
        grep -q "torch is not importable" "$LOGS/$name-isolated.log" || {
            tail -n 40 "$LOGS/$name-isolated.log"
            die "$name: the isolated build failed without saying that torch is missing"; }
        log "$name: it failed, saying: $(grep -m1 -o 'torch is not importable[^.]*' \
            "$LOGS/$name-isolated.log")"
    fi

    log "$name: pip install --no-build-isolation -e .   (log: $LOGS/$name.log)"
    offline=()
    [ "$index" = offline ] && offline=(env PIP_NO_INDEX=1)
    if ! (cd "$src" && source "$venv/bin/activate" && export EMCL_NO_CUDA=1 MAX_JOBS="${MAX_JOBS:-2}" \
            && "${offline[@]}" pip install --no-build-isolation -e .) >"$LOGS/$name.log" 2>&1; then
        tail -n 60 "$LOGS/$name.log"
        die "$name: the install failed (log: $LOGS/$name.log)"
    fi
    check_backends "$venv/bin/python" "$src" || die "$name: no compiled backend after the install"
    dt=$(( $(date +%s) - t0 ))
    summary+=("$name ($pip_spec, $st_spec, $index): ok in ${dt} s")
    log "$name: ok in ${dt} s"
    rm -rf "$venv" "$src"
done
log "install matrix:"
printf '  %s\n' "${summary[@]}"
