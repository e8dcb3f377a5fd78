"""The CLI as a user meets it: one command at a time per --out (a lock naming the command that
holds it; a dead holder's lock is taken over), no folder left by a refused command, messages in
the user's terms, the file named when a write fails."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from emcl_continual.core import fileio
from emcl_continual.methods import replay
from emcl_continual.output import rundir
from emcl_continual.core.errors import WriteError
from cli_testing import TINY, run_cli
from emcl_testing import child_env

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _holder(out) -> subprocess.Popen:
    """Another process that took the lock of ``out`` as a command does, and waits."""
    code = textwrap.dedent(f"""
        import sys, time
        from emcl_continual.output.rundir import RunDir
        out = RunDir({str(out)!r}, identity={{"stream": "permuted-mnist", "configs": {{}}, "data": {{}}}},
                     plan=[], command="python -m emcl_continual --method sgd --out FIRST")
        out.check()
        print("locked", flush=True)
        time.sleep(120)
    """)
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "locked"
    return proc


# --------------------------------------------------------------------------- the lock
def test_a_second_command_into_the_same_out_is_refused_naming_the_first(tmp_path, capsys):
    out = tmp_path / "o"
    first = _holder(out)
    try:
        code, stdout, err = run_cli(capsys, ["--method", "sgd", "--out", str(out)] + TINY)
        assert code == 2
        assert f"error: --out {out} is in use by `python -m emcl_continual --method sgd --out FIRST` " \
               f"(pid {first.pid}" in err
        assert f"delete {out / rundir.LOCK_FILE}" in err
        assert "ACC" not in stdout and not (out / "runs.jsonl").exists()
        # --resume and --force are refused the same way: neither may write beside a running command
        for flag in ("--resume", "--force"):
            code, _, err = run_cli(capsys, ["--method", "sgd", "--out", str(out), flag] + TINY)
            assert code == 2 and "is in use by" in err
    finally:
        first.kill()
        first.wait()
    # the holder died without releasing: its lock is stale, taken over with a note
    code, stdout, err = run_cli(capsys, ["--method", "sgd", "--out", str(out)] + TINY)
    assert code == 0, err
    assert f"took over the lock of `python -m emcl_continual --method sgd --out FIRST` (pid {first.pid}" in err
    assert len((out / "runs.jsonl").read_text().splitlines()) == 1
    assert not (out / rundir.LOCK_FILE).exists()  # released when the command ends


def test_the_lock_is_released_after_a_command_and_after_a_refusal(tmp_path, capsys):
    out = tmp_path / "o"
    assert run_cli(capsys, ["--method", "sgd", "--out", str(out)] + TINY)[0] == 0
    assert not (out / rundir.LOCK_FILE).exists()
    code, _, err = run_cli(capsys, ["--method", "sgd", "--out", str(out)] + TINY)  # holds results: refused
    assert code == 2 and "already holds" in err and not (out / rundir.LOCK_FILE).exists()
    assert run_cli(capsys, ["--method", "sgd", "--seeds", "0", "1", "--out", str(out), "--resume"] + TINY)[0] == 0
    assert len((out / "runs.jsonl").read_text().splitlines()) == 2


def test_an_unreadable_old_lock_is_taken_over(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    lock = out / rundir.LOCK_FILE
    lock.write_text("")
    os.utime(lock, (0, 0))  # written long ago, never filled in
    code, _, err = run_cli(capsys, ["--method", "sgd", "--out", str(out)] + TINY)
    assert code == 0 and "took over the lock of an unreadable lock" in err


def test_compare_run_all_takes_the_lock_too(tmp_path):
    from emcl_continual.reports import compare

    out = tmp_path / "o"
    first = _holder(out)
    try:
        with pytest.raises(rundir.OutputError, match="is in use by"):
            compare.run_all("permuted-mnist", [0], str(out), ["sgd"], log=None, n_tasks=2, samples_per_task=20)
    finally:
        first.kill()
        first.wait()


# --------------------------------------------------------------------------- refused commands leave nothing
@pytest.mark.parametrize("item", ["memory=1e300", "backend=cuda", "memory=2000000000"])
def test_a_refused_command_leaves_no_folder(tmp_path, capsys, item):
    if item == "backend=cuda" and torch.cuda.is_available():
        pytest.skip("the cuda backend runs here")
    out = tmp_path / "new" / "o"
    method = "er" if item == "memory=2000000000" else "emcl"
    code, stdout, err = run_cli(capsys, ["--method", method, "--set", item, "--out", str(out)] + TINY)
    assert code == 2 and err.startswith("error: ") and "ACC" not in stdout
    assert not (tmp_path / "new").exists()  # nor the parent it would have created
    assert os.listdir(tmp_path) == []


def test_a_refused_command_leaves_an_existing_folder_as_it_was(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for item in ("memory=1e300", "memory=2000000000"):
        code, _, _ = run_cli(capsys, ["--method", "er", "--set", item, "--out", str(out)] + TINY)
        assert code == 2 and sorted(os.listdir(out)) == ["notes.txt"]
    # a new folder inside an existing one: only the new one goes
    code, _, _ = run_cli(capsys, ["--method", "er", "--set", "memory=2000000000", "--out", str(out / "a" / "b")] + TINY)
    assert code == 2 and sorted(os.listdir(out)) == ["notes.txt"]


# --------------------------------------------------------------------------- messages in the user's terms
def test_an_absurd_memory_is_refused_by_the_schema(capsys):
    code, _, err = run_cli(capsys, ["--method", "emcl", "--set", "memory=1e300"] + TINY)
    assert code == 2
    assert err.strip() == ("error: --set memory=1e300: memory must be an integer >= 0 and at most 2147483647, "
                           "got 1e+300 (replay memory size; 0 turns replay off)")


def test_a_memory_that_cannot_be_allocated_says_so_in_samples_and_gib(capsys):
    code, _, err = run_cli(capsys, ["--method", "er", "--set", "memory=2000000000"] + TINY)
    assert code == 2 and "zeros()" not in err and "Traceback" not in err
    assert "a replay memory of 2000000000 samples of shape (784,) needs" in err and "GiB" in err
    assert "lower memory" in err


def test_a_memory_larger_than_the_device_is_refused_before_allocating(monkeypatch):
    """Where memory is overcommitted (Linux's default), allocating an impossible buffer
    succeeds and zeroing it gets the process killed: the size is compared with the device's
    memory first, and nothing is allocated."""
    assert replay.device_memory("cpu") > 2**28
    monkeypatch.setattr(replay, "device_memory", lambda device: 10 * 2**20)  # a 10 MiB machine

    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated")

    monkeypatch.setattr(replay.torch, "zeros", no_allocation)
    with pytest.raises(ValueError) as exc:
        replay.ReservoirBuffer(5000, (784,))                # 15 MiB
    assert str(exc.value) == ("a replay memory of 5000 samples of shape (784,) needs 0.0147 GiB, "
                              "which cannot be allocated on cpu (it has 0.00977 GiB); lower memory")
    monkeypatch.undo()
    assert len(replay.ReservoirBuffer(50, (784,))) == 0


# --------------------------------------------------------------------------- a write that fails names its file
def test_a_full_disk_names_the_file(tmp_path, capsys, monkeypatch):
    out = tmp_path / "o"

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "fsync", full)
    code, _, err = run_cli(capsys, ["--method", "sgd", "--out", str(out)] + TINY)
    assert code == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: cannot write ") and line.endswith(": No space left on device")
    assert str(out) in line and ".tmp" not in line  # the file itself, not its temporary
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def test_write_atomic_and_append_line_name_the_file(tmp_path):
    missing = tmp_path / "gone" / "results.json"
    with pytest.raises(WriteError, match=f"cannot write {missing}: No such file or directory"):
        fileio.write_atomic(str(missing), lambda fh: fh.write("x"))
    with pytest.raises(WriteError, match=f"cannot write {missing}: No such file or directory"):
        fileio.append_line(str(missing), "x\n")
    path = tmp_path / "ok.json"
    fileio.write_atomic(str(path), lambda fh: fh.write(json.dumps({"a": 1})))
    assert json.loads(path.read_text()) == {"a": 1}
