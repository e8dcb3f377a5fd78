"""What the reliability tests (test_nonfinite, test_checkpoint, test_misuse, test_properties)
share: the backends to cover, bit-exact snapshots, and a small model with an optimizer.

The backends are every one of the registry that is available and runs on the test device, so the tests cover the "cpu", "cuda" and "triton" backends as soon as they are
built. "triton" runs on CPU tensors only through its interpreter: it is included only when
``TRITON_INTERPRET=1`` is set when the test module is imported.
"""
from __future__ import annotations

import os

import torch

from emcl_kernels import FusedEMCLOptimizer
from emcl_kernels.backends import BACKENDS, BackendUnavailableError, get_backend

NAN, INF = float("nan"), float("inf")


def devices() -> list:
    """The devices to test on: CPU, and the GPU when there is one."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def backends_for(device: str) -> list:
    """The available backends that run on tensors of ``device``, in the registry's order.

    "triton" on CPU is not even imported without ``TRITON_INTERPRET=1``: Triton decides at the
    first import whether its kernels are compiled or interpreted (test_triton_backend.py sets
    the variable itself and must be the first to import it).
    """
    out = []
    for name in BACKENDS:
        if name == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            continue
        try:
            get_backend(name, torch.device(device))
        except (BackendUnavailableError, ValueError):
            continue
        out.append(name)
    return out


def backend_device_pairs() -> list:
    """Every (backend, device) pair to test, as pytest ids like ``foreach-cpu``."""
    return [(b, d) for d in devices() for b in backends_for(d)]


BACKEND_DEVICES = backend_device_pairs()
BACKEND_IDS = [f"{b}-{d}" for b, d in BACKEND_DEVICES]


def snapshot(tensors) -> list:
    """Bit-exact copies of a (nested) list of tensors."""
    return [t.detach().clone() for t in tensors]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN payloads included), not just equal in value."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if a.numel() == 0:
        return True
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def assert_unchanged(before: list, after: list, what: str) -> None:
    for i, (b, a) in enumerate(zip(before, after)):
        assert same_bits(b, a), f"{what}[{i}] was written"


def optimizer_snapshot(opt: FusedEMCLOptimizer) -> dict:
    """Everything an optimizer holds, copied: parameter values, state tensors, hyper-parameters
    and counters."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {
        "params": [p.detach().clone() for p in params],
        "state": [{k: (v.detach().clone() if torch.is_tensor(v) else v)
                   for k, v in opt.state[p].items()} if p in opt.state else None
                  for p in params],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "n_params": [len(g["params"]) for g in opt.param_groups],
        "counters": (opt._step_calls, opt.skipped_steps),
    }


def assert_same_values(before: list, after: list, what: str) -> None:
    """Equal value for value, NaN where NaN (a NaN's payload bits may differ)."""
    for i, (b, a) in enumerate(zip(before, after)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{what}[{i}] changed: {m}")


def assert_optimizer_unchanged(before: dict, opt: FusedEMCLOptimizer) -> None:
    after = optimizer_snapshot(opt)
    assert after["n_params"] == before["n_params"], "the param groups changed"
    assert after["groups"] == before["groups"], "hyper-parameters changed"
    assert after["counters"] == before["counters"], "counters changed"
    assert_unchanged(before["params"], after["params"], "params")
    for i, (b, a) in enumerate(zip(before["state"], after["state"])):
        assert (b is None) == (a is None), f"state of parameter {i} appeared or vanished"
        if b is not None:
            assert set(a) == set(b), f"state keys of parameter {i} changed"
            for k in b:
                assert same_bits(b[k], a[k]), f"state {k!r} of parameter {i} changed"


class TinyNet(torch.nn.Module):
    """Two linear layers with odd sizes; deterministic for a seed."""

    def __init__(self, seed: int = 0, dtype=torch.float32, device="cpu", sizes=(5, 7, 3)):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(sizes[0], sizes[1])
        self.fc2 = torch.nn.Linear(sizes[1], sizes[2])
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.to(device=device, dtype=dtype)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(seed: int, n: int = 6, dim: int = 5, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(10_000 + seed)
    return torch.randn(n, dim, generator=gen).to(device=device, dtype=dtype)


def backward(model: torch.nn.Module, seed: int, bad: float = None) -> None:
    """Fresh gradients for ``model`` from a random batch; with ``bad``, one gradient element of
    the first layer is replaced by it (inf or NaN)."""
    p0 = next(model.parameters())
    x = batch(seed, dim=model.fc1.in_features, dtype=p0.dtype, device=p0.device)
    model.zero_grad(set_to_none=True)
    (model(x) ** 2).float().mean().backward()
    if bad is not None:
        model.fc1.weight.grad.view(-1)[seed % model.fc1.weight.numel()] = bad
