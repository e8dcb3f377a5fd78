"""torch's gloo backend aborting a process at interpreter teardown, without emcl_kernels.

    python tools/gloo_teardown_repro.py --launches 80

Each launch spawns two ranks that train a small DDP model with ``torch.optim.Adam`` (this
package is not imported), call ``dist.destroy_process_group()``, save their parameters and
return normally. With torch 2.14.1 on the project's 2-core machine one launch in 40 to 80 has a
rank that aborts after all of that, while the interpreter finalizes ("terminate called without
an active exception", SIGABRT): 1 of 80 launches on 2026-11-27. ``tests/emcl_distributed.py``
therefore ends its ranks with ``os._exit(0)`` once their results are on disk. Prints each failed
launch and the count; exits 1 when any launch failed.
"""
from __future__ import annotations

import argparse
import sys
import tempfile

import torch
import torch.multiprocessing as mp


def rank_main(rank: int, world: int, store_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(6, 17), torch.nn.Tanh(),
                                    torch.nn.Linear(17, 3)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(12):
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    torch.save([p.detach() for p in model.module.parameters()], f"{store_dir}/rank{rank}.pt")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=80)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    failed = 0
    for i in range(args.launches):
        with tempfile.TemporaryDirectory(prefix="gloo_teardown_") as d:
            ctx = mp.start_processes(rank_main, args=(args.world, d), nprocs=args.world,
                                     join=False, start_method="spawn")
            try:
                while not ctx.join(timeout=0.5):
                    pass
            except Exception as exc:        # a rank that died: ProcessExitedException
                failed += 1
                print(f"launch {i}: {exc}", flush=True)
    print(f"torch {torch.__version__}: {failed} of {args.launches} launches had a rank fail")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
