"""``python -m emcl_continual.sweep_diff``: two sweeps of the same runs side by side.

The command only; what it runs is :mod:`emcl_continual.sweep.sweep_diff` (``--help`` for its options)."""
import sys

from .sweep.sweep_diff import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
