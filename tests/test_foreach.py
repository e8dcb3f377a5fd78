"""The foreach backend equals the reference (SPEC section 4): every op, mode and dtype, odd
sizes, chained steps, and a list of 100+ tensors."""
import pytest
import torch

from emcl_testing import DTYPES, MODES, OPS, SIZES, check_against_reference


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.id)
@pytest.mark.parametrize("op", OPS)
def test_foreach_matches_reference(op, mode, dtype):
    check_against_reference("foreach", op, SIZES, dtype, mode, steps=7, seed=3)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("op", OPS)
def test_foreach_many_tensors(op, dtype):
    sizes = [(i * 37) % 301 for i in range(123)]
    check_against_reference("foreach", op, sizes, dtype, MODES[1], steps=7, seed=5)
