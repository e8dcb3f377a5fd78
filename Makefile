# emcl-kernels: one command for each job.
#   make setup      .venv with the pinned set-up (requirements.txt), then the README's install,
#                   pip install --no-build-isolation -e .  (compiles emcl_kernels._C; log in
#                   .venv/build.log); fails unless the compiled "cpu" backend works
#   make setup-avalanche  setup, then avalanche-lib (requirements-avalanche.txt) into .venv under
#                   requirements.txt's pins as constraints (pip fails rather than move a pin), then
#                   pip check: tests/test_avalanche.py and examples/avalanche_emcl.py run with it
#   make setup-frameworks  setup, then the optional framework integrations
#                   (requirements-frameworks.txt: transformers, accelerate, lightning, timm) into
#                   .venv under requirements.txt's pins as constraints, then pip check:
#                   tests/test_frameworks.py runs with them (skipped without)
#   make setup-trackers  setup, then TensorBoard and Weights & Biases (requirements-trackers.txt)
#                   into .venv under requirements.txt's pins as constraints, then pip check:
#                   --log tensorboard,wandb and tests/test_trackers.py's round trips (skipped without)
#   make setup-ray  setup, then Ray (requirements-ray.txt) into .venv under requirements.txt's pins
#                   as constraints, then pip check: the selection's --executor ray
#   make test-ray   setup-ray, then the Ray executor's tests (a local two-node Ray cluster against the
#                   local executor: tests/test_selection_sweep.py -k ray; run arrays as Ray tasks:
#                   tests/test_cl_arrays.py::test_ray_runs_an_array_as_one_task)
#   make test       setup, then the test suite
#   make demo       setup, then the main job (EMCL on Permuted MNIST, one seed)
#   make bench      setup, then the kernel benchmark (--quick)
#   make gpu-check-1 OUT=dir   on a machine with a CUDA GPU and torch >= 2.11 (no .venv, no
#   make gpu-check-2 OUT=dir   index needed): the two stages of the GPU check, each within one
#                              10-minute command; summary and archive in OUT (docs/gpu-check.md)
#   make gpu-check-12 OUT=dir  both stages in one command (one build; fits 10 minutes)
#   make gpu-check-3 OUT=dir   the continual-learning side on the GPU in one command (540 s
#                   budget; the build reused after gpu-check-12 on a warm machine): run-arrays
#                   on cuda per method at widths 1-128, the main job's first 5 tasks with EMCL's
#                   fused glance, the Permuted MNIST held-out sweep (all three stages) with
#                   --array auto --device cuda in the time left, then sweep_diff against
#                   results/heldout/permuted-mnist (docs/gpu-check.md)
#   make gpu-validate-a OUT=dir  on the GPU machine (after gpu-check, or building here): the
#                   Permuted MNIST validation stage with --device auto --jobs $(GPU_JOBS), then
#                   emcl_continual.sweep_diff against the 2-core CPU's run in
#                   results/scale/permuted-mnist/cpu-jobs2-283f11b (OUT/cpu-vs-gpu.md: same selection?
#                   the time ratio). VALIDATE_S=280 stops the stage after 280 s (SIGTERM: the
#                   runs done are kept, timed as interrupted) and still writes the comparison
#   make gpu-check  every full stage without a time budget (30+ minutes): build against that
#                   torch, every test, memcheck, the benchmarks, the main job on GPU and CPU;
#                   results in benchmarks/results/ (tools/gpu_check.py --help).
#                   GPU_CHECK_ARGS="--quick" (or "--only build,tests", ...) selects.
#   make clean
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The nvcc on some PATHs is a wrapper script; torch then guesses the toolkit root wrong. Ask
# nvcc where it really lives (its --dryrun prints _HERE_=<root>/bin), unless CUDA_HOME is set.
CUDA_HOME ?= $(shell nvcc --dryrun x.cu 2>&1 | sed -n 's/^#\$$ _HERE_=\(.*\)\/bin$$/\1/p')
export CUDA_HOME
# GPU architectures of `make setup` (gpu-check builds for the GPU it runs on unless this is set
# in the environment).
SETUP_CUDA_ARCH_LIST ?= $(or $(TORCH_CUDA_ARCH_LIST),8.0;9.0)
MAX_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
export MAX_JOBS
GPU_CHECK_ARGS ?=
OUT ?= build/gpu-check/out
GPU_JOBS ?= 16

.PHONY: setup setup-avalanche setup-frameworks setup-trackers setup-ray test-ray demo test bench gpu-check gpu-check-1 gpu-check-2 gpu-check-12 gpu-check-3 gpu-validate-a clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt setup.py pyproject.toml tools/ext_selfcheck.py $(wildcard csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	. $(VENV)/bin/activate && TORCH_CUDA_ARCH_LIST="$(SETUP_CUDA_ARCH_LIST)" \
		pip install -v --no-build-isolation -e . > $(VENV)/build.log 2>&1 \
		|| (tail -n 80 $(VENV)/build.log; echo "make setup: the install failed; the whole log is $(VENV)/build.log"; exit 1)
	cd / && $(abspath $(PY)) $(abspath tools/check_install.py) --from $(CURDIR)
	touch $@

setup-avalanche: $(VENV)/.avalanche

$(VENV)/.avalanche: $(VENV)/.installed requirements-avalanche.txt
	$(PY) -m pip install -q -r requirements-avalanche.txt -c requirements.txt
	$(PY) -m pip check
	touch $@

setup-frameworks: $(VENV)/.frameworks

$(VENV)/.frameworks: $(VENV)/.installed requirements-frameworks.txt
	$(PY) -m pip install -q -r requirements-frameworks.txt -c requirements.txt
	$(PY) -m pip check
	touch $@

setup-trackers: $(VENV)/.trackers

$(VENV)/.trackers: $(VENV)/.installed requirements-trackers.txt
	$(PY) -m pip install -q -r requirements-trackers.txt -c requirements.txt
	$(PY) -m pip check
	touch $@

setup-ray: $(VENV)/.ray

$(VENV)/.ray: $(VENV)/.installed requirements-ray.txt
	$(PY) -m pip install -q -r requirements-ray.txt -c requirements.txt
	$(PY) -m pip check
	touch $@

test-ray: setup-ray
	$(PY) -m pytest -q tests/test_selection_sweep.py -k ray
	$(PY) -m pytest -q tests/test_cl_arrays.py::test_ray_runs_an_array_as_one_task

demo: setup
	$(PY) -m emcl_continual --method emcl --stream permuted-mnist --seeds 0 --out runs/demo --force

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) -m benchmarks kernels --quick

gpu-check:
	$(PYTHON) tools/gpu_check.py $(GPU_CHECK_ARGS)

gpu-check-1:
	$(PYTHON) tools/gpu_check.py --stage 1 --out $(OUT) $(GPU_CHECK_ARGS)

gpu-check-2:
	$(PYTHON) tools/gpu_check.py --stage 2 --out $(OUT) $(GPU_CHECK_ARGS)

gpu-check-12:
	rc=0; $(PYTHON) tools/gpu_check.py --stage 1 --budget 300 --out $(OUT) $(GPU_CHECK_ARGS) || rc=1; \
	$(PYTHON) tools/gpu_check.py --stage 2 --budget 270 --out $(OUT) $(GPU_CHECK_ARGS) || rc=1; \
	exit $$rc

gpu-check-3:
	$(PYTHON) tools/gpu_check.py --stage 3 --out $(OUT) $(GPU_CHECK_ARGS)

gpu-validate-a:
	$(PYTHON) tools/gpu_check.py --only deps,build --out $(OUT)/build $(GPU_CHECK_ARGS)
	rc=0; PYTHONPATH=$(CURDIR):$(CURDIR)/python:$(CURDIR)/build/gpu-check/site \
	  $(if $(VALIDATE_S),timeout --signal=TERM $(VALIDATE_S)) $(PYTHON) -m emcl_continual.selection \
	  --stream permuted-mnist --until validate-a --device auto --jobs $(GPU_JOBS) --threads 1 \
	  --allow-dirty --out $(OUT)/gpu-validate-a || rc=$$?; \
	PYTHONPATH=$(CURDIR):$(CURDIR)/python $(PYTHON) -m emcl_continual.sweep_diff \
	  results/scale/permuted-mnist/cpu-jobs2-283f11b $(OUT)/gpu-validate-a --label-a "2-core CPU, --jobs 2" \
	  --label-b "GPU machine, --device auto --jobs $(GPU_JOBS)" --out $(OUT)/cpu-vs-gpu || rc=1; \
	exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info emcl_kernels/*.so runs
