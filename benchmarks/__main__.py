"""``python -m benchmarks``: the suite's entry (see ``benchmarks/suite.py``)."""
import sys

from benchmarks.suite import main

sys.exit(main())
