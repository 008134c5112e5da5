"""Trace one training step (forward, loss, backward) into an ATen fx graph on fake tensors.

``make_fx`` records the ops eager PyTorch runs — composite ops decomposed as eager decomposes
them, the backward in the order the autograd engine runs it — with a FakeTensor (shape, dtype,
strides, storage identity) on every node. No real activation memory is used, so models bigger
than this machine can be captured. make_fx records neither module paths nor phases, so a
``PhaseTracker`` watches module hooks (forward) and autograd pre-hooks (backward) and notes at
which node count each (phase, module) starts.
"""

from __future__ import annotations

import bisect
import contextlib
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.nn.utils import clip_grad
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..graph.ir import Phase
from .calling import LossFn, compute_loss
from .errors import CaptureError
from .fake_mode import CaptureFakeMode
from .host_rng import no_host_draws
from .trace_errors import translate
from .user_checkpoints import plain_checkpoints

__all__ = ["PhaseTracker", "TracedStep", "trace_step"]


@dataclass
class PhaseTracker:
    """Records (node count, phase, module call) transitions while make_fx traces.

    A module's call is its path, with ``@k`` after a module called for the k-th time (from 0)
    within one call of its parent: ALBERT runs its one shared layer four times, as
    ``albert.encoder.albert_layer_groups.0``, ``...groups.0@1``, ``...@2``, ``...@3``, so each
    call is a block of its own for the planners (``solvers.remat.blocks``), as Dynamo's
    ``nn_module_stack`` keys them. A module called once keeps its plain path."""

    transitions: list[tuple[int, Phase, str]] = field(default_factory=list)
    module_stack: list[str] = field(default_factory=list)   # plain paths: errors name these
    call_stack: list[str] = field(default_factory=list)     # each running call's label
    call_counts: dict[tuple[str, str], int] = field(default_factory=dict)
    seq_marks: list[tuple[int, str]] = field(default_factory=list)  # autograd seq nr -> module
    phase: Phase = Phase.FORWARD
    error_module: str | None = None  # innermost module running when tracing raised

    @staticmethod
    def _node_count() -> int:
        mode = get_proxy_mode()
        return len(mode.tracer.graph.nodes) if mode is not None else 0

    @property
    def module(self) -> str:
        """The running module's call (see the class doc)."""
        return self.call_stack[-1] if self.call_stack else ""

    @property
    def plain_module(self) -> str:
        """The running module's path, as ``model.get_submodule`` takes it."""
        return self.module_stack[-1] if self.module_stack else ""

    def mark(self, phase: Phase | None = None, module: str | None = None) -> None:
        if phase is not None:
            self.phase = phase
        mod = self.module if module is None else module
        self.transitions.append((self._node_count(), self.phase, mod))
        if self.phase in (Phase.FORWARD, Phase.LOSS):
            self.seq_marks.append((torch.autograd._get_sequence_nr(), mod))

    def enter_module(self, name: str) -> None:
        if not self.module_stack and self.phase is Phase.LOSS:
            self.phase = Phase.FORWARD  # NOTE: loss_fn may call the model after some loss-side ops
        self.call_stack.append(self._call_label(name))
        self.module_stack.append(name)
        self.mark()

    def _call_label(self, name: str) -> str:
        parent, parent_call = self.plain_module, self.module
        # NOTE: counted within the parent's call: the first layer of each ALBERT group call is
        # ``groups.0@2.albert_layers.0``, not ``albert_layers.0@2`` under ``groups.0@2``
        k = self.call_counts.get((parent_call, name), 0)
        self.call_counts[(parent_call, name)] = k + 1
        # NOTE: a child keeps its parent's call labels in its path; a module called from
        # outside its own parent (a shared activation) keeps its path, as before
        label = (parent_call + name[len(parent):] if parent and name.startswith(parent + ".")
                 else name)
        # NOTE: the model itself (path "") is not labelled: a loss that calls the model twice
        # keeps one set of paths for both calls
        return f"{label}@{k}" if k and name else label

    def exit_module(self) -> None:
        if self.error_module is None and sys.exc_info()[1] is not None:
            # NOTE: always_call hooks run while an exception unwinds: remember where it started
            self.error_module = self.plain_module
        self.module_stack.pop()
        self.call_stack.pop()
        # NOTE: a module called during the backward (torch.utils.checkpoint re-running its
        # function) stays in the backward: labelled as the loss, the backward ops after it ran
        # before their own inputs in the plan (a dependency cycle)
        if not self.module_stack and self.phase is Phase.FORWARD:
            self.phase = Phase.LOSS
        self.mark()

    def module_of_seq(self, seq: int) -> str:
        """Module that was running when the autograd node with sequence number ``seq`` was made."""
        keys = [s for s, _ in self.seq_marks]
        i = bisect.bisect_right(keys, seq) - 1
        return self.seq_marks[i][1] if i >= 0 else ""

    def at(self, node_index: int) -> tuple[Phase, str]:
        """(phase, module) in effect when the node_index-th fx node was created."""
        keys = [t[0] for t in self.transitions]
        i = bisect.bisect_right(keys, node_index) - 1
        if i < 0:
            return Phase.FORWARD, ""
        return self.transitions[i][1], self.transitions[i][2]


@contextlib.contextmanager
def _module_hooks(model: torch.nn.Module, tracker: PhaseTracker):
    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(
            lambda m, a, _n=name: tracker.enter_module(_n)))
        handles.append(mod.register_forward_hook(
            lambda m, a, o, _n=name: tracker.exit_module(), always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _hook_backward(loss: torch.Tensor, tracker: PhaseTracker) -> None:
    """Pre-hooks on every autograd node so backward ops are attributed to their module."""
    # NOTE: keyed by id() with the node held: torch (2.11) may hand out a fresh Python wrapper
    # for a grad_fn on each access and free it after, so a bare id() set mistakes a new node
    # for a seen one (the freed wrapper's id is reused) and stops the walk early, leaving the
    # rest of the backward with no module
    seen: dict[int, object] = {}
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        mod = tracker.module_of_seq(fn._sequence_nr())
        fn.register_prehook(lambda grads, _m=mod: tracker.mark(Phase.BACKWARD, _m))
        stack.extend(nf for nf, _ in fn.next_functions)


def _leaf_hooks(grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor | None:
    """The parameter's own gradient hooks (``param.register_hook``), run on its gradient as
    autograd runs them before accumulating it into ``.grad``, in order, a hook's result
    replacing the gradient: traced into the step (``autograd.grad`` runs none of them)."""
    hooks = getattr(param, "_backward_hooks", None)
    if grad is None or not hooks:
        return grad
    for hook in list(hooks.values()):
        out = hook(grad)
        if out is not None:
            grad = out
    return grad


def _obey_layout(grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor | None:
    """What autograd's AccumulateGrad stores as a fresh ``.grad``: the gradient itself when its
    strides match the parameter's, else a copy laid out like the parameter. Done in the graph so
    that the copy's memory is planned and measured like every other allocation."""
    if grad is None or grad.numel() <= 1:
        return grad
    dense = param.is_contiguous() or param.is_contiguous(memory_format=torch.channels_last)
    if dense and grad.stride() != param.stride():
        return torch.empty_strided(param.shape, param.stride(), dtype=grad.dtype,
                                   device=grad.device).copy_(grad)
    if not dense and not grad.is_contiguous():
        return grad.contiguous()
    return grad


@dataclass
class TracedStep:
    gm: torch.fx.GraphModule
    tracker: PhaseTracker
    param_names: list[str]
    buffer_names: list[str]
    batch_spec: Any
    n_batch: int
    # NOTE: the mode that traced it: it gives a constant's fake twin, which the ops read
    fake_mode: FakeTensorMode | None = None
    checkpoints: int = 0   # the model's torch.utils.checkpoint calls, traced as plain calls


def _fakeify(fake_mode: FakeTensorMode, t: torch.Tensor, device: torch.device | None):
    if t.device.type == "meta":
        dev = device or torch.device("cpu")
        with fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev,
                                       requires_grad=t.requires_grad)
    return fake_mode.from_tensor(t)


def _clip_grad_norm(grads: list[torch.Tensor | None], max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on the traced gradients:
    torch's own function with the kernels its default picks for the gradients' device (foreach
    where the device has them: CUDA, and the CPU in recent torch), so the clipped gradients round
    as eager's."""
    holders = [SimpleNamespace(grad=g) for g in grads if g is not None]  # NOTE: it reads p.grad
    if not holders:
        return
    # NOTE: eager's foreach=None asks ``_has_foreach_support`` of its gradients, plain tensors:
    # True wherever the device has foreach kernels (CUDA; the CPU too in recent torch). Traced
    # gradients are fake tensors, whose type fails that check, so left to itself the trace would
    # take the per-tensor path that eager does not: decide from the device, as eager's check does
    foreach = clip_grad._device_has_foreach_support(holders[0].grad.device)
    torch.nn.utils.clip_grad_norm_(holders, max_norm, foreach=foreach)


@contextlib.contextmanager
def _caches_cleared(model: torch.nn.Module):
    """Clear, after tracing, the ``functools.lru_cache`` caches of the model's code: the
    methods of its modules' classes (through wrappers too: transformers'
    ``compile_compatible_method_lru_cache``) and the functions of their Python modules. A
    cache filled while tracing holds a fake tensor, which a later eager call would get back
    (BEiT's relative position index). Cleared caches only fill again."""
    try:
        yield
    finally:
        for cache in _lru_caches(model):
            cache.cache_clear()


def _lru_caches(model: torch.nn.Module) -> list:
    classes = {c for m in model.modules() for c in type(m).__mro__
               if c.__module__.split(".")[0] not in ("torch", "builtins")}
    owners = [vars(c) for c in sorted(classes, key=lambda c: (c.__module__, c.__qualname__))]
    owners += [vars(sys.modules[m]) for m in sorted({c.__module__ for c in classes})
               if m in sys.modules]
    found: dict[int, object] = {}
    for namespace in owners:
        for obj in list(namespace.values()):
            obj = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
            for f in (obj, *(c.cell_contents for c in getattr(obj, "__closure__", None) or ()
                             if _filled(c))):
                if hasattr(f, "cache_clear") and hasattr(f, "cache_info"):
                    found[id(f)] = f
    return list(found.values())


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # NOTE: an empty closure cell
        return False
    return True


def trace_step(model: torch.nn.Module, batch: Any, loss_fn: LossFn | None,
               device: torch.device | None = None,
               clip_grad_norm: float | None = None) -> TracedStep:
    """Trace forward + loss + backward of ``model`` on ``batch`` with fake tensors (and, with
    ``clip_grad_norm``, the clipping of the gradients' global norm, as optimizer-phase ops)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise CaptureError("the model has no parameter with requires_grad=True; nothing to "
                           "train", module="")
    hooked = next((n for n, p in params.items() if getattr(p, "_post_accumulate_grad_hooks",
                                                           None)), None)
    if hooked is not None:
        raise CaptureError(f"parameter {hooked} has a post-accumulate-grad hook "
                           "(register_post_accumulate_grad_hook), which a planned step does "
                           "not run (it runs no Python): remove it, and for an update in the "
                           "backward pass optimizer_in_backward=True",
                           module=hooked.rpartition(".")[0], op="post_accumulate_grad_hook")
    buffers = dict(model.named_buffers())
    buffers.update({n: p for n, p in model.named_parameters() if not p.requires_grad})
    leaves, spec = tree_flatten(batch)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise CaptureError(f"batch leaf {i} is a {type(leaf).__name__}; the batch must be a "
                               "pytree (tuple/list/dict) of tensors: move Python values into the "
                               "model or loss_fn", module="", op="batch")
    # NOTE: a real tensor the forward reads that is neither parameter nor buffer (a cache the
    # model filled at an earlier call: BEiT's relative position index) is a constant of the graph
    fake_mode = CaptureFakeMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = _fakeify(fake_mode, t, device)
        return memo[id(t)]

    f_params = {n: fake(p) for n, p in params.items()}
    f_buffers = {n: fake(b) for n, b in buffers.items()}
    f_leaves = [fake(x) for x in leaves]
    tracker = PhaseTracker()
    names = list(params)

    def step(p: dict, b: dict, batch_leaves: list):
        tracker.mark(Phase.FORWARD, "")
        with _reparametrize_module(model, {**p, **b}, tie_weights=True):
            loss = compute_loss(model, tree_unflatten(list(batch_leaves), spec), loss_fn)
        _hook_backward(loss, tracker)
        tracker.mark(Phase.BACKWARD, "")
        grads = torch.autograd.grad(loss, [p[n] for n in names], allow_unused=True)
        grads = [_leaf_hooks(g, params[n]) for g, n in zip(grads, names)]
        grads = [_obey_layout(g, p[n]) for g, n in zip(grads, names)]
        tracker.mark(Phase.OPTIMIZER, "")
        if clip_grad_norm is not None:
            _clip_grad_norm(grads, clip_grad_norm)
        return loss, grads

    try:
        with (no_host_draws(), fake_mode, _module_hooks(model, tracker),
              _caches_cleared(model), plain_checkpoints() as seen):
            gm = make_fx(step, tracing_mode="real", record_module_stack=False)(
                f_params, f_buffers, f_leaves)
    except CaptureError:
        raise
    except Exception as e:  # NOTE: translate torch's tracing errors into one actionable error
        module = (tracker.error_module if tracker.error_module is not None
                  else tracker.plain_module)
        raise translate(e, module, model) from e
    return TracedStep(gm, tracker, names, list(buffers), spec, len(leaves), fake_mode,
                      seen.calls)

