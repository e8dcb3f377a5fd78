import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # tests/emcl_testing.py


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def one_torch_thread():
    """One intra-op thread, for tests of batch-1 training steps: on a loaded machine extra
    OpenMP threads only spin (10x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
