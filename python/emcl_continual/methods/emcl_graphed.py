r"""EMCL's glance as a static-buffer routine, replayed from a CUDA graph on a GPU.

**Why.** Per incoming batch of 10, EMCL runs G glances (2 on the MNIST streams), each 20
one-sample inner steps (forward, backward, ``opt.inner_step()``) and one meta step: about
84,000 tiny forward/backward/step sequences per Permuted-MNIST run. Each costs dozens of
kernel launches from Python. Measured on an H100 (shared/gpu-evidence, 2026-11-26): the paper's one-sample inner step on the MLP took 716.6 µs eagerly on CUDA,
357.9 µs on one CPU thread and 52.8 µs replayed from a CUDA graph; the whole run took 85.4 s
on the GPU against 57.0 s on that machine's CPU. The GPU waits on the host: EMCL's kernels
themselves take 11.5 µs of device time per step on that MLP.

**What.** One glance is captured as one graph: the gather of the replayed rows from the
reservoir buffer, the 20 (more generally ``n_inner``) inner steps and the meta step, with
``zero_grad(set_to_none=True)`` between them so that every backward allocates its gradients
in the graph's private pool. Per glance the host then only draws the replay indices from the
method's CPU generator (the same draw as the eager path, so a seed gives the same replay
samples on every device), checks that the optimizer's state tensors are still the captured
ones, copies the incoming batch and the indices into the static input buffers (the indices
through pinned memory, without a sync) and launches one replay: a few copies and one launch
where the eager glance costs 21 x 716.6 µs ≈ 15 ms of launches on that H100. The index draw
and the state check cost 52 and 40 µs on a loaded 2-core CPU (load average 11),
far less on a quiet host, and they overlap the previous replay. Predicted from the measured
replay cost: 84,000 x ~53 µs ≈ 4.5 s of device time for a whole Permuted-MNIST run, against
57.0 s on the CPU. The loss is a static
output read once per batch (``observe`` returns a float).

**Shapes.** A graph is built per static shape ``(batch, replayed rows)``: the first batch of
a run sees an empty buffer (no replay), a short last batch of a task has fewer samples, and a
buffer smaller than ``replay`` returns fewer rows. Each shape's first ``warmup`` glances run
eagerly on a side stream (real training steps, in order; they create the optimizer state
and cuBLAS/cuDNN workspaces before capture, as torch's whole-network capture recipe asks),
the next one is captured on that stream and replayed, and every later glance of that shape
is one replay. A shape seen fewer than ``warmup + 1`` times (the first batch: 2 glances) is
never captured. Graphs are dropped and rebuilt when a tensor they read was replaced (the
parameters, the optimizer's state or hyper-parameter tensors, the buffer), e.g. by
``load_state_dict``.

**Where it does not capture.** On the CPU the same routine runs eagerly, op for op the
eager ``observe``: same parameters, optimizer state and replay draws, bit for bit
(``tests/test_graphed.py``). On a GPU it stays eager, saying so once, for the
``inner_lr_modulation`` ablation (its step reads hyper-parameters on the host) and when a
capture fails (the reason is in the warning and in :attr:`GlanceRoutine.status`). The
optimizer is built with ``capturable=True`` on a GPU so that its hyper-parameters and step
counters live on the device and its steps never sync with the host.

**Alternatives.** ``torch.compile(mode="reduce-overhead")`` over the same routine breaks its
graph at every ``backward()`` and at the optimizer's Python, leaving ~40 compiled pieces per
glance with Python between them; capturing one inner step instead of the glance needs 21
replays per glance instead of one. Neither has been measured.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

__all__ = ["GlanceRoutine", "StaticGlance", "graph_plan", "GRAPH_CHOICES"]

# config["cuda_graph"]: "auto" = captured on a GPU, today's eager loop on the CPU; True = the
# static-buffer routine everywhere (captured on a GPU, eager on the CPU); False = eager loop.
GRAPH_CHOICES = ("auto", True, False)


def graph_plan(config: dict, device: torch.device) -> tuple[bool, bool, Optional[str]]:
    """``(use_routine, capture, why_not)`` for EMCL's ``config`` on ``device``.

    ``use_routine``: run glances through :class:`GlanceRoutine`; ``capture``: capture them in
    CUDA graphs (and build the optimizer with ``capturable=True``); ``why_not``: why a GPU run
    asked for graphs stays eager (said once by the method), else None.
    """
    choice = config.get("cuda_graph", "auto")
    if not (choice is True or choice is False or choice == "auto"):
        raise ValueError(f"emcl: cuda_graph must be 'auto', True or False, got {choice!r}")
    device = torch.device(device)
    if choice is False:
        return False, False, None
    on_gpu = device.type == "cuda"
    if choice == "auto" and not on_gpu:
        return False, False, None
    if not on_gpu:
        return True, False, None  # cuda_graph=True on the CPU: the routine, eagerly
    if config.get("inner_lr_modulation", False):
        return True, False, ("the inner_lr_modulation ablation reads the optimizer's "
                             "hyper-parameters on the host at every inner step")
    return True, True, None


class StaticGlance:
    """The static input buffers of one glance shape, and its graph once captured.

    Rows ``[0, batch)`` of ``x``/``y``/``t`` hold the incoming batch, rows
    ``[batch, batch + replay)`` the replayed samples (gathered inside the routine from the
    buffer with ``idx``); ``order`` is the inner loop's order when ``shuffle_inner``.
    """

    def __init__(self, batch: int, replay: int, n_inner: int, n_meta: int, shuffle: bool,
                 input_shape: tuple, dtype: torch.dtype, device: torch.device):
        self.batch, self.replay, self.n_inner, self.n_meta = batch, replay, n_inner, n_meta
        rows = batch + replay
        self.x = torch.zeros((rows, *input_shape), dtype=dtype, device=device)
        self.y = torch.zeros(rows, dtype=torch.long, device=device)
        self.t = torch.zeros(rows, dtype=torch.long, device=device)
        self.idx = torch.zeros(replay, dtype=torch.long, device=device)
        self.order = torch.zeros(n_inner, dtype=torch.long, device=device) if shuffle else None
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.loss: Optional[torch.Tensor] = None  # the captured glance's static output
        self.signature: Optional[list] = None     # the state tensors it reads (see _signature)
        self.eager_runs = 0                        # glances run eagerly (warm-up) so far
        self.replays = 0


class GlanceRoutine:
    """Runs :class:`~emcl_continual.methods.emcl.EMCL`'s glances from static buffers.

    ``method`` is the EMCL learner (its model, optimizer, buffer, generator and flags are
    read at every glance). ``capture``: replay glances from CUDA graphs (GPU only), else run
    the same routine eagerly. ``warmup``: eager glances per shape before its capture.
    """

    def __init__(self, method, *, capture: bool, warmup: int = 2):
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (capture needs the optimizer state), got {warmup}")
        self.method = method
        self.device = torch.device(method.device)
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the method runs on {self.device}")
        self.capture = bool(capture)
        self.warmup = int(warmup)
        self.shapes: dict[tuple[int, int], StaticGlance] = {}
        self.captures = 0
        self.failure: Optional[str] = None  # why capture was given up, if it was
        self._side = torch.cuda.Stream(self.device) if self.capture else None

    @property
    def status(self) -> str:
        """One line: how the glances run."""
        if not self.capture:
            return f"static-buffer routine, eager on {self.device}"
        if self.failure is not None:
            return f"eager on {self.device}: CUDA graph capture failed ({self.failure})"
        return (f"CUDA graphs: {self.captures} captured for shapes "
                f"{sorted(k for k, s in self.shapes.items() if s.graph is not None)}")

    # -- one glance ---------------------------------------------------------------------------
    def glance(self, x: torch.Tensor, y: torch.Tensor, tb: torch.Tensor) -> torch.Tensor:
        """One glance on the incoming batch ``(x, y)`` with task ids ``tb``; returns the
        meta-loss as a 0-d tensor on the device (a graph's static output: read it before the
        next glance of the same shape)."""
        m = self.method
        idx = None
        if m.buffer is not None and len(m.buffer) > 0 and m.n_replay > 0:
            idx = m.buffer.sample_indices(m.n_replay)  # the eager path's draw, same generator
        used = idx is not None and (m.inner_replay or m.meta_replay)
        replay = int(idx.numel()) if used else 0
        batch = int(x.shape[0])
        n_inner = batch + (replay if m.inner_replay else 0)
        order = torch.randperm(n_inner, generator=m.generator) if m.shuffle_inner else None
        s = self._static(batch, replay, n_inner, batch + (replay if m.meta_replay else 0), x)
        self._load(s, x, y, tb, idx if used else None, order)
        if not self.capture or self.failure is not None:
            return self._eager(s)
        if s.graph is not None and not self._same(s.signature, self._signature()):
            self._drop_graphs()  # a tensor the graphs read was replaced: warm up and capture anew
        if s.graph is not None:
            s.graph.replay()
            s.replays += 1
            return s.loss
        if s.eager_runs < self.warmup:
            return self._eager(s)
        return self._capture(s)

    def _static(self, batch, replay, n_inner, n_meta, x) -> StaticGlance:
        key = (batch, replay)
        s = self.shapes.get(key)
        if s is None:
            m = self.method
            s = StaticGlance(batch, replay, n_inner, n_meta, m.shuffle_inner, tuple(x.shape[1:]),
                             x.dtype, self.device)
            self.shapes[key] = s
        return s

    def _load(self, s: StaticGlance, x, y, tb, idx: Optional[torch.Tensor],
              order: Optional[torch.Tensor]) -> None:
        """Copy this glance's inputs into the static buffers (on the current stream)."""
        b = s.batch
        s.x[:b].copy_(x.reshape(s.x[:b].shape))
        s.y[:b].copy_(y)
        s.t[:b].copy_(tb)
        if idx is not None:
            s.idx.copy_(self._to_device(idx), non_blocking=True)
        if order is not None:
            s.order.copy_(self._to_device(order), non_blocking=True)

    def _to_device(self, cpu: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return cpu.pin_memory()  # copied with non_blocking: no sync, the block is kept alive
        return cpu

    # -- the routine ------------------------------------------------------------------------
    def _routine(self, s: StaticGlance) -> torch.Tensor:
        """The glance on the static buffers: the same operations, in the same order, as the
        eager ``EMCL._glance``; captured as a whole on a GPU."""
        m = self.method
        model, opt, b = m.model, m.opt, s.batch
        if s.replay:
            buf = m.buffer
            torch.index_select(buf.x, 0, s.idx, out=s.x[b:])
            torch.index_select(buf.y, 0, s.idx, out=s.y[b:])
            torch.index_select(buf.t, 0, s.idx, out=s.t[b:])
        xi, yi, ti = s.x[:s.n_inner], s.y[:s.n_inner], s.t[:s.n_inner]
        if s.order is not None:
            xi, yi, ti = xi[s.order], yi[s.order], ti[s.order]
        model.zero_grad(set_to_none=True)
        for k in range(s.n_inner):
            m._loss(xi[k:k + 1], yi[k:k + 1], ti[k:k + 1]).backward()
            if m.modulation:
                m._modulated_inner_step()
            else:
                opt.inner_step()
            model.zero_grad(set_to_none=True)
        loss = m._loss(s.x[:s.n_meta], s.y[:s.n_meta], s.t[:s.n_meta])
        loss.backward()
        opt.meta_step()
        model.zero_grad(set_to_none=True)
        return loss.detach()

    def _eager(self, s: StaticGlance) -> torch.Tensor:
        s.eager_runs += 1
        if self._side is None:
            return self._routine(s)
        # on the side stream that captures, as torch's warm-up recipe does
        current = torch.cuda.current_stream(self.device)
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            loss = self._routine(s)
        current.wait_stream(self._side)
        return loss

    def _capture(self, s: StaticGlance) -> torch.Tensor:
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self._side.wait_stream(current)
        try:
            with torch.cuda.graph(graph, stream=self._side):
                loss = self._routine(s)
        except Exception as exc:  # noqa: BLE001 - any failure: eager from now on, said once
            # torch.cuda.graph's exit skips restoring the ambient stream when capture_end raises
            torch.cuda.set_stream(current)
            self._give_up(exc)
            torch.cuda.synchronize(self.device)
            self.method.model.zero_grad(set_to_none=True)
            return self._eager(s)  # nothing of the failed capture ran: this glance, eagerly
        current.wait_stream(self._side)
        s.graph, s.loss, s.signature = graph, loss, self._signature()
        self.captures += 1
        graph.replay()  # a capture records the glance without running it
        s.replays += 1
        return s.loss

    def _give_up(self, exc: BaseException) -> None:
        self.failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self._drop_graphs()
        warnings.warn(f"emcl: could not capture a glance in a CUDA graph ({self.failure}); "
                      f"running the glances eagerly on {self.device} from now on",
                      RuntimeWarning, stacklevel=4)

    def _drop_graphs(self) -> None:
        for s in self.shapes.values():
            s.graph = s.loss = s.signature = None
            s.eager_runs = 0

    def _signature(self) -> list:
        """The tensors of the optimizer a captured glance reads and writes: its state and its
        hyper-parameter tensors. ``load_state_dict`` (or any assignment) replaces them, and a
        graph keeps the old ones. The other tensors it touches are written in place and never
        replaced: the parameters and batch-norm buffers (``model.load_state_dict`` copies into
        them), the reservoir's storage and the static buffers. Checked at every replay by
        identity: 40 µs per check for the MLP on a loaded 2-core CPU (load average 11), where reading
        every touched tensor's address, model traversal included, took 493 µs."""
        opt = self.method.opt
        out = [v for state in opt.state.values() for v in state.values()]
        for group in opt.param_groups:
            out += [v for v in group.values() if isinstance(v, torch.Tensor)]
        return out

    @staticmethod
    def _same(saved: Optional[list], now: list) -> bool:
        return saved is not None and len(saved) == len(now) and all(a is b for a, b in zip(saved, now))
