"""What the CLI tests share: a run small enough for a test, and the CLI run in this process."""
from __future__ import annotations

from emcl_continual import cli

TINY = ["--n-tasks", "2", "--samples-per-task", "20", "--threads", "1", "--quiet"]


def run_cli(capsys, argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m emcl_continual argv`` run in this process."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    cap = capsys.readouterr()
    return code, cap.out, cap.err
