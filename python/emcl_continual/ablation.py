"""``python -m emcl_continual.ablation``: SPEC section 2's open defaults and the Table IV switches.

The command only; what it runs is :mod:`emcl_continual.reports.ablation` (``--help`` for its options)."""
import sys

from .reports.ablation import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
