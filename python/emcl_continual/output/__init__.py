"""Where a command's results go: the ``--out`` folder (``rundir``), ``results.json`` / ``.csv``
(``report``), the PNG plots (``plots``) and the experiment trackers of ``--log`` (``trackers``).

Imports only :mod:`emcl_continual.core`.
"""
