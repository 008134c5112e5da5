"""fitgraph in PyTorch Lightning: ``Trainer(callbacks=[FitgraphCallback(budget=...)])``.

One Lightning run with the callback and the same run without it (seeded module, shuffled data
in the same order, gradient accumulation, an LR scheduler, validation every few batches,
checkpoints): the per-step losses, validation losses and final weights agree, the training
graph is planned once within its budget, and one training step inside the Trainer, measured at
the allocator (``MemoryMeter``), peaks lower than the plain run's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from fitgraph.execute.meter import MemoryMeter  # noqa: E402
from fitgraph.integrations.lightning import FitgraphCallback  # noqa: E402

# NOTE: every test compiles new modules (``conftest.fresh_dynamo``)
pytestmark = pytest.mark.usefixtures("fresh_dynamo")

WIDTH, DEPTH, BATCH, SAMPLES = 64, 6, 256, 2048
MAX_STEPS, ACCUMULATE, VAL_EVERY = 20, 2, 4
# NOTE: a warm step (the graph compiled and planned at batch 0), the second micro-batch of an
# accumulation, so both runs meter the same work: activations, never new .grad tensors
METERED_BATCH = 5
BUDGET = 0.7
# NOTE: both runs execute the same ATen kernels on the same inputs (aot_eager runs the planned
# halves op by op; a recompute re-runs a kernel): any difference beyond rounding is a bug
RTOL = 1e-6


class Regressor(pl.LightningModule):
    """A seeded MLP as a common LightningModule: its step calls a submodule, computes the loss
    and logs it; an LR scheduler; a validation step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # NOTE: no dropout: the two runs need no common RNG stream
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())
                                   for _ in range(DEPTH)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.net(x) - y).square().mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", (self.net(x) - y).square().mean())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(pl.Callback):
    """Each micro-batch's loss, each validation's loss, and the allocator peak of one training
    step (training_step, Lightning's loss scaling, backward)."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.val_losses: list[torch.Tensor] = []
        self.meter: MemoryMeter | None = None
        self.peak_bytes: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == METERED_BATCH:
            self.meter = MemoryMeter()
            self.meter.__enter__()

    def on_after_backward(self, trainer, pl_module):
        if self.meter is not None:
            self.meter.__exit__(None, None, None)
            self.peak_bytes, self.meter = self.meter.peak_bytes, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val_losses.append(trainer.callback_metrics["val_loss"].clone())


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(SAMPLES, WIDTH, generator=g),
                         torch.randn(SAMPLES, WIDTH, generator=g))


def _fit(tmp_path, callbacks: list) -> tuple[Regressor, pl.Trainer, Recorder]:
    data, model, rec = _data(), Regressor(), Recorder()
    trainer = pl.Trainer(
        max_steps=MAX_STEPS, accelerator="cpu", devices=1, accumulate_grad_batches=ACCUMULATE,
        val_check_interval=VAL_EVERY, limit_val_batches=2, logger=False,
        callbacks=[rec, pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10,
                                                     save_top_k=-1), *callbacks],
        enable_progress_bar=False, enable_model_summary=False)
    # NOTE: shuffled, in the same order in both runs (a generator of their own)
    trainer.fit(model,
                DataLoader(data, batch_size=BATCH, shuffle=True,
                           generator=torch.Generator().manual_seed(2)),
                DataLoader(data, batch_size=BATCH))
    return model, trainer, rec


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(plain, fitgraph) runs: each (module, trainer, recorder); the callback; and how many
    graphs Dynamo compiled in the fitgraph run."""
    from torch._dynamo.utils import counters

    # NOTE: module-scoped fixtures start before ``fresh_dynamo``: Dynamo emptied here too
    torch._dynamo.reset()
    torch.set_num_threads(1)
    plain = _fit(tmp_path_factory.mktemp("plain"), [])
    cb = FitgraphCallback(budget=BUDGET, time_budget=5)
    before = counters["stats"]["unique_graphs"]
    planned = _fit(tmp_path_factory.mktemp("fitgraph"), [cb])
    graphs = counters["stats"]["unique_graphs"] - before
    torch._dynamo.reset()
    return plain, planned, cb, graphs


def test_losses_and_final_weights_match_the_plain_run(runs):
    (model, trainer, rec), (fmodel, ftrainer, frec), *_ = runs
    assert trainer.global_step == ftrainer.global_step == MAX_STEPS
    assert len(rec.losses) == len(frec.losses) == MAX_STEPS * ACCUMULATE
    torch.testing.assert_close(torch.stack(frec.losses), torch.stack(rec.losses),
                               rtol=RTOL, atol=0)
    # NOTE: validation ran (every VAL_EVERY batches) and saw the same weights
    assert len(rec.val_losses) == len(frec.val_losses) >= MAX_STEPS * ACCUMULATE // VAL_EVERY
    torch.testing.assert_close(torch.stack(frec.val_losses), torch.stack(rec.val_losses),
                               rtol=RTOL, atol=0)
    for (name, p), (_, fp) in zip(model.named_parameters(), fmodel.named_parameters(),
                                  strict=True):
        torch.testing.assert_close(fp, p, rtol=RTOL, atol=1e-8, msg=f"weight {name} differs")
    # NOTE: the scheduler stepped every optimizer step in both runs
    lrs = [t.lr_scheduler_configs[0].scheduler.get_last_lr() for t in (trainer, ftrainer)]
    assert lrs[0] == lrs[1] == [1e-3 * 0.5 ** (MAX_STEPS // 5)]


def test_training_graph_planned_once_within_budget_and_validation_never(runs):
    *_, cb, graphs = runs
    # NOTE: one shape, one graph (``self.log`` is a graph break after the loss, with nothing
    # to plan behind it); validation runs under no_grad, outside the compiled step: Dynamo
    # compiled nothing else
    assert graphs == 1 and len(cb.backend.reports) == 1, [str(r) for r in cb.backend.reports]
    r = cb.backend.last_report
    assert r.budget_bytes == int(BUDGET * r.eager_peak_bytes)
    assert r.planned_peak_bytes <= r.budget_bytes
    assert r.recomputed_nodes > 0 and r.planned_saved_bytes < r.eager_saved_bytes


def test_measured_step_peak_below_the_plain_run(runs):
    (_, _, rec), (_, _, frec), cb, _ = runs
    assert rec.peak_bytes is not None and frec.peak_bytes is not None
    r = cb.backend.last_report
    assert frec.peak_bytes < 0.9 * rec.peak_bytes, (frec.peak_bytes, rec.peak_bytes, str(r))
    # NOTE: and within the plan: its simulated peak counts the weights too, the meter only
    # what the step allocates (Lightning's loss scaling and logging included)
    assert frec.peak_bytes <= r.planned_peak_bytes, (frec.peak_bytes, str(r))


def test_checkpoints_load_back_and_the_module_is_left_as_it_was(runs, tmp_path):
    _, (fmodel, ftrainer, _), *_ = runs
    saved = sorted(Path(ftrainer.checkpoint_callback.dirpath).glob("*.ckpt"))
    assert [p.name.split("step=")[1] for p in saved] == ["10.ckpt", "20.ckpt"]
    # NOTE: the step is restored after fit: state dict keys, pickling, a new fit see the class
    assert "training_step" not in vars(fmodel) and "log" not in vars(fmodel)
    for path in (saved[-1], tmp_path / "manual.ckpt"):
        if not path.exists():
            ftrainer.save_checkpoint(path)
        back = Regressor.load_from_checkpoint(path)
        assert back.state_dict().keys() == fmodel.state_dict().keys()
        for (name, p), (_, q) in zip(fmodel.state_dict().items(), back.state_dict().items()):
            assert torch.equal(p, q), f"{name} differs after loading {path.name}"


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no")
def test_manual_optimization_is_refused():
    class Manual(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[FitgraphCallback(budget=BUDGET)])
    with pytest.raises(ValueError, match="manual optimization"):
        trainer.fit(Manual(), DataLoader(_data(), batch_size=BATCH))


def test_without_lightning_the_import_error_says_what_to_install(monkeypatch):
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # NOTE: import of a None entry fails
    monkeypatch.delitem(sys.modules, "fitgraph.integrations.lightning")
    with pytest.raises(ImportError, match=r"pip install fitgraph\[lightning\]"):
        __import__("fitgraph.integrations.lightning")


def test_import_fitgraph_does_not_import_lightning():
    code = ("import sys, fitgraph, fitgraph.integrations; "
            "assert not {'lightning', 'pytorch_lightning'} & set(sys.modules), 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
