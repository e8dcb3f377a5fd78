"""The CLI refuses bad options before any work, in one line naming the option:
unknown or misspelled hyper-parameter keys, values outside their domains, repeated or
out-of-range seeds, devices torch cannot use; and what it accepts reaches the runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from emcl_continual import cli
from emcl_continual.training import config, train
from emcl_continual.training.config import ConfigError, SEED_LIMIT
from emcl_testing import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--n-tasks", "2", "--samples-per-task", "20", "--threads", "1", "--quiet"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _refused(capsys, argv, code=2):
    """Run the CLI; it must exit with ``code`` after exactly one stderr line ``error: ...``
    and no training. Returns that line."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == code
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), cap.err
    assert "ACC" not in cap.out and "Traceback" not in cap.err
    return lines[0]


# --------------------------------------------------------------------------- keys
def test_misspelled_key_is_refused_with_the_closest_key(capsys):
    line = _refused(capsys, ["--method", "emcl", "--set", "glance=3"] + TINY)
    assert "--set glance=3" in line and "'glance'" in line and "did you mean 'glances'?" in line


def test_key_of_another_method_is_refused(capsys):
    line = _refused(capsys, ["--method", "sgd", "--set", "reg=5"] + TINY)
    assert "--set reg=5" in line and "sgd has no hyper-parameter 'reg'" in line and "lr" in line
    line = _refused(capsys, ["--method", "sgd", "--reg", "5"] + TINY)  # the named flag too
    assert line.startswith("error: --reg 5:")
    line = _refused(capsys, ["--method", "sgd", "--backend", "foreach"] + TINY)
    assert "--backend foreach" in line and "'backend'" in line


def test_seed_is_not_a_hyper_parameter(capsys):
    assert "--seeds" in _refused(capsys, ["--set", "seed=3"] + TINY)


def test_key_known_to_some_methods_applies_to_those(capsys):
    """--method emcl sgd --set glances=1: emcl gets it, sgd does not, and a note says so once."""
    assert cli.main(["--method", "emcl", "sgd", "--set", "glances=1", "--show-config"]) == 0
    cap = capsys.readouterr()
    cfg = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in cap.out.strip().splitlines()}
    assert cfg["emcl"]["glances"] == 1 and "glances" not in cfg["sgd"]
    notes = [ln for ln in cap.err.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "--set glances=1 applies to emcl only" in notes[0]


def test_split_overrides_for_method_all():
    per, notes = config.split_overrides(["sgd", "ewc", "er", "emcl"], "permuted-mnist", {"memory": 100, "lr": 0.2})
    assert per["er"] == {"memory": 100, "lr": 0.2} and per["emcl"] == {"memory": 100}
    assert per["sgd"] == {"lr": 0.2} and per["ewc"] == {"lr": 0.2}
    assert len(notes) == 2
    with pytest.raises(ConfigError, match="none of sgd, er has a hyper-parameter 'memroy'; did you mean 'memory'"):
        config.split_overrides(["sgd", "er"], "permuted-mnist", {"memroy": 1})


def test_every_default_key_has_a_type_and_passes_its_own_check():
    """Each method's defaults on each stream are accepted as they are (the schema agrees with
    the presets), and every key gets a rule."""
    from emcl_continual.methods import METHODS, get_method
    from emcl_continual.data.streams import STREAMS

    for m in METHODS:
        for s in STREAMS:
            defaults = get_method(m).defaults(s)
            assert config.validate_config(m, s, dict(defaults)) == defaults
            for key, value in config.known_keys(m, s).items():
                if value is not None:
                    assert config.rule_for(m, key, value) is not None, (m, key)


# --------------------------------------------------------------------------- values
@pytest.mark.parametrize("item, says", [
    ("memory=-5", "memory must be an integer >= 0"),
    ("replay=-3", "replay must be an integer >= 0"),
    ("glances=0", "glances must be an integer >= 1"),
    ("glances=2.5", "glances must be an integer"),
    ("glances=abc", "glances must be an integer >= 1, got 'abc'"),
    ("prox=maybe", "prox must be True or False"),
    ("lr_mode=fast", "lr_mode must be one of 'recurrent', 'inverse', 'constant'"),
    ("decay=2", "decay must be a number in [0, 1]"),
    ("reg=nan", "reg must be finite"),
    ("inner_lr=inf", "inner_lr must be finite"),
    ("meta_lr=-0.1", "meta_lr must be a number >= 0"),
    ("backend=gpu", "backend must be one of 'auto'"),
    ("lr_scale=True", "lr_scale must be a number >= 0 or None"),
])
def test_bad_values_are_one_line_errors(capsys, item, says):
    line = _refused(capsys, ["--method", "emcl", "--set", item] + TINY)
    assert says in line and item in line, line


def test_cross_key_rules_come_from_the_optimizer(capsys):
    line = _refused(capsys, ["--method", "emcl", "--set", "lr_min=1", "--set", "lr_max=0.5"] + TINY)
    assert "--set lr_max=0.5" in line and "lr_max (0.5) must be >= lr_min (1)" in line


def test_named_flags_are_checked_too(capsys):
    assert "--memory -5: memory must be an integer >= 0" in _refused(capsys, ["--memory", "-5"] + TINY)
    assert "--reg -1" in _refused(capsys, ["--reg", "-1"] + TINY)


def test_baseline_domains_match_the_methods(capsys):
    """A value the method would refuse at its start is refused before any method runs."""
    assert "memory must be an integer >= 1" in _refused(capsys, ["--method", "sgd", "er", "--memory", "0"] + TINY)
    assert "lr must be a number > 0" in _refused(capsys, ["--method", "sgd", "--lr", "0"] + TINY)


def test_accepted_values_are_normalized_and_recorded():
    cfg = train.build_config("emcl", "permuted-mnist", 0, {"memory": 1e2, "reg": 5, "prox": "false",
                                                           "lr_max": float("inf")})
    assert cfg["memory"] == 100 and type(cfg["memory"]) is int
    assert cfg["reg"] == 5.0 and type(cfg["reg"]) is float and cfg["prox"] is False
    assert cfg["memory"] == 100 and cfg["lr_max"] == float("inf")


def test_library_calls_get_the_same_checks():
    """train.run / build_config refuse what the CLI refuses (compare and ablation go through them)."""
    with pytest.raises(ConfigError, match="did you mean 'glances'"):
        train.build_config("emcl", "permuted-mnist", 0, {"glance": 3})
    with pytest.raises(ConfigError, match="replay must be an integer >= 0"):
        train.build_config("emcl", "permuted-mnist", 0, {"replay": -3})


def test_set_twice_and_malformed(capsys):
    assert "already set by --set reg=1" in _refused(capsys, ["--set", "reg=1", "--set", "reg=2"] + TINY)
    assert "already set by --reg 1" in _refused(capsys, ["--reg", "1", "--set", "reg=2"] + TINY)
    assert "KEY=VALUE" in _refused(capsys, ["--set", "novalue"] + TINY)


def test_argparse_errors_are_one_line(capsys):
    line = _refused(capsys, ["--stream", "nope"])
    assert "--stream" in line and "nope" in line
    assert "--seeds" in _refused(capsys, ["--seeds", "x"])
    assert "--n-tasks 0" in _refused(capsys, ["--n-tasks", "0"])
    assert "--batch-size 0" in _refused(capsys, ["--batch-size", "0"])
    assert "--threads -1" in _refused(capsys, ["--threads", "-1"])
    assert "given twice" in _refused(capsys, ["--method", "emcl", "emcl"])


# --------------------------------------------------------------------------- seeds
def test_repeated_seed_is_refused(capsys):
    line = _refused(capsys, ["--method", "sgd", "--seeds", "0", "0"] + TINY)
    assert "--seeds" in line and "seed 0 is given twice" in line


@pytest.mark.parametrize("seed", [-1, SEED_LIMIT, 2**63, 10**30])
def test_out_of_range_seed_is_refused(capsys, seed):
    line = _refused(capsys, ["--method", "sgd", "--seeds", str(seed)] + TINY)
    assert f"seed {seed} is outside [0, {SEED_LIMIT})" in line


def test_seed_limit_is_what_the_methods_generators_accept():
    """The largest seed allowed reaches every generator (methods seed theirs with
    seed * 1000003 + offset); one more overflows torch's seed."""
    top = SEED_LIMIT - 1
    torch.Generator().manual_seed(top * 1_000_003 + 17)
    with pytest.raises((RuntimeError, ValueError, OverflowError)):
        torch.Generator().manual_seed(SEED_LIMIT * 1_000_003 + 17)


def test_largest_seed_runs_every_method(capsys):
    """Every method starts and finishes a tiny run at the largest seed (the replay methods
    draw from their generators)."""
    from emcl_continual.data.streams import make_stream

    s = make_stream("permuted-mnist", SEED_LIMIT - 1, n_tasks=2, samples_per_task=10)
    for m in ("sgd", "er", "emcl"):
        r = train.run(m, s, SEED_LIMIT - 1, overrides={"glances": 1} if m == "emcl" else None, progress=False)
        assert r["seed"] == SEED_LIMIT - 1


# --------------------------------------------------------------------------- device
@pytest.mark.skipif(torch.cuda.is_available(), reason="the error path needs a machine without a GPU")
def test_device_cuda_without_gpu_is_one_line(capsys):
    line = _refused(capsys, ["--device", "cuda"] + TINY)
    assert "--device cuda" in line and "no CUDA GPU" in line and "--device auto" in line
    assert "--device cuda:1" in _refused(capsys, ["--device", "cuda:1"] + TINY)


def test_device_typo_is_one_line(capsys):
    assert "--device gpu" in _refused(capsys, ["--device", "gpu"] + TINY)
    assert "--device mps" in _refused(capsys, ["--device", "mps"] + TINY)


def test_device_auto_says_what_it_picked(capsys):
    assert cli.main(["--method", "sgd", "--device", "auto"] + TINY) == 0
    err = capsys.readouterr().err
    expect = "using the GPU cuda:0" if torch.cuda.is_available() else "no CUDA GPU visible to torch, using the CPU"
    assert f"note: --device auto: {expect}" in err
    dev, note = config.resolve_device("cpu")
    assert dev == torch.device("cpu") and note is None  # the default stays the CPU


# --------------------------------------------------------------------------- the process
def test_process_exit_codes_and_no_traceback(tmp_path):
    """Through a real process: one stderr line, the documented exit code, no traceback;
    --debug adds the traceback."""
    env = child_env()

    def run(*argv):
        return subprocess.run([sys.executable, "-m", "emcl_continual", *argv], capture_output=True, text=True,
                              env=env, cwd=str(tmp_path), timeout=300)

    p = run("--set", "glance=3", "--seeds", "99999999999999999999999")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and p.stderr.startswith("error: ")
    assert "Traceback" not in p.stderr
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a torch file")
    p = run("--task-file", str(bad), *TINY)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and str(bad) in p.stderr, p.stderr
    p = run("--task-file", str(bad), "--debug", *TINY)
    assert p.returncode == 1 and "Traceback" in p.stderr and p.stderr.strip().splitlines()[-1].startswith("error: ")
