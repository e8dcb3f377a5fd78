"""FusedEMCLOptimizer inside the training frameworks people use (the optional extra
``requirements-frameworks.txt``; each framework's tests skip when it is not installed):

* HF ``Trainer``: ``optimizers=(opt, None)`` and ``optimizer_cls_and_kwargs=``; its warmup
  scheduler drives ``lr``; a run resumed from a checkpoint ends bit-identical to one that ran
  straight through.
* accelerate: ``prepare`` with a scheduler, ``save_state`` / ``load_state``.
* Lightning: automatic optimization with a scheduler in ``configure_optimizers`` and
  ``LearningRateMonitor``, ``ckpt_path=`` resume; manual optimization with the paper's inner and
  meta steps counts its steps, so ``max_steps`` ends the run.
* timm: its optimizer factory (which always passes ``weight_decay``) and ``CosineLRScheduler``.

Tiny models built from configs, synthetic data, no downloads, CPU.
"""
from __future__ import annotations

import math

import pytest
import torch

from emcl_kernels import FusedEMCLOptimizer, zero_aware_groups
from reliability_support import same_bits

VOCAB, SEQ = 32, 12


def _tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


def _gpt2(seed=0):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB,
                                  n_positions=SEQ, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


class _LMData(torch.utils.data.Dataset):
    def __init__(self, n=64, seed=0):
        self.x = _tokens(n, seed)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


# -- HF Trainer ---------------------------------------------------------------------------------

def _args(tmp_path, **kw):
    transformers = pytest.importorskip("transformers")
    base = dict(output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=4,
                lr_scheduler_type="linear", warmup_steps=4, logging_steps=1, save_steps=6,
                report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
                dataloader_num_workers=0, save_only_model=False)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def test_hf_trainer_warmup_drives_lr_with_optimizers(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _gpt2()
    opt = FusedEMCLOptimizer(zero_aware_groups(model.named_parameters()), lr=0.2,
                             meta_every=4, meta_lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = transformers.Trainer(model=model, args=_args(tmp_path), train_dataset=_LMData(),
                                   optimizers=(opt, None))
    trainer.train()
    rates = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert len(rates) == 12
    # the rate each step ran at: linear warmup over 4 steps to 0.2, then linear decay to 0
    expected = [0.2 * min(s / 4, (12 - s) / 8) for s in range(12)]
    for got, want in zip(rates, expected):
        assert got == pytest.approx(want, abs=1e-12)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    # GPT-2's zero-initialised biases train (zero_aware_groups)
    assert model.transformer.h[0].attn.c_attn.bias.abs().min() > 0


def _trainer_cls_kwargs(tmp_path, **kw):
    transformers = pytest.importorskip("transformers")
    return transformers.Trainer(
        model=_gpt2(), args=_args(tmp_path, **kw), train_dataset=_LMData(),
        optimizer_cls_and_kwargs=(FusedEMCLOptimizer, {"lr": 0.2, "meta_every": 4,
                                                       "meta_lr": 1.0}))


def test_hf_trainer_optimizer_cls_and_kwargs_resumes_bit_identical(tmp_path):
    straight = _trainer_cls_kwargs(tmp_path / "straight")
    straight.train()
    assert isinstance(straight.optimizer.optimizer if hasattr(straight.optimizer, "optimizer")
                      else straight.optimizer, FusedEMCLOptimizer)
    # the Trainer puts weight_decay (0.0) in its groups: accepted
    assert all(g["weight_decay"] == 0.0 for g in straight.optimizer.param_groups)
    transformers = pytest.importorskip("transformers")

    class Interrupt(transformers.TrainerCallback):  # the run dies after its first checkpoint
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 6:
                control.should_training_stop = True

    first = _trainer_cls_kwargs(tmp_path / "resumed")
    first.add_callback(Interrupt())
    first.train()
    assert first.state.global_step == 6
    resumed = _trainer_cls_kwargs(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-6"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert same_bits(a.detach(), b.detach())
    assert straight.optimizer.param_groups[0]["lr"] == resumed.optimizer.param_groups[0]["lr"]


# -- accelerate -----------------------------------------------------------------------------------

def test_accelerate_prepare_with_scheduler_and_save_load_state(tmp_path):
    accelerate = pytest.importorskip("accelerate")

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 2))
        opt = FusedEMCLOptimizer(model.parameters(), lr=0.1, meta_every=3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g),
                                              torch.randn(48, 2, generator=g))
        dl = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
        acc = accelerate.Accelerator(cpu=True)
        return (acc, *acc.prepare(model, opt, dl, sched))

    def train(acc, model, opt, dl, sched, batches):
        rates = []
        for i, (x, y) in enumerate(dl):
            if i not in batches:
                continue
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            rates.append(opt.param_groups[0]["lr"])
        return rates

    acc, model, opt, dl, sched = setup()
    rates = train(acc, model, opt, dl, sched, range(12))
    assert rates[:4] == pytest.approx([0.05, 0.075, 0.1, 0.1])
    acc2, model2, opt2, dl2, sched2 = setup()
    train(acc2, model2, opt2, dl2, sched2, range(6))
    acc2.save_state(str(tmp_path / "state"))
    acc3, model3, opt3, dl3, sched3 = setup()
    acc3.load_state(str(tmp_path / "state"))
    train(acc3, model3, opt3, dl3, sched3, range(6, 12))
    for a, b in zip(model.parameters(), model3.parameters()):
        assert same_bits(a.detach(), b.detach())


# -- Lightning -------------------------------------------------------------------------------------

def _lightning_module(manual=False):
    L = pytest.importorskip("lightning.pytorch")

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                           torch.nn.Linear(16, 2))
            self.automatic_optimization = not manual

        def training_step(self, batch, i):
            x, y = batch
            if self.automatic_optimization:
                loss = torch.nn.functional.mse_loss(self.net(x), y)
                self.log("loss", loss)
                return loss
            opt = self.optimizers()
            for xs, ys in zip(x.split(1), y.split(1)):   # the paper: one sample at a time
                self.manual_backward(torch.nn.functional.mse_loss(self.net(xs), ys))
                opt.inner_step()
                opt.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(self.net(x), y))
            opt.meta_step()
            opt.zero_grad()

        def configure_optimizers(self):
            opt = FusedEMCLOptimizer(self.parameters(), lr=0.1, meta_every=None if manual else 3)
            if manual:
                return opt
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
                "interval": "step"}}

    return Tiny()


def _loader():
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(40, 6, generator=g),
                                          torch.randn(40, 2, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)


def _lightning_trainer(tmp_path, max_steps, **kw):
    L = pytest.importorskip("lightning.pytorch")
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1,
                     default_root_dir=str(tmp_path), enable_progress_bar=False,
                     enable_model_summary=False, log_every_n_steps=1, **kw)


def test_lightning_scheduler_lr_monitor_and_ckpt_path_resume(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    straight = _lightning_module()
    monitor = LearningRateMonitor(logging_interval="step")
    trainer = _lightning_trainer(tmp_path / "a", 20, callbacks=[monitor],
                                 logger=CSVLogger(str(tmp_path / "a")))
    trainer.fit(straight, _loader())
    assert trainer.global_step == 20
    logged = [v for k, v in trainer.callback_metrics.items() if k.startswith("lr-")]
    assert logged and float(logged[0]) == pytest.approx(0.1 * 0.5 ** 9)
    assert straight.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 10)
    # interrupted after its first epoch (10 batches: Lightning resumes a plain DataLoader at an
    # epoch boundary), then resumed with ckpt_path=
    ck = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=10, save_top_k=-1)
    first = _lightning_module()
    _lightning_trainer(tmp_path / "b", 10, callbacks=[ck], logger=False).fit(first, _loader())
    path = next((tmp_path / "ck").glob("*.ckpt"))
    resumed = _lightning_module()
    _lightning_trainer(tmp_path / "c", 20, logger=False).fit(resumed, _loader(),
                                                              ckpt_path=str(path))
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert same_bits(a.detach(), b.detach())


def test_lightning_manual_emcl_counts_its_steps(tmp_path):
    pytest.importorskip("lightning.pytorch")
    module = _lightning_module(manual=True)
    trainer = _lightning_trainer(tmp_path, 15, logger=False)
    trainer.fit(module, _loader())
    # each batch of 4 samples is 4 inner steps and 1 meta step: max_steps=15 ends after 3
    assert trainer.global_step == 15
    assert trainer.fit_loop.epoch_loop.batch_progress.total.completed == 3


# -- timm -----------------------------------------------------------------------------------------

def test_timm_factory_and_cosine_scheduler():
    timm_optim = pytest.importorskip("timm.optim")
    from timm.optim._optim_factory import OptimInfo
    from timm.scheduler import CosineLRScheduler
    registry = timm_optim.OptimizerRegistry()
    registry.register(OptimInfo(name="emcl", opt_class=FusedEMCLOptimizer,
                                description="EMCL", has_eps=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 2))
    opt = registry.create_optimizer(model, "emcl", lr=0.1, weight_decay=0.0, meta_every=2)
    assert isinstance(opt, FusedEMCLOptimizer)
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups)
    sched = CosineLRScheduler(opt, t_initial=10, warmup_t=2, warmup_lr_init=0.01,
                              t_in_epochs=False)
    rates = []
    for step in range(10):
        model(torch.randn(3, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step_update(step + 1)
        rates.append(opt.param_groups[0]["lr"])
    assert rates[0] == pytest.approx(0.01 + (0.1 - 0.01) / 2)
    assert rates[-1] < rates[3] < 0.1
    with pytest.raises(ValueError, match="no weight decay"):
        registry.create_optimizer(model, "emcl", lr=0.1, weight_decay=0.05)
