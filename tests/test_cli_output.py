"""The CLI's output folder never loses a finished run and never passes stale files for new:
--out checked before any training, one runs.jsonl line per finished run, atomic
summaries marked complete or partial, SIGINT/SIGTERM leave a resumable partial folder,
--resume refuses another configuration, a failed plot is named and marked stale."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from emcl_continual.output.rundir import load_runs
from cli_testing import TINY, run_cli
from emcl_testing import child_env

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _results(out) -> dict:
    with open(os.path.join(out, "results.json"), encoding="utf-8") as fh:
        return json.load(fh)


def _accuracies(out) -> dict:
    return {(r["method"], r["seed"]): r["acc_matrix"] for r in _results(out)["runs"]}


# --------------------------------------------------------------------------- checked first
def test_out_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    f = tmp_path / "results.txt"
    f.write_text("keep me")
    code, out, err = run_cli(capsys, ["--method", "sgd", "--out", str(f)] + TINY[:-1])
    assert code == 2 and err.strip() == f"error: --out {f} is a file, not a folder; name a folder " \
                                        f"(it is created if missing)"
    assert "stream" not in out and "ACC" not in out  # no data read, no run
    assert f.read_text() == "keep me"
    code, _, err = run_cli(capsys, ["--method", "sgd", "--out", str(f / "sub")] + TINY)
    assert code == 2 and f"--out {f / 'sub'}: cannot write there" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_out_is_refused_before_training(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        code, out, err = run_cli(capsys, ["--method", "sgd", "--out", str(ro)] + TINY)
    finally:
        ro.chmod(0o700)
    assert code == 2 and "cannot write there" in err and "ACC" not in out


def test_a_method_that_cannot_run_fails_before_any_training(tmp_path, capsys):
    """gem with fewer memory slots than tasks fails when built, before sgd has trained."""
    out = tmp_path / "o"
    code, stdout, err = run_cli(capsys, ["--method", "sgd", "gem", "--memory", "1", "--out", str(out)] + TINY)
    note, line = err.strip().splitlines()
    assert note == "note: --memory 1 applies to gem only (the others have no 'memory')"
    assert code == 2 and line.startswith("error: gem cannot run on this permuted-mnist stream (2 tasks")
    assert "memory 1 is smaller than the number of tasks 2" in line and "ACC" not in stdout
    assert not os.path.exists(out / "runs.jsonl") and not os.path.exists(out / "results.json")


# --------------------------------------------------------------------------- the files
def test_each_run_is_kept_and_the_summary_says_complete(tmp_path, capsys):
    out = str(tmp_path / "o")
    code, stdout, _ = run_cli(capsys, ["--method", "sgd", "er", "--seeds", "3", "5", "--out", out] + TINY)
    assert code == 0
    runs = load_runs(out)
    assert [(r["method"], r["seed"]) for r in runs] == [("sgd", 3), ("er", 3), ("sgd", 5), ("er", 5)]
    obj = _results(out)
    assert obj["status"] == "complete" and obj["seeds_done"] == [3, 5] and obj["seeds_pending"] == []
    assert obj["runs_pending"] == [] and obj["runs_done"] == 4 and obj["stale_plots"] == []
    assert obj["command"].startswith("python -m emcl_continual --method sgd er --seeds 3 5 --out")
    assert obj["identity"]["configs"]["er"]["memory"] == 200 and "seed" not in obj["identity"]["configs"]["er"]
    assert [r["acc_matrix"] for r in obj["runs"]] == [r["acc_matrix"] for r in runs]
    assert all(r["warnings"] == [] for r in runs)
    assert len(open(os.path.join(out, "results.csv")).read().strip().splitlines()) == 5
    for png in ("avg_accuracy.png", "acc_bwt.png"):
        with open(os.path.join(out, png), "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]  # no temporary files left
    assert f"wrote {out}/" in stdout


def test_earlier_results_are_refused_without_force_and_replaced_with_it(tmp_path, capsys):
    out = str(tmp_path / "o")
    assert run_cli(capsys, ["--method", "sgd", "--seeds", "0", "1", "--out", out] + TINY)[0] == 0
    before = open(os.path.join(out, "results.json")).read()
    code, stdout, err = run_cli(capsys, ["--method", "sgd", "--seeds", "7", "--out", out] + TINY)
    assert code == 2 and "already holds a complete run (2 runs in runs.jsonl)" in err
    assert "--resume" in err and "--force" in err and "ACC" not in stdout
    assert open(os.path.join(out, "results.json")).read() == before
    assert run_cli(capsys, ["--method", "sgd", "--seeds", "7", "--out", out, "--force"] + TINY)[0] == 0
    assert [(r["method"], r["seed"]) for r in load_runs(out)] == [("sgd", 7)]
    assert _results(out)["status"] == "complete" and _results(out)["seeds_done"] == [7]


def test_force_leaves_the_folder_alone_when_the_command_cannot_start(tmp_path, capsys):
    out = str(tmp_path / "o")
    assert run_cli(capsys, ["--method", "sgd", "--out", out] + TINY)[0] == 0
    before = open(os.path.join(out, "runs.jsonl")).read()
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x00" * 10)
    code, _, err = run_cli(capsys, ["--method", "sgd", "--out", out, "--force", "--task-file", str(bad)] + TINY)
    assert code == 1 and str(bad) in err
    assert open(os.path.join(out, "runs.jsonl")).read() == before


def test_force_and_resume_together_or_without_out(capsys):
    assert run_cli(capsys, ["--resume", "--force", "--out", "x"] + TINY)[0] == 2
    code, _, err = run_cli(capsys, ["--resume"] + TINY)
    assert code == 2 and "--resume needs --out" in err


def test_resume_skips_finished_runs_and_adds_seeds(tmp_path, capsys):
    out = str(tmp_path / "o")
    assert run_cli(capsys, ["--method", "sgd", "--seeds", "0", "--out", out] + TINY)[0] == 0
    first = load_runs(out)
    code, stdout, _ = run_cli(capsys, ["--method", "sgd", "--seeds", "0", "1", "--out", out, "--resume"] + TINY[:-1])
    assert code == 0 and "resuming" in stdout and "sgd seed 0:" not in stdout and "sgd seed 1:" in stdout
    runs = load_runs(out)
    assert [(r["method"], r["seed"]) for r in runs] == [("sgd", 0), ("sgd", 1)] and runs[0] == first[0]
    assert _results(out)["status"] == "complete" and _results(out)["seeds_done"] == [0, 1]


@pytest.mark.parametrize("change, says", [
    (["--lr", "0.5"], "sgd lr: 0.03 there, 0.5 here"),
    (["--n-tasks", "3"], "n_tasks: 2 there, 3 here"),
    (["--stream", "many-permutations"], "stream: permuted-mnist there, many-permutations here"),
    (["--method", "sgd", "er"], "methods: sgd there, er, sgd here"),
    (["--batch-size", "5"], "batch_size: 10 there, 5 here"),
])
def test_resume_refuses_another_configuration(tmp_path, capsys, change, says):
    out = str(tmp_path / "o")
    assert run_cli(capsys, ["--method", "sgd", "--out", out] + TINY)[0] == 0
    argv = ["--method", "sgd", "--out", out, "--resume"] + TINY
    for i in range(0, len(change), 2):
        if change[i] in argv:
            j = argv.index(change[i])
            argv[j:j + 2] = []
    code, _, err = run_cli(capsys, argv + change)
    assert code == 2 and f"--resume: {out} holds runs of another configuration ({says})" in err, err


def test_resume_checks_each_run_of_a_folder_without_identity(tmp_path, capsys):
    """Folders written before results.json recorded the configuration (e.g. compare's) are
    checked run by run."""
    out = str(tmp_path / "o")
    assert run_cli(capsys, ["--method", "sgd", "--out", out] + TINY)[0] == 0
    obj = _results(out)
    del obj["identity"]
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump(obj, fh)
    code, _, err = run_cli(capsys, ["--method", "sgd", "--out", out, "--resume", "--lr", "0.2"] + TINY)
    assert code == 2 and "sgd seed 0 ran with lr=0.03, this command has 0.2" in err


def test_a_run_cut_off_mid_line_is_run_again(tmp_path, capsys):
    out = str(tmp_path / "o")
    assert run_cli(capsys, ["--method", "sgd", "--seeds", "0", "1", "--out", out] + TINY)[0] == 0
    path = os.path.join(out, "runs.jsonl")
    lines = open(path).read().splitlines()
    with open(path, "w") as fh:  # as if killed while the second line was written
        fh.write(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    code, stdout, err = run_cli(capsys, ["--method", "sgd", "--seeds", "0", "1", "--out", out, "--resume"] + TINY)
    assert code == 0 and "note: " in err and "the last line is cut off" in err and "it runs again" in err
    assert _accuracies(out)[("sgd", 1)] == json.loads(lines[1])["acc_matrix"]
    assert [(r["method"], r["seed"]) for r in load_runs(out)] == [("sgd", 0), ("sgd", 1)]  # no damaged line left


def test_resume_of_a_folder_without_runs_jsonl_keeps_its_runs(tmp_path, capsys):
    """A folder written before runs.jsonl existed (its results.json holds the runs) resumes
    without losing them."""
    out = str(tmp_path / "o")
    assert run_cli(capsys, ["--method", "sgd", "--seeds", "0", "--out", out] + TINY)[0] == 0
    first = load_runs(out)
    os.remove(os.path.join(out, "runs.jsonl"))
    assert run_cli(capsys, ["--method", "sgd", "--seeds", "0", "1", "--out", out, "--resume"] + TINY)[0] == 0
    runs = load_runs(out)
    assert [(r["method"], r["seed"]) for r in runs] == [("sgd", 0), ("sgd", 1)] and runs[0] == first[0]


# --------------------------------------------------------------------------- stale plots
def test_a_plot_that_cannot_be_written_is_named_and_marked_stale(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "acc_bwt.png").mkdir()  # a folder where the plot goes: renaming the new plot over it fails
    code, stdout, err = run_cli(capsys, ["--method", "sgd", "--out", str(out)] + TINY)
    assert code == 1 and err.startswith("error: could not write acc_bwt.png in") and "stale_plots" in err
    obj = _results(out)
    assert obj["stale_plots"] == ["acc_bwt.png"] and "acc_bwt.png" in obj["plot_errors"]
    assert obj["status"] == "complete" and len(obj["runs"]) == 1
    assert (out / "avg_accuracy.png").read_bytes()[:4] == b"\x89PNG"
    assert len((out / "results.csv").read_text().splitlines()) == 2
    assert "avg_accuracy.png" in stdout and "acc_bwt.png" not in stdout.split("wrote")[-1]


# --------------------------------------------------------------------------- interrupts
def _spawn(argv, cwd):
    env = child_env()
    return subprocess.Popen([sys.executable, "-m", "emcl_continual", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=str(cwd))


def _interrupt_after_first_run(proc, out, sig):
    path = os.path.join(out, "runs.jsonl")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(path) and open(path).read().count("\n") >= 1:
            proc.send_signal(sig)
            break
        time.sleep(0.01)
    stdout, stderr = proc.communicate(timeout=240)
    return proc.returncode, stdout, stderr


def test_sigint_keeps_finished_seeds_and_resume_finishes_like_an_uninterrupted_run(tmp_path, capsys):
    seeds = ["--seeds", "0", "1", "2", "3"]
    out = str(tmp_path / "cut")
    argv = ["--method", "sgd"] + seeds + ["--out", out] + TINY
    code, _, stderr = _interrupt_after_first_run(_spawn(argv, tmp_path), out, signal.SIGINT)
    assert code == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted: SIGINT: ") and "resume with: python -m emcl_continual" in last
    assert last.endswith("--resume") and "Traceback" not in stderr
    obj = _results(out)
    done = len(load_runs(out))
    assert 1 <= done < 4 and obj["status"] == "partial" and len(obj["runs"]) == done
    assert f"{done} of 4 runs finished" in last
    assert obj["seeds_pending"] == [s for s in range(4) if ("sgd", s) not in {(r["method"], r["seed"]) for r in
                                                                               obj["runs"]}]
    # resume in this process, then compare with an uninterrupted run
    assert run_cli(capsys, argv + ["--resume"])[0] == 0
    whole = str(tmp_path / "whole")
    assert run_cli(capsys, ["--method", "sgd"] + seeds + ["--out", whole] + TINY)[0] == 0
    assert _results(out)["status"] == "complete"
    assert _accuracies(out) == _accuracies(whole) and len(_accuracies(out)) == 4
    assert len(load_runs(out)) == 4


def test_sigterm_leaves_a_partial_folder(tmp_path):
    out = str(tmp_path / "cut")
    argv = ["--method", "sgd", "--seeds", "0", "1", "2", "3", "--out", out] + TINY
    code, _, stderr = _interrupt_after_first_run(_spawn(argv, tmp_path), out, signal.SIGTERM)
    assert code == 130 and "interrupted: SIGTERM" in stderr, stderr
    assert _results(out)["status"] == "partial" and 1 <= len(load_runs(out)) < 4
