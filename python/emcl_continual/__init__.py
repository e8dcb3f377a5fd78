"""Online continual learning with EMCL (Zou & Lin) on the paper's streams.

``python -m emcl_continual --method emcl --stream permuted-mnist --seeds 0 1 2 3 4 --out DIR``

Modules: :mod:`.data` (offline loaders), :mod:`.streams` (task streams), :mod:`.models`
(MLP, reduced ResNet-18), :mod:`.replay` (reservoir buffer), :mod:`.methods` (EMCL and the
baselines), :mod:`.train` (one run), :mod:`.metrics` (ACC, BWT), :mod:`.report` and
:mod:`.plots` (results files), :mod:`.cli`.
"""
from .data.streams import Stream, StreamInfo, TaskData, make_stream

__all__ = ["Stream", "StreamInfo", "TaskData", "make_stream"]
