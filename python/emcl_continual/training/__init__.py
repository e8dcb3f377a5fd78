"""One run: its configuration (``config``: defaults, overrides and every rule, for the CLI and
every caller alike), the training loop (``train.run``), the anytime evaluator it calls
(``anytime``) and the machine-independent cost counter (``cost.CostCounter``: forward and
backward passes and weight updates, counted by hooks on a learner).

Imports ``core``, ``data`` and ``methods``.
"""
