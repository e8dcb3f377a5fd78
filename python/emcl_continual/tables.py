"""``python -m emcl_continual.tables``: every results table and README snippet, from the committed files.

The command only; what it runs is :mod:`emcl_continual.reports.tables` (``--help`` for its options)."""
import sys

from .reports.tables import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
