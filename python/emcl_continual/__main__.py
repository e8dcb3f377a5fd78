"""``python -m emcl_continual``: see :mod:`emcl_continual.cli`."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
