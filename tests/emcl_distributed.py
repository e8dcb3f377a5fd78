"""Launching a few torch.distributed processes from a test: each rank runs ``fn(rank, world,
out_dir, *args)`` in a fresh process (spawn) inside a gloo process group set up over a file
store, under a deadline; a rank that fails or hangs fails the test with its traceback.

    results = run_ranks(my_worker, world_size=2, args=(steps,), timeout=60)   # one dict per rank

``fn`` must be importable (defined at module level) and return a picklable value, which is
saved with ``torch.save`` and handed back in rank order.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


def _entry(rank: int, fn, world: int, out_dir: str, args: tuple, backend: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{out_dir}/store", rank=rank,
                                world_size=world)
        try:
            result = fn(rank, world, out_dir, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    # The result is on disk: leave without the interpreter's teardown. With torch 2.14's gloo a
    # rank that ran, destroyed its group and saved its result still aborts now and then while
    # the interpreter finalizes ("terminate called without an active exception"; 1 to 3
    # launches in 100 on the 2-core CI machine, without this package too:
    # tools/gloo_teardown_repro.py), which would fail a test whose ranks all succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int = 2, args: tuple = (), timeout: float = 120.0,
              backend: str = "gloo") -> list:
    """Run ``fn`` on ``world_size`` ranks of a ``backend`` process group ("gloo", or "nccl"
    with rank r on cuda:r); return their results in rank order."""
    with tempfile.TemporaryDirectory(prefix="emcl_dist_") as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, out_dir, args, backend),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} did not finish on {world_size} ranks "
                                       f"within {timeout:.0f} s")
        except Exception as exc:
            errors = [open(os.path.join(out_dir, n)).read()
                      for n in sorted(os.listdir(out_dir)) if n.endswith(".err")]
            raise AssertionError(f"{fn.__name__} failed: {exc}\n" + "\n".join(errors)) from exc
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]
