"""Online continual learning with EMCL (Zou & Lin) on the paper's streams.

``python -m emcl_continual --method emcl --stream permuted-mnist --seeds 0 1 2 3 4 --out DIR``

Sub-packages, each importing only those before it: :mod:`.core` (errors, rules, presets,
metrics, provenance), :mod:`.data` (data files, task streams, models), :mod:`.methods` (EMCL
and the baselines, the replay buffer), :mod:`.training` (configuration, one run, anytime
evaluation), :mod:`.arrays` (run arrays), :mod:`.output` (``--out``, results files, plots,
trackers), :mod:`.sweep` (the held-out selection), :mod:`.reports` (the reported tables). The
commands are :mod:`.cli` and the top-level modules named after them.
"""
from .data.streams import Stream, StreamInfo, TaskData, make_stream

__all__ = ["Stream", "StreamInfo", "TaskData", "make_stream"]
