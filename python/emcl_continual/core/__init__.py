"""What every part of the package shares: the errors and exit codes (``errors``), the rules of a
hyper-parameter (``schema``), atomic writes (``fileio``), the paper's settings and the selection
protocol (``presets``), the continual-learning metrics (``metrics``), what a run records about its
code and processor (``provenance``) and what the commands share (``command``: the parser, the
error guard).

Imports nothing from the rest of the package (``tests/test_cl_layout.py``).
"""
