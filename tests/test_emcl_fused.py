"""EMCL's inner loop through the fused glance (emcl_continual.methods.emcl_fused): when it runs,
and that a learner with it follows the autograd learner (the same configuration and seed) within
fp32 tolerance, on a single-head and a multi-head (task-masked) stream, with and without prox."""
from __future__ import annotations

import pytest
import torch

from emcl_continual.data import models
from emcl_continual.training import train
from emcl_continual.methods import get_method
from emcl_continual.methods.emcl_fused import fused_plan
from emcl_kernels.glance import glance_unavailable_reason

from test_graphed import _flat_stream, _image_stream

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(glance_unavailable_reason("cpu", "cpu") is not None,
                                 reason=str(glance_unavailable_reason("cpu", "cpu")))]


def _learner(stream, overrides, seed=0):
    cfg = train.build_config("emcl", stream.info.name, seed, overrides)
    torch.manual_seed(seed)
    model = models.build_model(stream.info)
    return get_method("emcl")(model, stream.info, cfg, torch.device("cpu"))


def test_the_fused_path_runs_by_default_on_the_cpu_mlp():
    stream = _flat_stream()
    assert _learner(stream, {}).fused is not None
    assert _learner(stream, {"fused_glance": False}).fused is None
    for overrides, why in (({"inner_lr_modulation": True}, "inner_lr_modulation"),
                           ({"importance_norm": "tensor"}, "own gamma"),
                           ({"cuda_graph": True}, "CUDA graphs"),
                           ({"backend": "foreach"}, "backend='foreach'")):
        learner = _learner(stream, overrides)
        assert learner.fused is None and why in learner.fused_why_not
        with pytest.raises(ValueError, match="fused_glance=True"):
            _learner(stream, {**overrides, "fused_glance": True})
    image = _image_stream()
    learner = _learner(image, {})
    assert learner.fused is None and "not the MLP" in learner.fused_why_not
    with pytest.raises(ValueError, match="fused_glance must be"):
        fused_plan({"fused_glance": "yes"}, learner.model, "cpu", eager=True)


@pytest.mark.parametrize("multi", [False, True])
@pytest.mark.parametrize("overrides", [{}, {"prox": False}, {"glances": 2, "shuffle_inner": True},
                                       {"importance_norm": "global", "gamma": 1e-3},
                                       {"importance": "si", "memory": 0, "replay": 0},
                                       {"fixed_importance": 1e-2, "decay": 1.0}])
def test_fused_learner_follows_the_autograd_learner(multi, overrides):
    stream = _flat_stream(multi=multi, per_task=40)
    fused = _learner(stream, overrides)
    auto = _learner(stream, {**overrides, "fused_glance": False})
    assert fused.fused is not None and auto.fused is None
    for t, task in enumerate(stream.train):
        x, y = task.x, task.y
        for b in range(0, x.shape[0], 10):
            lf = fused.observe(x[b:b + 10], y[b:b + 10], t)
            la = auto.observe(x[b:b + 10], y[b:b + 10], t)
            assert abs(lf - la) <= 1e-4 * max(1.0, abs(la))
    eps = torch.finfo(torch.float32).eps
    for p, q in zip(fused.model.parameters(), auto.model.parameters()):
        scale = float(q.detach().abs().max())
        # after 8 batches (8-16 glances of 10-20 one-sample steps and a meta step each): within
        # 16 fp32 eps of the largest weight (each step's last-bit differences, carried along;
        # measured at most 2.5 eps over these cases)
        assert float((p.detach() - q.detach()).abs().max()) <= 16 * eps * scale
        for key in ("anchor", "importance"):
            a, b = fused.opt.state[p][key], auto.opt.state[q][key]
            assert float((a - b).abs().max()) <= 16 * eps * max(float(b.abs().max()), 1e-30)
    assert fused.fused.skipped == 0
