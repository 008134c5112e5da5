"""Hugging Face ``Trainer``: ``FitgraphCallback`` plans each training step within a budget.

Trainer keeps its own loop (forward and loss, backward through Accelerate, gradient
accumulation, clipping, the optimizer and scheduler steps, evaluation, checkpoints); the
callback compiles the model in place with ``fitgraph.backend`` when training begins, so the
forward+backward graph that loop runs is planned: the forward saves what the plan keeps and the
backward recomputes the rest. Losses and gradients are eager's bitwise (the planned halves run
the same ATen kernels, dropout is never recomputed); under mixed precision (``bf16=True``) they
are ``torch.compile(backend="aot_eager")``'s bitwise, which differ from eager's in the last bits
as any torch.compile does. The memory is the plan's. Evaluation and prediction run under
``torch.no_grad``: their graphs are compiled but not planned (nothing is saved for a backward).

Why a callback and not ``TrainingArguments(torch_compile_backend="fitgraph")``: Trainer hands
that name to Accelerate's ``TorchDynamoPlugin``, which accepts only the names in its
``DynamoBackend`` enum and raises ``ValueError: 'FITGRAPH' is not a valid DynamoBackend`` while
Trainer is built (Accelerate 1.16); ``torch.compile(model, backend="fitgraph")`` by name works
wherever a tool passes the name on to torch (``fitgraph.compile_backend.by_name``).

Example (a tiny Llama with random weights, two optimizer steps):
    >>> import tempfile, torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    >>> from fitgraph.integrations.huggingface import FitgraphCallback
    >>> config = LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
    ...                      num_attention_heads=2, num_key_value_heads=2, vocab_size=128,
    ...                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    >>> model = LlamaForCausalLM(config)
    >>> data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (16, 64))]
    >>> # NOTE: a roofline prices recomputation here; the default (cost_model=None) measures
    >>> # each op on this machine once (cached)
    >>> fit = FitgraphCallback(budget=0.7, cost_model="cpu-generic")  # or "800MB", bytes
    >>> args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=8,
    ...                          use_cpu=True, report_to=[], save_strategy="no",
    ...                          disable_tqdm=True, logging_strategy="no")
    >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[fit])
    >>> out = trainer.train()   # doctest: +ELLIPSIS
    {'train_runtime': ...}
    >>> r = fit.backend.last_report                      # what it planned; print(r) for a table
    >>> r.planned_peak_bytes <= r.budget_bytes and r.planned_saved_bytes < r.eager_saved_bytes
    True
"""

from __future__ import annotations

import warnings
import weakref

try:
    from transformers import TrainerCallback
except ImportError as e:  # NOTE: transformers is an extra: ``import fitgraph`` never needs it
    raise ImportError("fitgraph.integrations.huggingface needs Hugging Face transformers (and "
                      "accelerate, which its Trainer runs on): pip install fitgraph[hf]") from e

from ..compile_backend import FitgraphBackend, backend

__all__ = ["FitgraphCallback"]


class FitgraphCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that compiles the Trainer's model with
    ``fitgraph.backend(budget=..., latency_limit=..., **backend_options)`` when training
    begins (``solver``, ``time_budget``, ``cost_model``, ``inner``, ``dynamic_shapes``: see
    ``fitgraph.backend``). ``backend`` is that ``FitgraphBackend``: its ``reports`` say what
    each planned graph saves and recomputes.

    The model is compiled in place (``nn.Module.compile``), so ``trainer.model``, its
    ``state_dict`` keys and every checkpoint stay as without the callback. Shapes are static
    (``dynamic=False``): each new batch shape is traced and planned once (pad batches to a few
    lengths). A fractional budget (0.6, "60%") applies to each compiled graph's own eager peak:
    where the model's code breaks the graph, each piece is planned on its own, and a small
    piece that cannot reach the fraction runs at its least peak, with a warning (a budget in
    bytes is a hard limit: ``BudgetInfeasible`` at the first step). One such break:
    transformers 5's ``GPT2LMHeadModel`` (a class name that names no loss) warns through
    ``logger.warning_once`` in ``model.loss_function``, which breaks the graph before the loss;
    ``model.loss_type = "ForCausalLM"`` removes it. Leave
    ``TrainingArguments.torch_compile`` and ``activation_checkpointing`` (formerly
    ``gradient_checkpointing``) off: the callback compiles, and the plan chooses what the
    backward recomputes."""

    def __init__(self, budget=None, latency_limit: float | None = None,
                 **backend_options) -> None:
        self.backend: FitgraphBackend = backend(budget=budget, latency_limit=latency_limit,
                                                **backend_options)
        # NOTE: Trainer calls on_train_begin at every ``train()`` (a resume, a second run):
        # a model is compiled once
        self._compiled: weakref.WeakSet = weakref.WeakSet()
        # NOTE: whether the first step after compiling was looked at (did it plan anything)
        self._checked = True

    def on_init_end(self, args, state, control, **kwargs):
        # NOTE: a conflicting argument fails when the Trainer is built, not after data loading
        _check_args(args)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _check_args(args)
        if model is None:
            raise ValueError("FitgraphCallback: the Trainer passed no model to compile")
        if model in self._compiled:
            return
        if getattr(model, "_compiled_call_impl", None) is not None:
            raise ValueError("FitgraphCallback: the model is already compiled (model.compile); "
                             "it compiles the model itself")
        # NOTE: in place, so Trainer's own references (model, model_wrapped, the optimizer's
        # parameters) run the compiled module; static shapes, since the backend refuses a graph
        # traced with symbolic sizes (dynamic_shapes="refuse") and Dynamo would trace one at
        # the first new shape
        model.compile(backend=self.backend, dynamic=False)
        self._compiled.add(model)
        self._checked = False

    def on_step_end(self, args, state, control, **kwargs):
        if self._checked:
            return
        self._checked = True
        if not self.backend.reports:
            # NOTE: law 5, not silent: Dynamo skips code in torch's own files, so a model
            # compiled in place whose forward is torch.nn's (an nn.Sequential) runs uncompiled
            warnings.warn("FitgraphCallback: the first training step compiled no graph that "
                          "fitgraph planned (a model whose forward is torch.nn's own, such as "
                          "nn.Sequential, is skipped by torch.compile in place: wrap it in a "
                          "module of your own); the steps run unplanned", stacklevel=2)


def _check_args(args) -> None:
    if getattr(args, "torch_compile", False):
        raise ValueError("FitgraphCallback compiles the model itself: leave TrainingArguments."
                         "torch_compile (and torch_compile_backend/mode) unset")
    # NOTE: transformers 5 renamed gradient_checkpointing (now its alias) activation_checkpointing
    if getattr(args, "activation_checkpointing", False) or getattr(
            args, "gradient_checkpointing", False):
        raise ValueError("FitgraphCallback plans what the backward recomputes: leave "
                         "TrainingArguments.activation_checkpointing (gradient_checkpointing) "
                         "off")
