"""What a run is fed and what it trains: the offline data files (``sources``), the paper's task
streams (``streams``), ``--download`` (``download``) and the networks (``models``).

Imports only :mod:`emcl_continual.core`.
"""
