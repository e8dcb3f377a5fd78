import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # tests/emcl_testing.py


import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist, each worker gets its share of the cores: with torch's default (every
# core per process) 12 workers on 16 cores ran 192 OpenMP threads, and a CPU-side reference
# step that takes 0.2 s alone took 40 s (the GPU check of 2026-11-26 on an H200).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1)
                              // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture
def one_torch_thread():
    """One intra-op thread, for tests of batch-1 training steps: on a loaded machine extra
    OpenMP threads only spin (10x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def gpu_memory_to_myself():
    """For a test that needs most of the GPU's memory (the 2**31-element tests, ~36-40 GiB):
    one such test at a time across pytest-xdist's workers (an exclusive lock on a file in the
    temporary folder), and the cached blocks given back afterwards for the other workers."""
    import fcntl
    import tempfile
    path = os.path.join(tempfile.gettempdir(), "emcl-kernels-gpu-memory.lock")
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            torch.cuda.empty_cache()
            yield
        finally:
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_runtest_setup(item):
    """``EMCL_TEST_DEADLINE`` (seconds since the epoch), set by tools/gpu_check.py: a test that
    would start after it is skipped, so that a run cut to a time budget still ends normally
    and writes its report (the summary counts these skips apart)."""
    deadline = os.environ.get("EMCL_TEST_DEADLINE")
    if deadline:
        import time
        if time.time() > float(deadline):
            pytest.skip("gpu-check: the stage's time budget was spent before this test")
