"""The scripts under examples/ run as the README and their docstrings say, in a fresh process
from any directory (the ones that need a GPU or an optional framework skip without it)."""
import os
import re
import subprocess
import sys

import pytest

from emcl_kernels import available_backends

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def run_example(name: str, *args: str, cwd, timeout: int = 600) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "python")]))
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args],
                          capture_output=True, text=True, env=env, cwd=str(cwd),
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


ROW = re.compile(r"^(EMCL|SGD)\s+A\s+([\d.]+)% B\s+([\d.]+)%\s+A\s+([\d.]+)% B\s+([\d.]+)%$")


@pytest.mark.parametrize("backend", [b for b in ("cpu", "foreach") if b in available_backends()])
def test_quickstart_prints_both_optimizers_after_each_task(tmp_path, backend):
    """examples/quickstart.py: EMCL on the chosen backend, then plain SGD, each a row of
    held-out accuracies after task A and after task B; EMCL's state line. Each task is learnt
    while it is trained (the toy's tasks are 4-class: chance is 25 %)."""
    out = run_example("quickstart.py", "--backend", backend, cwd=tmp_path)
    assert f"using {backend!r}" in out
    rows = {m.group(1): [float(v) for v in m.groups()[1:]]
            for m in map(ROW.match, out.splitlines()) if m}
    assert set(rows) == {"EMCL", "SGD"}, out
    for a_after_a, _, _, b_after_b in rows.values():
        assert a_after_a > 50 and b_after_b > 50
    assert re.search(r"EMCL trained in [\d.]+ s; first layer state: 200 meta steps", out)
    assert "anchor dtype torch.float32" in out


def test_the_avalanche_example_runs_every_strategy(tmp_path):
    """examples/avalanche_emcl.py (with the optional Avalanche): one ACC line per strategy."""
    pytest.importorskip("avalanche")
    out = run_example("avalanche_emcl.py", "--tasks", "2", "--samples", "50", cwd=tmp_path)
    names = re.findall(r"^(\w+)\s+ACC\s+[\d.]+ %  \(2 tasks x 50 samples\)$", out, re.M)
    assert names == ["EMCL", "Naive", "LaMAML"], out


SWEEP_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%\s+([\d.]+)%$")


def test_the_array_sweep_trains_every_run_as_it_trains_alone(tmp_path):
    """examples/array_sweep.py: N MLPs with N learning rates and N reg values in one array
    (torch.func + one optimizer call per step), each run's held-out accuracy beside the same
    run trained alone: the same up to float rounding (batched matmuls sum in another order),
    and the sweep learns (the best run well above chance, 10 %)."""
    out = run_example("array_sweep.py", "--runs", "4", "--train", "1000", cwd=tmp_path)
    rows = [m.groups() for m in map(SWEEP_ROW.match, out.splitlines()) if m]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3], out
    for _, _, _, array_acc, alone_acc in rows:
        assert abs(float(array_acc) - float(alone_acc)) <= 1.5, out
    assert max(float(r[3]) for r in rows) > 40, out
    assert re.search(r"^4 runs as one array: [\d.]+ s", out, re.M)
