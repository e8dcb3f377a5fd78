"""The benchmark scripts: SPEC section 5's byte model, the backends they pick up, the records
they write, the README table made from them, and the end-to-end training benchmark.

Every run here is the real script on real tensors, shrunk (one small size, few repeats) so the
file takes seconds.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import bench_kernels, bench_training, common, make_readme_table  # noqa: E402

from emcl_kernels.backends import BACKENDS, get_backend  # noqa: E402

REQUIRED = ("backend", "op", "dtype", "layout", "numel", "time_ms", "gbps", "copy_gbps", "device")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# The byte model
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op, dtype, lr_mode, expected", [
    # SPEC section 5, fp32 θ and g: inner 20 B; meta 28 B (36 B recurrent); combined as meta.
    ("inner_step", torch.float32, "inverse", 20),
    ("inner_step", torch.float32, "recurrent", 20),
    ("meta_step", torch.float32, "inverse", 28),
    ("meta_step", torch.float32, "constant", 28),
    ("meta_step", torch.float32, "recurrent", 36),
    ("inner_meta_step", torch.float32, "inverse", 28),
    ("inner_meta_step", torch.float32, "recurrent", 36),
    # bf16 / fp16 θ and g save 2 B on each of their reads and writes (θ read+write, g read).
    ("inner_step", torch.bfloat16, "inverse", 14),
    ("meta_step", torch.bfloat16, "inverse", 22),
    ("meta_step", torch.bfloat16, "recurrent", 30),
    ("inner_meta_step", torch.bfloat16, "inverse", 22),
    ("inner_meta_step", torch.float16, "recurrent", 30),
])
def test_byte_model_matches_spec(op, dtype, lr_mode, expected):
    assert common.bytes_per_element(op, dtype, lr_mode) == expected


def test_byte_model_rejects_unknown_op_and_mode():
    with pytest.raises(ValueError, match="op must be"):
        common.bytes_per_element("step", torch.float32)
    with pytest.raises(ValueError, match="lr_mode"):
        common.bytes_per_element("meta_step", torch.float32, "adaptive")


# ---------------------------------------------------------------------------------------------
# Backends, layouts, rotation, statistics
# ---------------------------------------------------------------------------------------------

def _works_on_cpu(name):
    try:
        get_backend(name, torch.device("cpu"))
        return True
    except Exception:  # noqa: BLE001
        return False


def test_backends_for_cpu_picks_every_available_backend_but_interpreted_triton():
    chosen, skipped = common.backends_for(torch.device("cpu"))
    assert set(chosen) | set(skipped) == set(BACKENDS)
    assert {"reference", "foreach"} <= set(chosen)
    assert "triton" not in chosen and "cuda" not in chosen
    for name in BACKENDS:
        if name != "triton":
            assert (name in chosen) == _works_on_cpu(name), name
    if _works_on_cpu("triton"):
        assert "interpreter" in skipped["triton"]
        with_triton, _ = common.backends_for(torch.device("cpu"), include_cpu_triton=True)
        assert "triton" in with_triton
    assert skipped["cuda"]  # a reason, never empty


def test_backends_for_filters_and_rejects_unknown_names():
    chosen, skipped = common.backends_for(torch.device("cpu"), only=["foreach"])
    assert chosen == ["foreach"]
    assert "not asked" in skipped["reference"]
    with pytest.raises(ValueError, match="unknown backend"):
        common.backends_for(torch.device("cpu"), only=["fused"])


def test_layouts_come_from_the_project_models():
    layouts, skipped = bench_kernels.build_layouts(["single", "mlp", "resnet18", "many"], [10, 12])
    assert not skipped
    by_name = {(l.name, l.numel): l for l in layouts}
    assert ("single", 1024) in by_name and ("single", 4096) in by_name
    mlp = by_name[("mlp-2x100", 784 * 100 + 100 + 100 * 100 + 100 + 100 * 10 + 10)]
    assert mlp.n_tensors == 6
    from emcl_continual.models import ReducedResNet18
    from emcl_continual.streams import StreamInfo
    model = ReducedResNet18(StreamInfo("x", 20, (3, 32, 32), 100, [(5 * t, 5 * t + 5) for t in range(20)], True))
    resnet = [l for l in layouts if l.name == "resnet18-reduced"][0]
    assert resnet.numel == sum(p.numel() for p in model.parameters())
    assert resnet.n_tensors == len(list(model.parameters()))
    many = [l for l in layouts if l.name == "many-1000x4096"][0]
    assert many.n_tensors == 1000 and many.numel == 1000 * 4096


def test_rotated_sets_exceed_the_last_level_cache():
    s = bench_kernels.Settings.full()
    llc = 32 << 20
    for set_bytes in (16 << 10, 1 << 20, 7_000_003, 64 << 20, 1 << 30):
        n = bench_kernels.n_sets_for(set_bytes, llc, s)
        assert 1 <= n <= s.max_sets
        assert n * set_bytes >= s.rotate_factor * llc or n == s.max_sets
        assert n == 1 or (n - 1) * set_bytes < s.rotate_factor * llc  # no more than needed


def test_input_sets_are_random_and_shaped_like_the_layout():
    layout = bench_kernels.Layout("x", [(3, 5), (7,)])
    gen = torch.Generator().manual_seed(0)
    s = bench_kernels.make_input_set(layout, torch.bfloat16, torch.device("cpu"), gen, with_meta_lrs=True)
    assert [tuple(t.shape) for t in s.params] == [(3, 5), (7,)]
    assert all(t.dtype == torch.bfloat16 for t in s.params + s.grads)
    assert all(t.dtype == torch.float32 for t in s.anchors + s.importances + s.meta_lrs)
    assert all(bool((t != 0).all()) for t in s.grads + s.importances + s.meta_lrs)
    assert s.nbytes == 22 * 2 * 2 + 22 * 4 * 3


def test_stats_and_repeats():
    st = common.Stats.of([0.004, 0.001, 0.002, 0.003, 0.1])
    assert st.median_ms == pytest.approx(3.0) and st.min_ms == pytest.approx(1.0)
    assert st.repeats == 5 and st.q25_ms <= st.median_ms <= st.q75_ms
    assert common.repeats_for(0.01, 0.25, 3, 50) == 25
    assert common.repeats_for(10.0, 0.25, 3, 50) == 3
    assert common.repeats_for(1e-6, 0.25, 3, 50) == 50
    calls = []
    out = common.time_calls([lambda: calls.append(1)] * 100, torch.device("cpu"),
                            max_total_s=0.0, min_calls=4)
    assert len(out) == 4 == len(calls)


# ---------------------------------------------------------------------------------------------
# A shrunk kernel benchmark run
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernel_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = bench_kernels.main(["--quick", "--sizes", "10", "--layouts", "single", "mlp",
                                 "--budget", "0.002", "--max-reps", "3", "--device", "cpu",
                                 "--rotate-mb", "2", "--copy-mb", "8", "--threads", "1",
                                 "--out-dir", str(out), "--name", "run", "--quiet"])
    return result, out


def test_kernel_run_has_a_record_for_every_backend_op_dtype_and_layout(kernel_run):
    result, out = kernel_run
    backends, _ = common.backends_for(torch.device("cpu"))
    keys = {(r["backend"], r["op"], r["dtype"], r["layout"]) for r in result["records"]}
    expected = {(b, o, d, l) for b in backends for o in common.OPS for d in ("fp32", "bf16")
                for l in ("single", "mlp-2x100")}
    assert keys == expected
    assert len(result["records"]) == len(expected)
    with open(out / "run.json") as f:
        saved = json.load(f)
    assert saved["records"] == json.loads(json.dumps(result["records"]))
    assert (out / "run_cpu.png").read_bytes()[:8] == PNG_MAGIC


def test_kernel_records_are_consistent(kernel_run):
    result, _ = kernel_run
    copy = result["devices"]["cpu"]["copy_gbps"]
    assert copy > 0
    index = {(r["backend"], r["op"], r["dtype"], r["layout"]): r for r in result["records"]}
    for r in result["records"]:
        for key in REQUIRED:
            assert r[key] is not None, key
        assert r["device"] == "cpu" and r["lr_mode"] == "inverse" and r["timer"] == "perf_counter"
        bpe = common.bytes_per_element(r["op"], common.DTYPE_NAMES[r["dtype"]], "inverse")
        assert r["bytes_per_element"] == bpe and r["bytes"] == bpe * r["numel"]
        assert r["gbps"] == pytest.approx(r["bytes"] / (r["time_ms"] / 1e3) / 1e9)
        assert r["copy_gbps"] == copy and r["ratio_to_copy"] == pytest.approx(r["gbps"] / copy)
        assert r["time_ms_min"] <= r["time_ms"] and 1 <= r["repeats"] <= 3
        assert r["launches"] is None and r["finite"] is True
        assert r["rotation_bytes"] >= 2 << 20 and r["rotation_sets"] >= 2
        for base in ("reference", "foreach"):
            other = index[(base, r["op"], r["dtype"], r["layout"])]
            assert r[f"speedup_vs_{base}"] == pytest.approx(other["time_ms"] / r["time_ms"])
        if r["backend"] == "foreach":
            assert r["speedup_vs_foreach"] == 1.0


def test_kernel_run_says_what_it_left_out(kernel_run):
    result, _ = kernel_run
    info = result["devices"]["cpu"]
    assert "cuda" in info["skipped_backends"]
    if _works_on_cpu("triton"):
        assert "interpreter" in info["skipped_backends"]["triton"]
    assert result["settings"]["mode"] == "quick"
    table = bench_kernels.format_table(result)
    assert "copy bandwidth" in table and "not timed: cuda" in table


def test_reference_is_capped(tmp_path):
    result = bench_kernels.main(["--sizes", "10", "12", "--layouts", "single", "--ops", "inner_step",
                                 "--dtypes", "fp32", "--reference-cap", "10", "--budget", "0.001",
                                 "--max-reps", "2", "--device", "cpu", "--out-dir", str(tmp_path),
                                 "--rotate-mb", "1", "--copy-mb", "8", "--threads", "1", "--no-plot", "--quiet", "--backends", "reference", "foreach"])
    sizes = {(r["backend"], r["numel"]) for r in result["records"]}
    assert sizes == {("reference", 1024), ("foreach", 1024), ("foreach", 4096)}
    assert any("reference backend timed only up to 1024" in n for n in result["devices"]["cpu"]["notes"])
    big = [r for r in result["records"] if r["numel"] == 4096][0]
    assert big["speedup_vs_reference"] is None


def test_readme_table_comes_from_the_results_file(kernel_run):
    result, out = kernel_run
    text = make_readme_table.main([str(out / "run.json"), "--sizes", "10"])
    assert result["devices"]["cpu"]["name"] in text
    assert f"{result['devices']['cpu']['copy_gbps']:.1f} GB/s" in text
    rows = [l for l in text.splitlines() if l.startswith("| ") and "GB/s" in l]
    backends = list(dict.fromkeys(r["backend"] for r in result["records"]))
    assert len(rows) == 2 * 2 * 3  # 2 layouts x 2 dtypes x 3 ops
    op_of = {v: k for k, v in make_readme_table.OP_SHORT.items()}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        layout = "single" if cells[0].startswith("single") else cells[0]
        for b, cell in zip(backends, cells[4:]):
            rec = [r for r in result["records"] if r["backend"] == b and r["layout"] == layout
                   and r["dtype"] == cells[2] and r["op"] == op_of[cells[3]]][0]
            gb = float(re.match(r"([0-9.]+) GB/s", cell).group(1))
            assert gb == pytest.approx(rec["gbps"], abs=0.006)
        fastest = min((r for r in result["records"] if r["layout"] == layout and r["dtype"] == cells[2]
                       and r["op"] == op_of[cells[3]]), key=lambda r: r["time_ms"])
        assert f"**{fastest['backend']}**" in cells[-1]


def test_kernel_script_runs_from_the_command_line(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_kernels.py"), "--quick",
           "--sizes", "10", "--layouts", "single", "--dtypes", "bf16", "--ops", "meta_step",
           "--budget", "0.001", "--max-reps", "2", "--device", "cpu", "--out-dir", str(tmp_path),
           "--rotate-mb", "1", "--copy-mb", "8", "--threads", "1", "--name", "cli",
           "--quiet", "--no-plot"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds the repo itself
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "copy bandwidth" in proc.stdout and "meta_step" in proc.stdout
    assert (tmp_path / "cli.json").exists()


# ---------------------------------------------------------------------------------------------
# The end-to-end training benchmark
# ---------------------------------------------------------------------------------------------

def test_training_benchmark_times_emcl_per_backend(tmp_path):
    result = bench_training.main(["--n-tasks", "1", "--samples-per-task", "20", "--methods", "emcl",
                                  "--backends", "reference", "foreach", "--out-dir", str(tmp_path),
                                  "--name", "train"])
    labels = [r["label"] for r in result["records"]]
    assert labels == ["emcl (reference)", "emcl (foreach)"]
    for r in result["records"]:
        assert r["train_time_s"] > 0 and r["n_batches"] == 2 and r["device"] == "cpu"
        assert r["ms_per_batch"] == pytest.approx(1e3 * r["train_time_s"] / 2)
        assert 0.0 <= r["acc"] <= 100.0
    # same stream, same seed, same math: both backends learn the same thing
    assert result["records"][0]["acc"] == pytest.approx(result["records"][1]["acc"], abs=1e-6)
    assert [s["label"] for s in result["summary"]] == labels
    assert (tmp_path / "train.png").read_bytes()[:8] == PNG_MAGIC
    with open(tmp_path / "train.json") as f:
        assert json.load(f)["settings"]["n_tasks"] == 1


def test_training_benchmark_plans_baselines_once_and_emcl_per_backend():
    assert bench_training.plan_runs(["emcl", "sgd", "er"], ["foreach", "cpu"]) == [
        ("emcl", "foreach"), ("emcl", "cpu"), ("sgd", None), ("er", None)]


def test_training_benchmark_fails_clearly_without_emcl_continual(monkeypatch):
    for name in [m for m in sys.modules if m == "emcl_continual" or m.startswith("emcl_continual.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "emcl_continual", None)
    with pytest.raises(SystemExit, match="needs the emcl_continual package"):
        bench_training.main(["--quick", "--no-plot"])


def test_training_benchmark_rejects_missing_methods():
    with pytest.raises(SystemExit, match="unknown method"):
        bench_training.main(["--methods", "nope", "--no-plot"])
