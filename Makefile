# emcl-kernels: one command to set everything up and run the main job, one to run the tests.
#   make demo    set up .venv, build the extension, run EMCL on Permuted MNIST (one seed)
#   make test    set up .venv, build the extension, run the test suite
#   make bench   set up .venv, run the kernel benchmark (--quick)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The nvcc on some PATHs is a wrapper script; torch then guesses the toolkit root wrong. Ask
# nvcc where it really lives (its --dryrun prints _HERE_=<root>/bin), unless CUDA_HOME is set.
CUDA_HOME ?= $(shell nvcc --dryrun x.cu 2>&1 | sed -n 's/^#\$$ _HERE_=\(.*\)\/bin$$/\1/p')
export CUDA_HOME
TORCH_CUDA_ARCH_LIST ?= 8.0;9.0
export TORCH_CUDA_ARCH_LIST
MAX_JOBS ?= 2
export MAX_JOBS

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt setup.py $(wildcard csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -v --no-build-isolation -e . > $(VENV)/build.log 2>&1 \
		|| (tail -n 60 $(VENV)/build.log; exit 1)
	$(PY) -c "import emcl_kernels as e; print('emcl_kernels backends:', e.backend_status())"
	touch $@

demo: setup
	$(PY) -m emcl_continual --method emcl --stream permuted-mnist --seeds 0 --out runs/demo --force

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) benchmarks/bench_kernels.py --quick

clean:
	rm -rf $(VENV) build *.egg-info emcl_kernels/*.so runs
