"""FusedEMCLOptimizer in a few lines: two tasks learned one after the other.

    python examples/quickstart.py [--backend auto|foreach|cpu|reference]

Task A and task B are two random linear classification problems on the same inputs. The model
learns A, then B, with the paper's loop (inner steps one sample at a time, a meta step per
batch), and the script prints accuracy on both tasks and what the optimizer's state holds.
"""
import argparse
import time

import torch
from torch import nn

from emcl_kernels import FusedEMCLOptimizer, available_backends


def make_task(seed, n=2000, dim=20, classes=4):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, classes, generator=gen)
    x = torch.randn(n, dim, generator=gen)
    return x, (x @ w).argmax(1)


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = FusedEMCLOptimizer(model.parameters(), lr=0.05, meta_lr=0.3, reg=10.0,
                             gamma=0.3, backend=args.backend)
    print(f"available backends: {available_backends()}; using {args.backend!r}")
    tasks = {"A": make_task(1), "B": make_task(2)}
    loss_fn = nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    for name, (x, y) in tasks.items():
        for b in range(0, 1000, 10):                      # single pass, batches of 10
            xb, yb = x[b:b + 10], y[b:b + 10]
            for i in range(len(xb)):                      # inner loop: one sample at a time
                loss_fn(model(xb[i:i + 1]), yb[i:i + 1]).backward()
                opt.inner_step()
                opt.zero_grad()
            loss_fn(model(xb), yb).backward()             # meta-loss on the batch
            opt.meta_step()
            opt.zero_grad()
        accs = {k: accuracy(model, tx[1000:], ty[1000:]) for k, (tx, ty) in tasks.items()}
        print(f"after task {name}: held-out accuracy " +
              ", ".join(f"{k} {v:.1%}" for k, v in accs.items()))
    st = opt.state[model[0].weight]
    print(f"trained in {time.perf_counter() - t0:.1f} s; first layer state: "
          f"{int(st['step'].item())} meta steps, mean importance {st['importance'].mean():.2e}, "
          f"anchor dtype {st['anchor'].dtype}")


if __name__ == "__main__":
    main()
