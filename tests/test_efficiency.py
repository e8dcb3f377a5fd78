"""The efficiency page and the tables' time columns (emcl_continual.reports.efficiency, tables): built
from a controlled benchmark file of `bench_training.py --heldout`, and labelled for what they are
without one."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_training  # noqa: E402

from emcl_continual.reports import efficiency, tables  # noqa: E402

REPO = bench_training.common.REPO
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_pareto_front():
    pts = [(1.0, 50.0), (2.0, 60.0), (3.0, 55.0), (2.0, 60.0), (10.0, 70.0), (0.5, 40.0), (10.0, 69.0)]
    # (3, 55) is beaten by (2, 60); (10, 69) by (10, 70); the two equal points both stay
    assert efficiency.pareto_front(pts) == {0, 1, 3, 4, 5}


@pytest.fixture(scope="module")
def results_copy(tmp_path_factory):
    """results/heldout/permuted-mnist copied, and a controlled file from timing two of its rows
    (fine-tuning and EMCL) on its first task, one round."""
    root = tmp_path_factory.mktemp("results")
    shutil.copytree(os.path.join(REPO, "results", "heldout", "permuted-mnist"),
                    root / "heldout" / "permuted-mnist")
    bench_training.main(["--heldout", str(root / "heldout"), "--streams", "permuted-mnist", "--rows", "sgd", "emcl",
                         "--heldout-samples", "1000", "--rounds", "1", "--out-dir", str(root / "efficiency"),
                         "--name", "controlled_cpu"])
    return root


def _headline(page: str) -> list:
    block = page.split("## Every method")[1].split("\n\n")[1]
    return [line.split(" | ") for line in block.splitlines()]


def test_tables_take_the_controlled_time(results_copy):
    root = results_copy
    controlled = json.load(open(root / "efficiency" / "controlled_cpu.json"))
    per = {s["row"]: s["ms_per_sample"] for s in controlled["summary"]}
    tables.write_all(str(root), readme=None)
    rows = _headline(open(root / "heldout" / "permuted-mnist" / "tables.md").read())
    assert rows[0][-1] == "train time, s per 1,000 samples (controlled, results/efficiency) |"
    cells = {r[0].strip("| *"): r[-1].rstrip(" |") for r in rows[2:]}
    assert cells["EMCL"] == f"{per['emcl']:.2f}" and cells["Fine-tune (SGD)"] == f"{per['sgd']:.2f}"
    assert cells["MER"] == "–"  # not timed in this file
    page = open(root / "efficiency" / "README.md").read()
    assert "![ACC against training time and cost](permuted-mnist.png)" in page
    assert f"| **`emcl`** | 1 | 70.90 ± 0.83 | {per['emcl']:.2f} (" in page
    assert open(root / "efficiency" / "permuted-mnist.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert tables.write_all(str(root), readme=None, check=True) == []


def test_without_the_controlled_file_the_sweep_time_is_labelled_uncontrolled(results_copy, tmp_path):
    root = tmp_path / "results"
    shutil.copytree(results_copy / "heldout", root / "heldout")
    tables.write_all(str(root), readme=None)
    rows = _headline(open(root / "heldout" / "permuted-mnist" / "tables.md").read())
    assert rows[0][-1] == "sweep wall-clock (s, uncontrolled) |"
    sr = tables.StreamResults(str(root / "heldout" / "permuted-mnist"))
    st = tables._stats(sr.runs("emcl"))
    emcl = next(r for r in rows[2:] if "EMCL" in r[0])
    assert emcl[-1].rstrip(" |") == tables._fmt(*st["train_time_s"], digits=0)
    assert not (root / "efficiency").exists()


def test_whole_stream_file_adds_its_sentence(results_copy, tmp_path):
    root = tmp_path / "results"
    shutil.copytree(results_copy, root)
    bench_training.main(["--heldout", str(root / "heldout"), "--streams", "permuted-mnist", "--rows", "gem",
                         "--heldout-samples", "2000", "--rounds", "1", "--out-dir", str(root / "efficiency"),
                         "--name", "whole_stream_cpu"])
    whole = json.load(open(root / "efficiency" / "whole_stream_cpu.json"))["summary"][0]
    tables.write_all(str(root), readme=None)
    sentence = (f"`gem` over the whole stream (2 tasks, 2,000 samples; `results/efficiency/whole_stream_cpu.json`, "
                f"1 timed round(s), not interleaved with the rows above): {whole['ms_per_sample']:.2f} s per 1,000 "
                f"samples (CPU {whole['cpu_ms_per_sample']:.2f}), 1.5 forward / 1.5 backward passes per sample.")
    assert sentence in open(root / "efficiency" / "README.md").read()
    assert sentence in open(root / "heldout" / "permuted-mnist" / "tables.md").read()
