"""``python -m emcl_continual.compare``: every method on one stream beside the paper's Table III.

The command only; what it runs is :mod:`emcl_continual.reports.compare` (``--help`` for its options)."""
import sys

from .reports.compare import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
