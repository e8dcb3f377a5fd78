"""torch.distributed: FusedEMCLOptimizer under DDP and under FSDP2
(``fully_shard``, DTensor parameters), 2 processes on the gloo backend (CPU). After many steps
the parameters are identical on every rank and equal to one process trained on the same global
batches; under FSDP2 the kernels update the local shards and the state is sharded like the
parameters."""
import pytest
import torch
import torch.distributed as dist

from emcl_distributed import run_ranks
from emcl_kernels import FusedEMCLOptimizer

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

WORLD = 2
STEPS = 12
PER_RANK = 4


def _model():
    torch.manual_seed(0)
    # 17 rows: FSDP2 shards dim 0 unevenly (9 + 8), as real models do
    return torch.nn.Sequential(torch.nn.Linear(6, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))


def _global_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(WORLD * PER_RANK, 6, generator=g)
    return x, torch.sin(x[:, :3]) + 0.1 * torch.randn(WORLD * PER_RANK, 3, generator=g)


def _hyper(lr_mode):
    # lr_max keeps the recurrent rates (alpha <- alpha * r / (h + eps)) from growing unbounded
    return dict(meta_lr=0.5, inner_lr=0.1, reg=2.0, gamma=0.3, lr_mode=lr_mode, lr_max=0.2,
                backend="foreach")


def _train(model, opt, rank, world, paper_loop):
    """``STEPS`` steps on rank ``rank``'s slice of each global batch. ``paper_loop``: inner
    steps with a meta step every third batch (Algorithm 1); else ``step()`` with meta_every."""
    for step in range(STEPS):
        x, y = _global_batch(step)
        rows = slice(rank * (len(x) // world), (rank + 1) * (len(x) // world))
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        if paper_loop:
            if step % 3 == 2:
                opt.meta_step()
            else:
                opt.inner_step()
        else:
            opt.step()
        opt.zero_grad()


def _single_process(lr_mode, paper_loop):
    model = _model()
    opt = FusedEMCLOptimizer(model.parameters(), meta_every=None if paper_loop else 3,
                             **_hyper(lr_mode))
    _train(model, opt, 0, 1, paper_loop)
    return model, opt


def worker(rank, world, out_dir):
    """Both runs in one launch (starting processes is the slow part)."""
    return {"ddp": ddp_worker(rank, world, "inverse"), "fsdp2": fsdp2_worker(rank, world,
                                                                               "recurrent")}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(worker, WORLD, timeout=240)


def ddp_worker(rank, world, lr_mode):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(_model())
    opt = FusedEMCLOptimizer(model.parameters(), meta_every=3, **_hyper(lr_mode))
    _train(model, opt, rank, world, paper_loop=False)
    return {"params": [p.detach().clone() for p in model.module.parameters()],
            "anchors": [opt.state[p]["anchor"].clone() for p in model.module.parameters()],
            "steps": [opt.state[p]["step"].item() for p in model.module.parameters()]}


def test_ddp_two_ranks_match_each_other_and_one_process(ranks):
    ranks = [r["ddp"] for r in ranks]
    model, opt = _single_process("inverse", paper_loop=False)
    for i, p in enumerate(model.parameters()):
        for r in ranks[1:]:
            assert torch.equal(r["params"][i], ranks[0]["params"][i]), "ranks diverged"
            assert torch.equal(r["anchors"][i], ranks[0]["anchors"][i]), "anchors diverged"
        torch.testing.assert_close(ranks[0]["params"][i], p.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ranks[0]["anchors"][i], opt.state[p]["anchor"],
                                   rtol=1e-5, atol=1e-6)
    assert ranks[0]["steps"] == [STEPS // 3] * 4
    # the run moved the model: the comparison above is not between two untouched copies
    assert any(not torch.allclose(a, b.detach()) for a, b in
               zip(ranks[0]["params"], _model().parameters()))


def _fsdp2():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def fsdp2_worker(rank, world, lr_mode):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    fully_shard = _fsdp2()
    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = FusedEMCLOptimizer(model.parameters(), **_hyper(lr_mode))
    _train(model, opt, rank, world, paper_loop=True)
    out = {"params": [], "anchors": [], "meta_lrs": [], "layout": []}
    # a NaN in rank 0's shard only: every rank must skip the step (the flag is all-reduced),
    # or the shards of one model would be at different steps
    x, y = _global_batch(STEPS)
    rows = slice(rank * (len(x) // world), (rank + 1) * (len(x) // world))
    torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    if rank == 0:
        next(model.parameters()).grad.to_local()[0, 0] = float("nan")
    before = [p.to_local().clone() for p in model.parameters()]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.inner_step()
    opt.zero_grad()
    out["skipped_together"] = all(torch.equal(p.to_local(), b)
                                  for p, b in zip(model.parameters(), before))
    for p in model.parameters():
        st = opt.state[p]
        out["layout"].append({
            "param_is_dtensor": isinstance(p, DTensor),
            "state_is_dtensor": all(isinstance(st[k], DTensor) for k in ("anchor", "importance")),
            "same_placements": all(st[k].placements == p.placements
                                   for k in ("anchor", "importance")),
            "local_shape": tuple(p.to_local().shape),
            "state_local_shape": tuple(st["anchor"].to_local().shape),
            "anchor_dtype": st["anchor"].dtype,
        })
        out["params"].append(p.full_tensor().detach().clone())
        out["anchors"].append(st["anchor"].full_tensor().clone())
        if "meta_lr" in st:
            out["meta_lrs"].append(st["meta_lr"].full_tensor().clone())
    return out


def test_fsdp2_two_ranks_update_local_shards_like_one_process(ranks):
    ranks = [r["fsdp2"] for r in ranks]
    model, opt = _single_process("recurrent", paper_loop=True)
    shapes = []
    for r in ranks:
        for lay in r["layout"]:
            assert lay["param_is_dtensor"] and lay["state_is_dtensor"] and lay["same_placements"]
            assert lay["local_shape"] == lay["state_local_shape"]
            assert lay["anchor_dtype"] == torch.float32
        shapes.append([lay["local_shape"] for lay in r["layout"]])
    assert shapes[0][0] == (9, 6) and shapes[1][0] == (8, 6), f"not sharded: {shapes}"
    assert all(r["skipped_together"] for r in ranks), "a NaN in one shard must skip every rank"
    for i, p in enumerate(model.parameters()):
        st = opt.state[p]
        for r in ranks:
            torch.testing.assert_close(r["params"][i], p.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(r["anchors"][i], st["anchor"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(r["meta_lrs"][i], st["meta_lr"], rtol=1e-5, atol=1e-6)


def ddp_nccl_worker(rank, world, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP
    device = torch.device("cuda", rank)
    model = DDP(_model().to(device), device_ids=[rank])
    opt = FusedEMCLOptimizer(model.parameters(), meta_every=3, **{**_hyper("inverse"),
                                                                   "backend": "auto"})
    for step in range(STEPS):
        x, y = _global_batch(step)
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        torch.nn.functional.mse_loss(model(x[rows].to(device)), y[rows].to(device)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().cpu() for p in model.module.parameters()]


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
                         and dist.is_nccl_available()), reason="needs 2 GPUs and NCCL")
def test_ddp_nccl_two_gpus_match_one_process():
    ranks = run_ranks(ddp_nccl_worker, WORLD, timeout=240, backend="nccl")
    model, _ = _single_process("inverse", paper_loop=False)
    for i, p in enumerate(model.parameters()):
        assert torch.equal(ranks[0][i], ranks[1][i]), "ranks diverged"
        torch.testing.assert_close(ranks[0][i], p.detach(), rtol=1e-4, atol=1e-5)
