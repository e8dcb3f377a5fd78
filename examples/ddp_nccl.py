"""Multi-GPU training with FusedEMCLOptimizer: DDP (or FSDP2) over NCCL, optional AMP and
torch.compile.

    torchrun --nproc_per_node=8 examples/ddp_nccl.py                      # DDP, fp32
    torchrun --nproc_per_node=8 examples/ddp_nccl.py --fsdp2 --amp bf16   # FSDP2, bf16 params
    torchrun --nproc_per_node=8 examples/ddp_nccl.py --amp fp16           # fp32 params, fp16 autocast + GradScaler
    torchrun --nproc_per_node=2 examples/ddp_nccl.py --steps 20           # no GPU: gloo on CPU

Every rank trains on its own slice of each global batch of a synthetic regression task (so the
script needs no data set); the gradients are averaged by DDP (all-reduce) or FSDP2
(reduce-scatter), and FusedEMCLOptimizer then updates each rank's parameters (FSDP2: each
rank's shard) with every ``--meta-every``-th step also the meta step. At the end the script
checks that the ranks agree and prints the loss curve and the time per step.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from emcl_kernels import FusedEMCLOptimizer


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--meta-every", type=int, default=10)
    ap.add_argument("--fsdp2", action="store_true", help="shard with fully_shard instead of DDP")
    ap.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none",
                    help="bf16: bf16 parameters (fp32 anchors are the master weights); "
                         "fp16: fp32 parameters, fp16 autocast and a GradScaler")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model, and the optimizer step with fullgraph=True")
    ap.add_argument("--backend", default="auto", help="FusedEMCLOptimizer backend")
    return ap.parse_args()


def model_for(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.GELU(),
                               torch.nn.Linear(width, width), torch.nn.GELU(),
                               torch.nn.Linear(width, 8))


def global_batch(step: int, n: int, device):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, 32, generator=g)
    return x.to(device), torch.tanh(x[:, :8] - 0.5 * x[:, 8:16]).to(device)


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial model on every rank
    model = model_for(args.width).to(device)
    if args.amp == "bf16":
        model = model.to(torch.bfloat16)

    if args.fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model, device_ids=[device.index] if cuda else None)

    # capturable: hyper-parameters are device tensors, so a compiled step reads their current
    # values instead of recompiling when a schedule changes them
    opt = FusedEMCLOptimizer(net.parameters(), lr=0.2, meta_lr=0.9, reg=1.0,
                             meta_every=args.meta_every, backend=args.backend,
                             capturable=args.compile)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    autocast = torch.autocast(device.type, dtype=torch.float16, enabled=args.amp == "fp16")

    forward = torch.compile(net) if args.compile else net

    def opt_step():
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()

    if args.compile and scaler is None:
        opt_step = torch.compile(opt_step, fullgraph=True)

    losses, t0 = [], None
    for step in range(args.steps):
        if step == 5:  # after warm-up and compilation
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        x, y = global_batch(step, args.batch * world, device)
        x, y = x[rank::world], y[rank::world]
        with autocast:
            loss = torch.nn.functional.mse_loss(forward(x.to(next(model.parameters()).dtype))
                                                .float(), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        opt_step()
        opt.zero_grad()
        losses.append(loss.detach())
    if cuda:
        torch.cuda.synchronize()
    per_step = (time.perf_counter() - t0) / max(1, args.steps - 5) if t0 else float("nan")

    # every rank must hold the same model (DDP) / the same full model (FSDP2)
    flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
                      .reshape(-1) for p in net.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    spread = (hi - lo).abs().max().item()
    loss_avg = torch.stack(losses).float()
    dist.all_reduce(loss_avg)
    loss_avg /= world
    if rank == 0:
        curve = loss_avg.tolist()
        marks = sorted({0, len(curve) // 4, len(curve) // 2, 3 * len(curve) // 4, len(curve) - 1})
        print(f"{'fsdp2' if args.fsdp2 else 'ddp'} on {world} x {device.type}, amp={args.amp}, "
              f"compile={args.compile}, backend={args.backend}")
        print("loss: " + ", ".join(f"step {i}: {curve[i]:.4f}" for i in marks))
        print(f"time per step: {per_step * 1e3:.2f} ms; max parameter difference between "
              f"ranks: {spread:.3g}")
    dist.destroy_process_group()
    if spread != 0.0:
        raise SystemExit(f"rank {rank}: the ranks disagree by {spread}")


if __name__ == "__main__":
    main()
