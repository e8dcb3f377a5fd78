"""The reported tables and figures: every results table rebuilt from the committed files
(``tables``), efficiency like for like (``efficiency``), every method beside the paper's Table III
(``compare``) and the ablation of the open defaults (``ablation``). The commands are ``python -m
emcl_continual.tables``, ``.compare`` and ``.ablation``.

Imports every group but the top-level command modules.
"""
