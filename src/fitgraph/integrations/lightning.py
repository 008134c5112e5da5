"""PyTorch Lightning: ``Trainer(callbacks=[FitgraphCallback(budget=0.6)])``.

``FitgraphCallback`` compiles the LightningModule's ``training_step`` with ``fitgraph.backend``
for the length of ``trainer.fit``: the forward the step runs (``self(x)`` or ``self.model(x)``,
any submodule), the loss it computes, and their backward are one graph that fitgraph plans
within the budget. Lightning's loop is untouched: its loss scaling for
``accumulate_grad_batches``, ``backward``, optimizer and LR scheduler steps, gradient clipping,
validation (under no_grad, not compiled, so never planned) and checkpoints run as they would
without the callback. ``self.log`` and ``self.log_dict`` run outside the graph (a graph break;
the graph before it is planned, the value logged as usual).

Example, with Lightning's demo ``BoringModel`` made deeper (its step: ``self(batch)``, an MSE
loss; a step of your own, ``x, y = batch`` ... ``self.log("loss", loss)``, is planned the same):
    >>> import torch, lightning.pytorch as pl
    >>> from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    >>> from fitgraph.integrations.lightning import FitgraphCallback
    >>> class MLP(BoringModel):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.layer = torch.nn.Sequential(torch.nn.Linear(32, 64), *[torch.nn.Sequential(
    ...             torch.nn.GELU(), torch.nn.Linear(64, 64)) for _ in range(6)])
    >>> fitgraph_cb = FitgraphCallback(budget=0.8, time_budget=5)   # or "800MB", bytes
    >>> trainer = pl.Trainer(max_steps=2, accelerator="cpu", callbacks=[fitgraph_cb],
    ...                      logger=False, enable_checkpointing=False,
    ...                      enable_progress_bar=False, enable_model_summary=False)
    >>> trainer.fit(MLP(), torch.utils.data.DataLoader(RandomDataset(32, 512), batch_size=256))
    >>> r = fitgraph_cb.backend.last_report          # print(r) for what was saved, recomputed
    >>> r.planned_peak_bytes <= r.budget_bytes and r.recomputed_nodes > 0
    True

What is compiled, and what to keep in mind:

* ``training_step`` only, and with ``dynamic=False``: a new input shape (a smaller last batch:
  ``DataLoader(drop_last=True)`` avoids it) is planned again as a graph of its own; a Python
  number the step reads that changes every step (``batch_idx``, ``self.global_step``) makes
  Dynamo compile again each step until its cache limit, then run the step eagerly, unplanned.
* Manual optimization (``automatic_optimization = False``) is refused: that step runs the
  optimizer itself; compile the forward there with ``torch.compile(self.model,
  backend=callback.backend)`` instead.
* Nor with a module that is already compiled (``trainer.fit(torch.compile(module))``): the
  callback compiles the step itself.
* ``backend`` is the ``fitgraph.backend`` that plans (its ``reports``, one per graph);
  ``budget``, ``latency_limit`` and ``**backend_options`` are its arguments.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    # NOTE: the unified package first; the standalone ``pytorch_lightning`` where it is the only
    # one (their classes differ: a callback of one is refused by the other's Trainer)
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        import pytorch_lightning as pl
    except ImportError as e:
        raise ImportError("fitgraph.integrations.lightning needs PyTorch Lightning: "
                          "pip install fitgraph[lightning]") from e

from .. import backend as make_backend

__all__ = ["FitgraphCallback"]

# NOTE: the example's module inherits its training_step from Lightning's BoringModel: a step
# defined inside a doctest is compiled with the doctest's globals, where Dynamo keeps names it
# deletes when the compiled code dies; doctest clears those globals first, and the KeyError
# that follows (torch 2.13) lands wherever the garbage collector runs, even in pytest's summary

# NOTE: the module's methods that run outside the compiled step: Dynamo cannot trace
# LightningModule.log (it inspects the step's signature and fails inside Dynamo, an internal
# error rather than a graph break); disabled, each call is a clean graph break
_EAGER_METHODS = ("log", "log_dict")


class FitgraphCallback(pl.Callback):
    """Plans the LightningModule's training step (forward, loss, backward) within a budget.

    ``budget``: bytes, a size string ("800MB"), or a fraction of each graph's simulated eager
    peak (0.6, "60%"); or ``latency_limit``: a factor of the eager step time; with neither,
    nothing is planned (torch's default partition). ``**backend_options``: the other arguments
    of ``fitgraph.backend`` (``solver``, ``time_budget``, ``cost_model``, ``inner``,
    ``dynamic_shapes``).
    """

    def __init__(self, budget=None, latency_limit: float | None = None,
                 **backend_options: Any) -> None:
        super().__init__()
        self.backend = make_backend(budget=budget, latency_limit=latency_limit,
                                    **backend_options)
        # NOTE: the module's own instance attributes that were replaced, to put back after fit
        self._replaced: dict[str, Any] | None = None
        self._module: pl.LightningModule | None = None

    # NOTE: on_fit_start runs after the strategy has set the module up (on its device, wrapped
    # for DDP), before the sanity check and the first step; validate/test/predict alone never
    # reach it, so nothing is compiled for them
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise ValueError(
                "FitgraphCallback compiles training_step, which under manual optimization "
                "also steps the optimizer: compile the forward in your training_step instead, "
                "torch.compile(self.model, backend=callback.backend)")
        if getattr(pl_module, "_compiler_ctx", None) is not None:
            raise ValueError(
                "the LightningModule is already compiled (trainer.fit(torch.compile(module))): "
                "pass the module itself; FitgraphCallback compiles its training_step")
        if self._replaced is not None:
            return
        names = ("training_step", *_EAGER_METHODS)
        self._replaced = {n: pl_module.__dict__.get(n) for n in names}
        self._module = pl_module
        for name in _EAGER_METHODS:
            setattr(pl_module, name, torch.compiler.disable(getattr(pl_module, name)))
        # NOTE: the step rather than ``pl_module.compile()``: the module's compiled
        # ``__call__`` would miss steps that call a submodule (``self.model(x)``) and leave the
        # loss out of the graph, while validation's ``self(x)`` would be compiled too. The
        # wrapper keeps ``__wrapped__``, which Lightning reads the step's signature through
        # (``batch_idx``, ``dataloader_iter``). ``dynamic=False``: a graph traced with symbolic
        # shapes cannot be planned (the backend's dynamic_shapes)
        pl_module.training_step = torch.compile(pl_module.training_step, backend=self.backend,
                                                dynamic=False)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        """The module as it was: its class's methods again, or its own attributes where it had
        them (nothing of fitgraph left on it for pickling, ``trainer.validate``, a new fit)."""
        if self._replaced is None or self._module is None:
            return
        for name, own in self._replaced.items():
            if own is None:
                self._module.__dict__.pop(name, None)
            else:
                setattr(self._module, name, own)
        self._replaced = self._module = None
