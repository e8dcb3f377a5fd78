"""Every results table and README snippet, rebuilt from the committed files with one command.

    python -m emcl_continual.tables            # rewrite results/heldout/*/tables.md (and its two figures),
                                               # results/legacy_metrics.md and the generated blocks of
                                               # README.md and docs/results.md
    python -m emcl_continual.tables --check    # exit 1 if any of them would change

Inputs: per stream ``results/heldout/STREAM/{plan.json, selected.json, validation.jsonl,
report.jsonl}`` (written by :mod:`emcl_continual.sweep.selection`), and the earlier result files
(``results/*/results.json``, ``runs.jsonl``, ``ablation.json``), whose metrics are recomputed from
their accuracy matrices. In README.md and docs/results.md, the text between
``<!-- tables:NAME -->`` and ``<!-- /tables:NAME -->`` is replaced by the block ``NAME``; blocks are named
``STREAM/headline``, ``STREAM/controls``, ``STREAM/deviations``, ``STREAM/importance``,
``STREAM/selection``, ``STREAM/visits``, ``STREAM/paper``, ``STREAM/provenance``.

Numbers are mean ± sample standard deviation (ddof = 1) over seeds; a comparison of two rows is
the paired difference over the seeds both ran (mean ± std, Student-t 95 % interval, and on how many
seeds the first row was ahead). A row that lacks some of its seeds is marked *partial*.

With anytime-evaluation runs of the same rows (``results/online/STREAM/report.jsonl``, written by
``results/online/anytime_rows.py``: the same configurations and seeds, whose training the anytime
evaluation leaves unchanged), the headline table carries AAA, WC-Acc and online accuracy, and the
block ``STREAM/online`` holds every anytime metric with the paired differences of EMCL against ER,
La-MAML and MER; the figures ``results/online/STREAM/{anytime_accuracy,stability_gap}.png`` are
drawn from them.

With the controlled benchmark's file ``results/efficiency/controlled_cpu.json`` there is also the
block ``STREAM/efficiency`` (:mod:`emcl_continual.reports.efficiency`, which also writes
``results/efficiency/README.md`` and its figures), and the time columns give that benchmark's
seconds per 1,000 samples; without the file they give the sweeps' own wall-clock, labelled
uncontrolled.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

from ..core import metrics as M
from ..sweep.selection import VALIDATION_OFF, load_runs, run_key
from .efficiency import controlled_time, load_controlled, results_dir_of, stream_blocks, write_outputs

__all__ = ["build_stream_blocks", "legacy_table", "write_figures", "write_all", "main"]

METRIC_COLS = ("acc", "bwt", "bwt_over_t", "learning_acc", "forgetting", "fwt")
METRIC_HEAD = "ACC | BWT ÷(T−1) | BWT ÷T | LA | forgetting | FWT"
ANYTIME_COLS = ("aaa", "wc_acc", "online_acc")
ANYTIME_HEAD = "AAA | WC-Acc | online acc"


def _fmt(mu, sd, digits=2) -> str:
    if mu is None or mu != mu:
        return "–"
    return f"{mu:.{digits}f} ± {sd:.{digits}f}"


def _metric_values(run: dict, name: str):
    m = run.get("metrics")
    if m is None or name not in m:
        m = M.all_metrics(run["acc_matrix"], run.get("acc_before"))
    return m.get(name)


def _stats(runs: list) -> dict:
    out = {}
    for name in METRIC_COLS:
        vals = [_metric_values(r, name) for r in runs]
        vals = [v for v in vals if v is not None]
        out[name] = M.mean_std(vals) if vals else (None, None)
    out["train_time_s"] = M.mean_std([r["train_time_s"] for r in runs]) if runs else (None, None)
    return out


def _paired(a: list, b: list, name: str = "acc") -> dict:
    return M.paired({r["seed"]: _metric_values(r, name) for r in a}, {r["seed"]: _metric_values(r, name) for r in b})


def _fmt_paired(p: dict) -> str:
    if p["n"] == 0:
        return "–"
    ci = f" [{p['ci95'][0]:+.2f}, {p['ci95'][1]:+.2f}]" if p["ci95"] else ""
    return f"{p['mean']:+.2f} ± {p['std']:.2f}{ci} ({p['n_positive']}/{p['n']})"


class StreamResults:
    """The files of one stream's held-out protocol, with rows resolved to their runs."""

    def __init__(self, folder: str):
        self.folder = folder
        self.plan = json.load(open(os.path.join(folder, "plan.json")))
        sp = os.path.join(folder, "selected.json")
        self.selected = json.load(open(sp)) if os.path.exists(sp) else {}
        self.validation = load_runs(os.path.join(folder, "validation.jsonl"))
        self.report = load_runs(os.path.join(folder, "report.jsonl"))
        self.stream = self.plan["stream"]
        self.data_root = self.plan.get("data_root")
        self.rows = {r["name"]: r for r in self.plan["rows"]}
        self._by_key = {r["key"]: r for r in self.validation + self.report}
        # the controlled timings (results/efficiency/, beside results/heldout/), or None
        self.controlled = load_controlled(results_dir_of(folder))
        # the same rows run again with anytime evaluation (results/online/STREAM/), by run key
        self.online_folder = os.path.join(results_dir_of(folder), "online", self.stream)
        online = load_runs(os.path.join(self.online_folder, "report.jsonl"))
        self._online_by_key = {r["key"]: r for r in online if r.get("anytime")}

    def runs(self, name: str) -> list:
        row = self.rows.get(name)
        if row is None:
            return []
        split = "validation" if row["role"] == "validation" else "test"
        out = []
        for s in row["seeds"]:
            r = self._by_key.get(run_key(row["method"], row["overrides"], s, split, self.data_root))
            if r is not None:
                out.append(r)
        return out

    def online_runs(self, name: str) -> list:
        """The anytime-evaluation runs of row ``name`` (results/online), in seed order."""
        row = self.rows.get(name)
        if row is None or row["role"] != "report":
            return []
        keys = [run_key(row["method"], row["overrides"], s, "test", self.data_root) for s in row["seeds"]]
        return [self._online_by_key[k] for k in keys if k in self._online_by_key]

    # what emcl_continual.reports.efficiency reads of a row through the StreamResults it is handed (it
    # does not import this module, which imports it)
    @staticmethod
    def stats_of(runs: list) -> dict:
        """Mean and std over ``runs`` of every metric column and of the training time."""
        return _stats(runs)

    @staticmethod
    def visits_of(run: dict) -> str:
        """How many times the run's method visits each incoming sample."""
        return _visits(run)

    def seeds_cell(self, name: str) -> str:
        row, rs = self.rows[name], self.runs(name)
        cell = f"{len(rs)}"
        if len(rs) < len(row["seeds"]):
            cell += f" of {len(row['seeds'])} (*partial*)"
        return cell

    def report_rows(self, kinds=None) -> list:
        return [r for r in self.plan["rows"] if r["role"] == "report" and (kinds is None or r.get("kind") in kinds)]


def _visits(run: dict) -> str:
    cfg = run["config"]
    if run["method"] in ("emcl", "lamaml"):
        return str(cfg.get("glances", 1))
    if run["method"] == "mer":
        return str(cfg.get("batches_per_example"))
    return "1"


def _config_cell(overrides: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "defaults"


def _selected_is(sr: StreamResults, method: str, config: dict) -> bool:
    """Whether the configuration selected for ``method`` is ``config`` (a run's full config)."""
    chosen = sr.selected.get("methods", {}).get(method, {}).get("overrides")
    return chosen is not None and all(config.get(k) == v for k, v in chosen.items())


def _time_head(sr: StreamResults) -> str:
    """The time column's title: the controlled benchmark's time (results/efficiency/) when there
    is one, else the sweeps' own wall-clock, labelled as uncontrolled."""
    if sr.controlled is not None:
        return "train time, s per 1,000 samples (controlled, results/efficiency)"
    return "sweep wall-clock (s, uncontrolled)"


def _time_cell(sr: StreamResults, name: str, st: dict) -> str:
    if sr.controlled is None:
        return _fmt(*st["train_time_s"], digits=0)
    t = controlled_time(sr.controlled, sr.stream, name)
    return "–" if t is None else f"{t:.2f}"


def headline(sr: StreamResults) -> str:
    from .compare import PAPER_NAMES, PAPER_TABLE_III

    paper = PAPER_TABLE_III.get(sr.stream, {})
    anytime = bool(sr._online_by_key)
    lines = [f"| method | configuration (change of its defaults) | visits per sample | seeds | {METRIC_HEAD} | "
             + (f"{ANYTIME_HEAD} | " if anytime else "") + f"ACC paper | BWT paper | {_time_head(sr)} |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" * 3 if anytime else "")]
    order = ["sgd", "ewc", "agem", "er", "gem", "mer", "lamaml/own-script", "lamaml", "emcl"]
    for name in order:
        if name not in sr.rows or not sr.runs(name):
            continue
        own = sr.runs("lamaml/own-script")
        if name == "lamaml" and own and _selected_is(sr, "lamaml", own[0]["config"]):
            continue  # the selected La-MAML is its own script's values: one row
        row, rs = sr.rows[name], sr.runs(name)
        st = _stats(rs)
        method = row["method"]
        label = PAPER_NAMES.get(method, method) + (" (own script)" if name == "lamaml/own-script" else
                                                   " (selected)" if name == "lamaml" else "")
        if name == "lamaml/own-script" and _selected_is(sr, "lamaml", rs[0]["config"]):
            label = PAPER_NAMES.get(method, method) + " (own script, also the one selected)"
        if method in paper and name != "lamaml":
            pa, psd, pb, pbsd, dag = paper[method]
            mark = " †" if dag else ""
            p_acc, p_bwt = f"{pa:.2f} ± {psd:.2f}{mark}", f"{pb:.2f} ± {pbsd:.2f}{mark}"
        else:
            p_acc = p_bwt = "–"
        cells = " | ".join(_fmt(*st[c]) for c in METRIC_COLS)
        if anytime:
            cells += " | " + _anytime_cells(sr, name, ANYTIME_COLS)
        bold = "**" if method == "emcl" else ""
        lines.append(f"| {bold}{label}{bold} | {_config_cell(row['overrides'])} | {_visits(rs[0])} | "
                     f"{sr.seeds_cell(name)} | {cells} | {p_acc} | {p_bwt} | {_time_cell(sr, name, st)} |")
    return "\n".join(lines)


def _anytime_value(run: dict, name: str):
    """An anytime metric of one run, recomputed from its record (:func:`metrics.anytime_metrics`)."""
    return M.anytime_metrics(run["anytime"]).get(name)


def _anytime_cells(sr: StreamResults, name: str, cols) -> str:
    """``mean ± std`` of each of ``cols`` over the row's anytime runs (with the seed count when
    some are missing), or dashes."""
    rs = sr.online_runs(name)
    cells = []
    for c in cols:
        vals = [v for v in (_anytime_value(r, c) for r in rs) if v is not None]
        cell = _fmt(*M.mean_std(vals)) if vals else "–"
        if vals and len(rs) < len(sr.rows[name]["seeds"]):
            cell += f" ({len(rs)} seeds)"
        cells.append(cell)
    return " | ".join(cells)


ONLINE_ROWS = ("sgd", "ewc", "agem", "er", "gem", "mer", "lamaml/own-script", "lamaml", "emcl")
ONLINE_COLS = ("aaa", "min_acc", "wc_acc", "online_acc", "gap_mean", "end_drop_mean", "recover_mean")
# EMCL is compared with these rows (paired over the seeds both ran), on these metrics
ONLINE_AGAINST = ("er", "lamaml/own-script", "lamaml", "mer")
ONLINE_PAIRED = ("gap_mean", "end_drop_mean", "aaa", "wc_acc", "online_acc")


def online(sr: StreamResults) -> str:
    """Every anytime metric per headline row (results/online), then EMCL's paired differences
    against ER, La-MAML and MER, then whether the runs trained what the committed ones did."""
    names = [n for n in ONLINE_ROWS if n in sr.rows and sr.online_runs(n)]
    if not names:
        return ""
    rec0 = sr.online_runs(names[0])[0]["anytime"]
    lines = [f"Anytime evaluation every {rec0['every']} incoming samples and at each task boundary, on "
             f"{rec0['subset_sizes'][0]} fixed images per task ({len(rec0['samples'])} points per run); "
             "metrics as defined in docs/results.md, mean ± std over seeds. Stability gap: the drop of the "
             "earlier tasks' mean accuracy in the first quarter of a task after a switch (pp, mean over the "
             "switches); end drop: the same mean at the task's end; recover: samples after a switch until half "
             "the drop is regained (mean over the switches that regained it; \"not\": switch × seed pairs that "
             "did not within the task).", "",
             "| row | seeds | AAA | min-ACC | WC-Acc | online acc | stability gap (pp) | end drop (pp) | "
             "recover (samples) | not |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        rs = sr.online_runs(n)
        cells = _anytime_cells(sr, n, ONLINE_COLS)
        nr = sum(_anytime_value(r, "not_recovered") or 0 for r in rs)
        bold = "**" if n == "emcl" else ""
        lines.append(f"| {bold}{n}{bold} | {len(rs)} of {len(sr.rows[n]['seeds'])} | {cells} | {nr} |")
    base = sr.online_runs("emcl")
    pairs = [n for n in ONLINE_AGAINST if n in names and n != "emcl"]
    if base and pairs:
        lines += ["", "EMCL minus the row, paired over the seeds both ran: mean ± std [Student-t 95 % interval] "
                      "(seeds where EMCL's value is larger / seeds). A negative stability-gap difference is a "
                      "smaller gap for EMCL.", "",
                  "| EMCL − | " + " | ".join(M.ANYTIME_NAMES.get(c, c.replace("_mean", "").replace("_", " "))
                                           for c in ONLINE_PAIRED) + " |",
                  "|---|" + "---|" * len(ONLINE_PAIRED)]
        for n in pairs:
            other = sr.online_runs(n)
            cells = [_fmt_paired(M.paired({r["seed"]: _anytime_value(r, c) for r in base},
                                          {r["seed"]: _anytime_value(r, c) for r in other}))
                     for c in ONLINE_PAIRED]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    same, total = 0, 0
    for n in names:
        committed = {r["seed"]: r for r in sr.runs(n)}
        for r in sr.online_runs(n):
            if r["seed"] in committed:
                total += 1
                same += r["acc_matrix"] == committed[r["seed"]]["acc_matrix"]
    commits = sorted({str(r.get("provenance", {}).get("commit", "?"))[:7] for n in names for r in sr.online_runs(n)})
    caps = sorted({str((r.get("processor") or r.get("provenance", {}).get("processor") or {})
                       .get("torch_cpu_capability", "?")) for n in names for r in sr.online_runs(n)})
    lines += ["", f"Runs: commit {', '.join(commits)}, torch {', '.join(caps)} kernels; {same} of {total} runs "
                  "end with the accuracy matrix of the committed run of the same row and seed, bit for bit."]
    return "\n".join(lines)


def write_online_figures(sr: StreamResults) -> list:
    """``anytime_accuracy.png`` and ``stability_gap.png`` of the headline rows' anytime runs, in
    ``results/online/STREAM/``; returns the paths written."""
    from ..output.plots import plot_anytime_accuracy, plot_stability_gap

    runs = [dict(r, method=n) for n in ONLINE_ROWS if n in sr.rows for r in sr.online_runs(n)]
    if not runs:
        return []
    return [plot_anytime_accuracy(runs, os.path.join(sr.online_folder, "anytime_accuracy.png")),
            plot_stability_gap(runs, os.path.join(sr.online_folder, "stability_gap.png"))]


def controls(sr: StreamResults) -> str:
    base = sr.runs("emcl")
    lines = [f"| row | what it changes | seeds | {METRIC_HEAD} | Δ ACC vs EMCL, paired [95 % CI] (seeds ahead) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in [sr.rows["emcl"]] + sr.report_rows(("control", "ablation", "importance")) if "emcl" in sr.rows else []:
        rs = sr.runs(row["name"])
        if not rs:
            continue
        st = _stats(rs)
        cells = " | ".join(_fmt(*st[c]) for c in METRIC_COLS)
        delta = "" if row["name"] == "emcl" else _fmt_paired(_paired(rs, base))
        lines.append(f"| {row['name']} | {row['what']} | {sr.seeds_cell(row['name'])} | {cells} | {delta} |")
    return "\n".join(lines)


def _diag(rs: list) -> dict:
    """Mean over seeds of the last task's importance diagnostics."""
    ds = [r["diagnostics"][-1] for r in rs if r.get("diagnostics")]
    if not ds:
        return {}
    keys = [k for k, v in ds[0].items() if isinstance(v, (int, float))]
    return {k: sum(d[k] for d in ds) / len(ds) for k in keys}


def importance(sr: StreamResults) -> str:
    lines = []
    vrows = [r for r in sr.plan["rows"] if r.get("group") == "importance"]
    if vrows:
        off = sr.runs(VALIDATION_OFF)
        lines += ["Validation (seeds " + ", ".join(map(str, sr.plan["validation_seeds"])) + ", validation split):", "",
                  "| candidate | seeds | ACC | Δ ACC vs importance-off (paired) | pull c, median / p99 at the end | share of elements with c > 0.1 |",
                  "|---|---|---|---|---|---|"]
        chosen = sr.selected.get("importance", {}).get("chosen", {}).get("row")
        for row in vrows:
            rs = sr.runs(row["name"])
            if not rs:
                continue
            st, d = _stats(rs), _diag(rs)
            name = f"**{row['name']}** (chosen)" if row["name"] == chosen else row["name"]
            delta = "" if row["name"] == VALIDATION_OFF else _fmt_paired(_paired(rs, off))
            pull = f"{d.get('pull_median', float('nan')):.2g} / {d.get('pull_p99', float('nan')):.2g}" if d else "–"
            share = f"{d.get('pull_gt_0.1', float('nan')):.3f}" if d else "–"
            lines.append(f"| {name} | {sr.seeds_cell(row['name'])} | {_fmt(*st['acc'])} | {delta} | {pull} | {share} |")
        imp = sr.selected.get("importance")
        if imp:
            verdict = "beats" if imp["beats_importance_off"] else "does not beat"
            lines += ["", f"On validation the chosen candidate {verdict} importance-off "
                          f"({imp['chosen']['acc_mean']:.2f} against {imp['importance_off']['acc_mean']:.2f})."]
    rrows = [n for n in ("emcl", "emcl/importance-off", "emcl/importance-best", "emcl/uniform-pull") if sr.runs(n)]
    if rrows:
        off = sr.runs("emcl/importance-off")
        lines += ["", "Report seeds (" + ", ".join(map(str, sr.plan["report_seeds"])) + ", test split):", "",
                  "| row | seeds | ACC | Δ ACC vs importance-off (paired) | pull c, median / p99 at the end | share c > 0.1 | share of meta steps damped by h |",
                  "|---|---|---|---|---|---|---|"]
        for name in rrows:
            rs = sr.runs(name)
            st, d = _stats(rs), _diag(rs)
            delta = "" if name == "emcl/importance-off" else _fmt_paired(_paired(rs, off))
            pull = f"{d.get('pull_median', float('nan')):.2g} / {d.get('pull_p99', float('nan')):.2g}" if d else "–"
            lines.append(f"| {name} | {sr.seeds_cell(name)} | {_fmt(*st['acc'])} | {delta} | {pull} | "
                         f"{d.get('pull_gt_0.1', float('nan')):.3f} | {d.get('meta_damped_share', float('nan')):.3f} |")
    return "\n".join(lines)


def selection_table(sr: StreamResults) -> str:
    lines = ["| method | configuration | validation ACC per seed | mean ± std | chosen |", "|---|---|---|---|---|"]
    decisions = dict(sr.selected.get("methods", {}))
    if sr.selected.get("algorithm-1"):
        decisions["emcl/algorithm-1"] = sr.selected["algorithm-1"]
    for method, dec in decisions.items():
        for sc in dec["scores"]:
            chosen = "**yes**" if sc["row"] == dec["chosen"]["row"] else ""
            accs = ", ".join(f"{v:.2f}" for _, v in sorted(sc["accs"].items(), key=lambda kv: int(kv[0])))
            lines.append(f"| {method} | {_config_cell(sc['overrides'])} | {accs} | "
                         f"{_fmt(sc['acc_mean'], sc['acc_std'])} | {chosen} |")
    return "\n".join(lines)


_NUMBER_WORDS = {"1": "one", "2": "two", "5": "five", "10": "ten"}


def _visits_compared(va: str, vb: str) -> str:
    """How the visits per sample of two rows compare, in words: "five visits each", "five
    visits against ten" (La-MAML's own script visits each sample 5 times on some streams and
    10 on others)."""
    wa, wb = _NUMBER_WORDS.get(va, va), _NUMBER_WORDS.get(vb, vb)
    if va == vb:
        return f"{wa} visit each" if va == "1" else f"{wa} visits each"
    return f"{wa} visit{'' if va == '1' else 's'} against {wb}"


def visits(sr: StreamResults) -> str:
    names = ["emcl", "emcl/glances=2", "emcl/glances=5", "lamaml/glances=1", "lamaml/own-script", "mer"]
    lines = [f"| row | visits per sample | seeds | ACC | BWT ÷(T−1) | {_time_head(sr)} |", "|---|---|---|---|---|---|"]
    for name in names:
        rs = sr.runs(name)
        if not rs:
            continue
        st = _stats(rs)
        lines.append(f"| {name} | {_visits(rs[0])} | {sr.seeds_cell(name)} | {_fmt(*st['acc'])} | {_fmt(*st['bwt'])} | "
                     f"{_time_cell(sr, name, st)} |")
    pairs = [("emcl", "lamaml/glances=1", None), ("emcl/glances=5", "lamaml/own-script", None),
             ("emcl", "lamaml/own-script", "each at its source's visits"), ("mer", "emcl", "MER − EMCL")]
    extra = []
    for a, b, what in pairs:
        ra, rb = sr.runs(a), sr.runs(b)
        if ra and rb:
            what = what or _visits_compared(_visits(ra[0]), _visits(rb[0]))
            extra.append(f"| {a} − {b} | {what} | {_fmt_paired(_paired(ra, rb))} |")
    if extra:
        lines += ["", "| paired difference | | Δ ACC [95 % CI] (seeds ahead) |", "|---|---|---|"] + extra
    return "\n".join(lines)


# Each deviation of EMCL's defaults from the paper, and the reported row that undoes it (its
# measured effect is EMCL − that row, paired over the report seeds). "{beta}" is the selected β.
DEVIATIONS = [
    ("inner learning rate β", "0.15 (Table II)", "{beta}, chosen on validation from 0.01, 0.03, 0.1, 0.15",
     "selected on held-out data like every method's learning rates", "emcl/table-ii-beta"),
    ("replay memory", "not listed for EMCL in the training details; the meta-loss over tasks 1..t implies past "
     "samples", "200-sample reservoir (500 on Many Permutations), 10 samples replayed per batch",
     "the paper is ambiguous; the defaults take the meta-loss reading", "emcl/no-replay"),
    ("samples of the inner loop", "the incoming batch (Algorithm 1, line 5)", "the incoming batch and the 10 "
     "replayed samples", "the closed-form meta step ignores the meta-loss gradient, so replay only acts "
     "through the inner loop (SPEC section 6)", "emcl/no-inner-replay"),
    ("meta learning rate", "eq. 8, α ← α·r/h (recurrent)", "α = α₀·r/(h + ε), r = 1/λ (inverse)",
     "eq. 8 compounds r/h every step and needs a clip the paper does not give", "emcl/recurrent"),
    ("all of Algorithm 1's choices at once", "Table II's β, batch-only inner loop, no replay, one visit, eq. 8",
     "as above", "", "emcl/algorithm-1"),
    ("the Taylor importance", "h = moving average of \\|g·θ₀\\| weights the inner pull and the meta step",
     "the same equations; h ≈ 1e-5 makes both terms vanish (see the importance rows)", "",
     "emcl/importance-off"),
    ("importance decay η", "not given", "0.9", "SPEC section 2 leaves it open", "emcl/decay=0.5"),
    ("meta-step scale r", "not given", "1/λ (so α·λ·h ≈ α₀ where h ≫ ε)", "SPEC section 2 leaves it open",
     "emcl/lr_scale=0.5/reg"),
    ("initialisation", "not given (GEM / MER use Xavier, zero biases)", "PyTorch's default", "the project's "
     "default; `--set init=xavier` gives GEM/MER's", "emcl/init=xavier"),
]


def deviations(sr: StreamResults) -> str:
    base = sr.runs("emcl")
    beta = sr.rows.get("emcl", {}).get("overrides", {}).get("inner_lr", "the default")
    lines = ["| deviation | paper | here | why | row without it | EMCL − that row: Δ ACC [95 % CI] (seeds ahead) |",
             "|---|---|---|---|---|---|"]
    for what, paper, here, why, row in DEVIATIONS:
        rs = sr.runs(row)
        effect = _fmt_paired(_paired(base, rs)) if rs and base else "not run yet"
        if rs and len(rs) < len(sr.rows[row]["seeds"]):
            effect += " (*partial*)"
        lines.append(f"| {what} | {paper} | {here.format(beta=beta)} | {why} | `{row}` | {effect} |")
    return "\n".join(lines)


# The paper's claims the "paper" rows test (results/heldout/paper_rows.py): Table IV's ACC on Split
# miniImageNet per column, and Figure 3's sentence on EMCL-SI (the figure has no numbers).
PAPER_ROWS = [
    ("emcl", "Table IV, column 1 (inner regularisation, proximal step): 46.52", 46.52),
    ("emcl/si", "Figure 3: \"the training speed of EMCL-SI is similar to EMCL but it performs worse slightly\"", None),
    ("emcl/no-prox", "Table IV, column 2 (inner regularisation, no proximal step): 46.17", 46.17),
    ("emcl/inner-lr-modulation", "Table IV, column 3 (inner learning-rate modulation, no inner regularisation, "
     "no proximal step): 45.04", 45.04),
    ("emcl/no-inner-reg", "not in the paper (column 3's removal of the inner regularisation alone)", None),
]


def paper(sr: StreamResults) -> str:
    """EMCL-SI and Table IV's columns beside the paper's numbers, paired against EMCL."""
    base = sr.runs("emcl")
    if not base or not any(sr.runs(name) for name, _, _ in PAPER_ROWS[1:]):
        return ""
    lines = ["| row | the paper (Split miniImageNet) | what it changes | seeds | ACC | BWT ÷(T−1) | "
             "h median at the end / share of elements whose meta step h damps | Δ ACC vs EMCL, paired [95 % CI] "
             "(seeds ahead) | the paper's Δ ACC |",
             "|---|---|---|---|---|---|---|---|---|"]
    paper_base = PAPER_ROWS[0][2]
    for name, claim, acc in PAPER_ROWS:
        rs = sr.runs(name)
        if not rs:
            continue
        st, d = _stats(rs), _diag(rs)
        delta = "" if name == "emcl" else _fmt_paired(_paired(rs, base))
        p_delta = "" if name == "emcl" else (f"{acc - paper_base:+.2f}" if acc is not None else "–")
        h = f"{d['h_median']:.2g} / {d.get('meta_damped_share', float('nan')):.2f}" if "h_median" in d else "–"
        what = sr.rows[name]["what"].replace("|", "\\|")
        lines.append(f"| {name} | {claim} | {what} | {sr.seeds_cell(name)} | {_fmt(*st['acc'])} | "
                     f"{_fmt(*st['bwt'])} | {h} | {delta} | {p_delta} |")
    return "\n".join(lines)


def provenance(sr: StreamResults) -> str:
    out = []
    for role, runs in (("validation", sr.validation), ("report", sr.report)):
        if not runs:
            continue
        trees = sorted({r.get("provenance", {}).get("code_tree") or "?" for r in runs})
        commits = sorted({(r.get("provenance", {}).get("commit") or "?")[:10] for r in runs})
        dirty = sum(bool(r.get("provenance", {}).get("dirty")) for r in runs)
        loads = [r["load_avg"][0] for r in runs if r.get("load_avg")]
        machines = sorted({r.get("machine", "?") for r in runs})
        sources = sorted({r.get("data_source", "?") for r in runs})
        caps: dict = {}
        for r in runs:
            proc = r.get("processor") or r.get("provenance", {}).get("processor") or {}
            cap = proc.get("torch_cpu_capability")
            key = f"{proc.get('model_name')} with torch {cap} kernels" if cap else "processor not recorded"
            caps[key] = caps.get(key, 0) + 1
        out.append(f"- {role}: {len(runs)} runs; code tree {', '.join(trees)} "
                   f"({'one code version' if len(trees) == 1 else 'SEVERAL code versions'}), commits "
                   f"{', '.join(commits)}; {dirty} run(s) from a modified working tree; {', '.join(machines)}"
                   + f"; {', '.join(f'{k} ({n})' for k, n in sorted(caps.items()))}"
                   + (f"; 1-min load average {min(loads):.1f}–{max(loads):.1f}" if loads else "")
                   + f"; data: {'; '.join(sources)}.")
    return "\n".join(out)


def build_stream_blocks(folder: str) -> dict:
    """The named markdown blocks of one stream's folder."""
    sr = StreamResults(folder)
    s = sr.stream
    blocks = {f"{s}/headline": headline(sr), f"{s}/controls": controls(sr), f"{s}/importance": importance(sr),
              f"{s}/deviations": deviations(sr),
              f"{s}/selection": selection_table(sr), f"{s}/visits": visits(sr), f"{s}/paper": paper(sr),
              f"{s}/provenance": provenance(sr), f"{s}/online": online(sr)}
    return blocks


def write_figures(folder: str) -> list:
    """``avg_accuracy.png`` of the headline rows and ``acc_bwt.png`` of EMCL's controls (report
    seeds); returns the paths written."""
    from ..output.plots import plot_acc_bwt, plot_avg_accuracy

    sr = StreamResults(folder)
    head = [n for n in ("sgd", "ewc", "agem", "er", "gem", "mer", "lamaml/own-script", "emcl") if sr.runs(n)]
    ctrl = ["emcl"] + [r["name"] for r in sr.report_rows(("control", "ablation", "importance"))]
    out = []
    for names, fname, plot in ((head, "avg_accuracy.png", plot_avg_accuracy), (ctrl, "acc_bwt.png", plot_acc_bwt)):
        runs = [dict(r, method=n) for n in names for r in sr.runs(n)]
        if runs:
            out.append(plot(runs, os.path.join(folder, fname)))
    return out + write_online_figures(sr)


def _stream_page(folder: str, blocks: dict) -> str:
    sr_stream = json.load(open(os.path.join(folder, "plan.json")))["stream"]
    titles = {"headline": "Every method at its selected configuration (report seeds, test split)",
              "controls": "EMCL's controls and ablations (report seeds, paired against EMCL)",
              "deviations": "Deviations from the paper and their measured effect",
              "importance": "Making the Taylor importance act", "visits": "Visits per incoming sample",
              "paper": "The paper's EMCL-SI (Figure 3) and ablation (Table IV), paired against EMCL",
              "online": "Anytime evaluation: AAA, WC-Acc, online accuracy and the stability gap (results/online)",
              "selection": "Selection on validation data", "provenance": "Where the runs come from"}
    parts = [f"# {sr_stream}: held-out selection and report", "",
             "Generated by `python -m emcl_continual.tables` from the files beside this one; do not edit.",
             "Mean ± std (ddof=1) over seeds; BWT ÷(T−1) is the GEM paper's definition, ÷T what the GEM / La-MAML "
             "code computes; LA = learning accuracy, FWT = forward transfer against the untrained model "
             "(`emcl_continual/core/metrics.py`).", ""]
    for key, title in titles.items():
        parts += [f"## {title}", "", blocks[f"{sr_stream}/{key}"] or "(no runs yet)", ""]
        if key == "headline" and os.path.exists(os.path.join(folder, "avg_accuracy.png")):
            parts += ["![average accuracy as tasks are learned](avg_accuracy.png)", ""]
        if key == "online" and blocks[f"{sr_stream}/online"]:
            rel = f"../../online/{sr_stream}"
            parts += [f"![anytime accuracy]({rel}/anytime_accuracy.png)", "",
                      f"![stability gap]({rel}/stability_gap.png)", ""]
        if key == "controls" and os.path.exists(os.path.join(folder, "acc_bwt.png")):
            parts += ["![ACC and BWT of EMCL's rows](acc_bwt.png)", ""]
        if key == "visits" and blocks.get(f"{sr_stream}/efficiency"):
            parts += ["## Training time and cost, controlled (`results/efficiency/`)", "",
                      f"![ACC against training time and cost](../../efficiency/{sr_stream}.png)", "",
                      blocks[f"{sr_stream}/efficiency"], ""]
    return "\n".join(parts)


# --------------------------------------------------------------------------- earlier result files
def _legacy_runs(path: str) -> list:
    if path.endswith(".jsonl"):
        return load_runs(path)
    obj = json.load(open(path))
    runs = obj.get("runs", [])
    if isinstance(runs, dict):  # ablation.json: {"config|seed": run}
        return [dict(r, method=f"{r['method']} [{k.split('|')[0]}]") for k, r in sorted(runs.items())]
    return runs


def legacy_table(results_dir: str) -> str:
    """Every metric recomputed from the accuracy matrices of the result files written before the
    held-out protocol (seeds 0–4 and earlier code; FWT needs the before-training row they lack)."""
    files = sorted(set(glob.glob(os.path.join(results_dir, "*", "results.json"))
                       + glob.glob(os.path.join(results_dir, "*", "*", "results.json"))
                       + glob.glob(os.path.join(results_dir, "*", "ablation.json"))))
    files = [f for f in files if os.sep + "heldout" + os.sep not in f]
    lines = ["# Earlier result files, every metric recomputed", "",
             "Generated by `python -m emcl_continual.tables`. These runs predate the held-out protocol "
             "(`results/heldout/`): their configurations were chosen on the same seeds (0–4) they report, "
             "with the code of their commit; they are kept as a record, not as results. The metrics are "
             "recomputed from each run's accuracy matrix (`emcl_continual/core/metrics.py`); FWT needs the "
             "before-training row these runs did not record.", "",
             f"| file | method | stream | seeds | {METRIC_HEAD} |", "|---|---|---|---|---|---|---|---|---|---|"]
    for f in files:
        runs = _legacy_runs(f)
        groups: dict = {}
        for r in runs:
            groups.setdefault((r["method"], r["stream"]), []).append(r)
        for (method, stream), rs in groups.items():
            st = _stats(rs)
            cells = " | ".join(_fmt(*st[c]) for c in METRIC_COLS)
            lines.append(f"| `{os.path.relpath(f, os.path.dirname(results_dir))}` | {method} | {stream} | "
                         f"{','.join(str(r['seed']) for r in rs)} | {cells} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- writing
_BLOCK = re.compile(r"(<!-- tables:(?P<name>[^ >]+) -->\n)(?P<body>.*?)(<!-- /tables:(?P=name) -->)", re.S)


def fill_readme(text: str, blocks: dict) -> tuple[str, list]:
    """Replace every generated block of ``text``; returns the new text and the names not found."""
    missing = []

    def sub(m):
        name = m.group("name")
        if name not in blocks:
            missing.append(name)
            return m.group(0)
        return m.group(1) + blocks[name].rstrip("\n") + "\n" + m.group(4)

    return _BLOCK.sub(sub, text), missing


def write_all(results_dir: str = "results", readme: str | None = "README.md", check: bool = False,
              pages: tuple | None = None) -> list:
    """Rebuild every generated file and fill the generated blocks of ``readme`` and ``pages``
    (those that exist; default: ``docs/results.md`` beside ``readme``); returns the paths that
    changed (with ``check``, that would)."""
    if pages is None:
        pages = (os.path.join(os.path.dirname(readme), "docs", "results.md"),) if readme else ()
    outputs: dict = {}
    blocks: dict = {}
    for folder in sorted(glob.glob(os.path.join(results_dir, "heldout", "*"))):
        if not os.path.exists(os.path.join(folder, "plan.json")):
            continue
        if not check:
            write_figures(folder)
        b = {**build_stream_blocks(folder), **stream_blocks(StreamResults(folder))}
        blocks.update(b)
        outputs[os.path.join(folder, "tables.md")] = _stream_page(folder, b)
    outputs[os.path.join(results_dir, "legacy_metrics.md")] = legacy_table(results_dir)
    streams = {StreamResults(f).stream: StreamResults(f)
               for f in sorted(glob.glob(os.path.join(results_dir, "heldout", "*")))
               if os.path.exists(os.path.join(f, "plan.json"))}
    outputs.update(write_outputs(results_dir, load_controlled(results_dir), streams, figures=not check))
    for page in ([readme] if readme else []) + list(pages or ()):
        if os.path.exists(page):
            text, missing = fill_readme(open(page).read(), blocks)
            if missing:
                print(f"note: {page} blocks without results yet: {', '.join(missing)}", file=sys.stderr)
            outputs[page] = text
    changed = []
    for path, text in outputs.items():
        old = open(path).read() if os.path.exists(path) else None
        if old != text:
            changed.append(path)
            if not check:
                tmp = path + ".tmp"
                with open(tmp, "w") as fh:
                    fh.write(text)
                os.replace(tmp, path)
    return changed


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m emcl_continual.tables", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="results")
    p.add_argument("--readme", default="README.md")
    p.add_argument("--pages", nargs="*", default=None,
                   help="more pages with generated blocks (default: docs/results.md beside --readme)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is out of date")
    args = p.parse_args(argv)
    changed = write_all(args.results, args.readme, check=args.check,
                        pages=None if args.pages is None else tuple(args.pages))
    for path in changed:
        print(("out of date: " if args.check else "wrote ") + path)
    if args.check and changed:
        return 1
    return 0
