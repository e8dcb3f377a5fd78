#!/usr/bin/env python3
"""The GPU smoke run of ``make gpu-check`` stage 1: the facts worth most, in about a minute.

Each check prints one JSON line and appends it to ``--out`` as soon as it is done, so a run cut
off by a time limit still leaves everything it did:

- ``step``: every GPU backend (``cuda``, ``triton``) against the reference backend on every
  dtype and op (inner, meta, inner_meta, cadence), 3 chained calls, tensors of 1, 7, 4097 and
  70001 elements, with the finite check; every mode at fp32 inner_meta;
- ``odd_address``: the same with a parameter and a gradient that start 2 bytes past a
  16-byte boundary (full chunks included), checked and unchecked;
- ``bf16_model``: an MLP in bf16 trained 30 steps by ``FusedEMCLOptimizer`` with its defaults
  (and with each GPU backend by name): the loss falls, nothing is skipped, all finite;
- ``capture``: each backend's ``capturable=True`` step captured in a CUDA graph (forward,
  backward, step) and replayed 6 times against the same training run eagerly;
- ``counters``: 7 cadence steps (meta_every=3) with a NaN gradient at the 4th: skipped and
  meta-step counts against the reference backend on the CPU;
- ``bandwidth``: GB/s of the fused inner+meta step at 2**26 fp32 elements beside a copy of the
  same size (bytes moved / median time, CUDA events).

Usage: ``python tools/gpu_smoke.py --out smoke.jsonl [--only step,capture]``. Exit status 1
when a check failed, 2 without a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "python"), os.path.join(ROOT, "tests")]

import torch  # noqa: E402

CHECKS = ("step", "odd_address", "bf16_model", "capture", "counters", "bandwidth")
SIZES = (1, 7, 4097, 70001)
OPS = ("inner", "meta", "inner_meta", "cadence")


class Recorder:
    def __init__(self, path):
        self.path, self.failed, self.count = path, 0, 0

    def __call__(self, check: str, ok: bool, **data) -> None:
        row = {"check": check, "ok": bool(ok), **data}
        self.count += 1
        self.failed += not ok
        line = json.dumps(row, default=str)
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(line + "\n")

    def guard(self, check: str, fn, **data) -> None:
        """Run fn(); a raised error is a failed check with its message."""
        t0 = time.time()
        try:
            extra = fn() or {}
            self(check, True, seconds=round(time.time() - t0, 2), **data, **extra)
        except Exception as exc:  # noqa: BLE001 - every check reports, the run goes on
            self(check, False, seconds=round(time.time() - t0, 2), **data,
                 error=f"{type(exc).__name__}: {str(exc)[:600]}",
                 where=traceback.format_exc().splitlines()[-3:])


def gpu_backends():
    from emcl_kernels.backends import backend_status
    return [b for b in ("cuda", "triton") if backend_status().get(b) == "available"]


def _module(name):
    from emcl_kernels.backends import get_backend
    return get_backend(name, torch.device("cuda"))


def check_steps(rec: Recorder) -> None:
    from emcl_testing import DTYPES, MODES, check_step_matches_reference
    for b in gpu_backends():
        mod = _module(b)
        for dtype in DTYPES:
            for op in OPS:
                rec.guard("step", lambda: check_step_matches_reference(
                    mod, op, SIZES, dtype, MODES[0], device="cuda", calls=3, meta_every=2),
                    backend=b, dtype=str(dtype)[6:], op=op, mode=MODES[0].id)
        for mode in MODES[1:]:
            rec.guard("step", lambda: check_step_matches_reference(
                mod, "inner_meta", SIZES, torch.float32, mode, device="cuda", calls=3),
                backend=b, dtype="float32", op="inner_meta", mode=mode.id)


def _odd(t):
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


def check_odd_addresses(rec: Recorder) -> None:
    from emcl_testing import (DTYPES, MODES, assert_case_close, call_step, clone_case,
                              counters_dict, make_case, new_counters, reference_backend,
                              step_hyper)
    mode = MODES[0]
    hyper = step_hyper(mode)

    def one(mod, dtype, check):
        case = make_case([70001, 4097, 9000], dtype, seed=3, device="cuda")
        case.params[0] = _odd(case.params[0])
        case.grads[1] = _odd(case.grads[1])
        case.grads[2] = _odd(case.grads[2])
        ref_dtype = torch.float64 if dtype == torch.float32 else dtype
        expected = clone_case(case, ref_dtype, device="cpu")
        c, rc = new_counters("cuda"), new_counters()
        call_step(mod, "cadence", case, mode, hyper, c, meta_every=1, check=check)
        call_step(reference_backend(), "cadence", expected, mode, hyper, rc, meta_every=1,
                  check=check)
        torch.cuda.synchronize()
        assert_case_close(case, expected, dtype, "odd addresses")
        assert counters_dict(c.cpu()) == counters_dict(rc)
        g = case.grads[2]
        g.view(-1)[8000] = float("nan")               # in a full chunk of an odd gradient
        c = new_counters("cuda")
        mod.check_finite(list(case.grads), c)
        assert counters_dict(c.cpu())["found"] == 1, "a NaN at an odd address was missed"

    for b in gpu_backends():
        mod = _module(b)
        for dtype in DTYPES:
            for check in (True, False):
                rec.guard("odd_address", lambda: one(mod, dtype, check), backend=b,
                          dtype=str(dtype)[6:], check_finite=check)


def _mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4)).to("cuda", dtype)


def _data(n, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, 32, generator=g)
    y = torch.stack([x[..., :4].sum(-1), x[..., 4:8].sum(-1), x[..., 8].sin(), x[..., 9]], -1)
    return x.to("cuda", dtype), y.to("cuda", dtype)


def check_bf16_model(rec: Recorder) -> None:
    from emcl_kernels import FusedEMCLOptimizer

    def train(backend):
        model = _mlp(torch.bfloat16)
        kw = {} if backend is None else {"backend": backend}
        opt = FusedEMCLOptimizer(model.parameters(), **kw)
        xs, ys = _data(30, torch.bfloat16)
        losses = []
        for x, y in zip(xs, ys):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        finite = all(torch.isfinite(p).all().item() for p in model.parameters())
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        assert finite, "non-finite parameters"
        assert opt.skipped_steps == 0, f"{opt.skipped_steps} steps skipped"
        assert last < first, f"the loss did not fall: {first:.4f} -> {last:.4f}"
        return {"loss_first5": round(first, 4), "loss_last5": round(last, 4),
                "backend_setting": opt.backend}

    for b in [None] + gpu_backends():
        rec.guard("bf16_model", lambda: train(b), backend=b or "default")


def check_capture(rec: Recorder) -> None:
    from emcl_kernels import FusedEMCLOptimizer, available_backends

    def run(backend):
        xs, ys = _data(10)
        twins = []
        for _ in range(2):
            model = _mlp()
            opt = FusedEMCLOptimizer(model.parameters(), inner_lr=0.05, meta_lr=0.3,
                                     meta_every=3, capturable=True, backend=backend)
            twins.append((model, opt))
        (gm, go), (em, eo) = twins
        sx, sy = xs[0].clone(), ys[0].clone()

        def iteration(model, opt, x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                       # warm-up: real steps, in order
            for x, y in zip(xs[:3], ys[:3]):
                for m, o in twins:
                    o.zero_grad(set_to_none=False)
                    iteration(m, o, x, y)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        go.zero_grad(set_to_none=False)
        with torch.cuda.graph(graph):
            iteration(gm, go, sx, sy)
        worst = 0.0
        for x, y in zip(xs[3:9], ys[3:9]):
            sx.copy_(x)
            sy.copy_(y)
            go.zero_grad(set_to_none=False)
            graph.replay()
            eo.zero_grad(set_to_none=False)
            iteration(em, eo, x, y)
            torch.cuda.synchronize()
            for p, q in zip(gm.parameters(), em.parameters()):
                worst = max(worst, (p - q).abs().max().item())
        assert worst <= 1e-5, f"replay differs from eager by {worst:.3g}"
        return {"max_abs_diff": worst}

    for b in [b for b in ("cuda", "triton", "foreach") if b in available_backends()]:
        rec.guard("capture", lambda: run(b), backend=b)


def check_counters(rec: Recorder) -> None:
    from emcl_kernels import FusedEMCLOptimizer

    def run(backend):
        out = {}
        for device in ("cuda", "cpu"):
            torch.manual_seed(0)
            model = torch.nn.Linear(9, 5).to(device)
            opt = FusedEMCLOptimizer(model.parameters(), meta_every=3,
                                     backend=backend if device == "cuda" else "reference")
            xs, ys = _data(7)
            for i, (x, y) in enumerate(zip(xs, ys)):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x[:, :9].to(device)),
                                             y[:, :1].expand(-1, 5).to(device)).backward()
                if i == 3:
                    model.weight.grad.view(-1)[4] = float("nan")
                opt.step()
            out[device] = {"skipped": opt.skipped_steps,
                           "meta_steps": [float(opt.state[p]["step"]) for p in model.parameters()],
                           "weight": model.weight.detach().double().cpu()}
        assert out["cuda"]["skipped"] == out["cpu"]["skipped"] == 1, out
        assert out["cuda"]["meta_steps"] == out["cpu"]["meta_steps"], out
        diff = (out["cuda"]["weight"] - out["cpu"]["weight"]).abs().max().item()
        assert diff < 1e-4, f"weights differ from the reference by {diff:.3g}"
        return {"skipped": out["cuda"]["skipped"], "meta_steps": out["cuda"]["meta_steps"],
                "max_abs_diff": diff}

    for b in gpu_backends():
        rec.guard("counters", lambda: run(b), backend=b)


def _median_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def check_bandwidth(rec: Recorder) -> None:
    from emcl_kernels.interface import OP
    from emcl_testing import MODES, mode_codes, new_counters, pack_hyper, step_hyper
    n = 1 << 26
    mode = [m for m in MODES if m.prox and m.lr_mode == "inverse" and m.importance == "taylor"][0]

    def run(backend):
        mod = _module(backend)
        gen = torch.Generator(device="cuda").manual_seed(0)
        p, g, a = (torch.randn(n, device="cuda", generator=gen) for _ in range(3))
        h = torch.rand(n, device="cuda", generator=gen)
        hyper, counters = pack_hyper(step_hyper(mode), "cuda"), new_counters("cuda")
        steps = torch.zeros(0, device="cuda")

        def step(check):
            mod.step([p], [g], [a], [h], [], steps, hyper, counters, op=OP["inner_meta"],
                     meta_every=1, check=check, finalize=True, **mode_codes(mode))
        src, dst = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
        copy_ms = _median_ms(lambda: dst.copy_(src))
        out = {"numel": n, "copy_GBps": round(8 * n / copy_ms / 1e6, 1)}
        for check, moved in ((False, 28), (True, 32)):   # reads p g a h (+ g), writes p a h
            ms = _median_ms(lambda: step(check))
            gbps = moved * n / ms / 1e6
            out[f"step_check_{check}_GBps"] = round(gbps, 1)
            out[f"step_check_{check}_over_copy"] = round(gbps / out["copy_GBps"], 3)
            assert gbps <= 1.05 * out["copy_GBps"], "above the copy's bandwidth: a bug"
        return out

    for b in gpu_backends():
        rec.guard("bandwidth", lambda: run(b), backend=b)


RUNNERS = {"step": check_steps, "odd_address": check_odd_addresses,
           "bf16_model": check_bf16_model, "capture": check_capture,
           "counters": check_counters, "bandwidth": check_bandwidth}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/gpu_smoke.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="append one JSON line per check to this file")
    p.add_argument("--only", help="comma-separated checks: " + ", ".join(CHECKS))
    args = p.parse_args(argv)
    only = [c for c in (args.only or "").split(",") if c] or list(CHECKS)
    unknown = [c for c in only if c not in CHECKS]
    if unknown:
        p.error(f"unknown check(s) {unknown}; the checks are {', '.join(CHECKS)}")
    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA GPU visible to torch", file=sys.stderr)
        return 2
    rec = Recorder(args.out)
    rec("env", True, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
        backends=gpu_backends())
    for name in only:
        t0 = time.time()
        RUNNERS[name](rec)
        print(f"# {name}: {time.time() - t0:.1f} s", flush=True)
    print(f"# {rec.count} checks, {rec.failed} failed", flush=True)
    return 1 if rec.failed else 0


if __name__ == "__main__":
    sys.exit(main())
