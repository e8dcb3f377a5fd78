"""The held-out selection and its sweeps: the protocol and its stages (``selection``), the devices
and executors its runs train on (``executors``) and two sweeps side by side (``sweep_diff``).
The commands are ``python -m emcl_continual.selection`` and ``python -m emcl_continual.sweep_diff``.

Imports every group but ``reports`` and the top-level command modules.
"""
