"""``python -m emcl_continual.selection``: the held-out selection and the reported sweeps.

The command only; what it runs is :mod:`emcl_continual.sweep.selection` (``--help`` for its options)."""
import sys

from .sweep.selection import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
