"""One run: its configuration (``config``: defaults, overrides and every rule, for the CLI and
every caller alike), the training loop (``train.run``) and the anytime evaluator it calls
(``anytime``).

Imports ``core``, ``data`` and ``methods``.
"""
