"""The Python values a captured step reads as constants: scalars on the model's modules and
those the loss function reads (its closure, the globals it names, one call deep).

A traced graph holds a Python number it read as a constant: a loss weight annealed between steps
(``loss = ce + beta * kl``, ``beta`` a global), a temperature on a module (``self.temp``), a flag
that switches a branch. Eager PyTorch reads the new value at every call; a plan made for the old
one would not (silently other results). ``TrainStep`` keys its plans by these values too, so a
step after such a change plans again (and warns, naming the value: a tensor — a buffer, or a
part of the batch — serves every value with one plan).

What is tracked: ``bool``/``int``/``float`` attributes of every module of the model (not
private ones, not ``training``: ``fitgraph.ambient`` keys the modes), and of the loss function's
closure cells, the module globals it names, and, one level further, the functions and callable
objects it reaches that way (a loss ``lambda m, b: my_loss(m, b)``, a ``functools.partial``, a
bound method's object). What a forward changes itself (a counter ``self.calls += 1``) is not
tracked: the plan runs no Python, so such a value stays as the capture left it
(``StepValues.forget_forward_changes`` drops them from the key, with a warning naming them).

Example:
    >>> import torch
    >>> from fitgraph.python_values import python_refs, values
    >>> beta = 0.5
    >>> loss_fn = lambda m, b: m(b).sum() * beta
    >>> m = torch.nn.Linear(2, 2)
    >>> refs = python_refs([m], [""], loss_fn)
    >>> [r.label for r in refs if "beta" in r.label or "features" in r.label]
    ['Linear.in_features', 'Linear.out_features', "loss_fn's global beta"]
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Ref", "StepValues", "changed", "python_refs", "values"]

_SCALARS = (bool, int, float)
_GONE = object()
DEPTH = 2   # NOTE: the loss function and what it calls, one level down


@dataclass(frozen=True, eq=False)
class Ref:
    """Where one tracked value lives: ``holder[name]`` (a ``__dict__`` or globals) or, with
    ``name`` None, a closure cell."""

    label: str
    holder: Any
    name: str | None

    def get(self) -> Any:
        if self.name is None:
            try:
                return self.holder.cell_contents
            except ValueError:  # NOTE: an empty cell
                return _GONE
        return self.holder.get(self.name, _GONE)


def values(refs: Sequence[Ref]) -> tuple:
    """The tracked values now, in ``refs``' order (hashable: scalars)."""
    return tuple(r.get() for r in refs)


def changed(refs: Sequence[Ref], before: tuple, after: tuple) -> list[str]:
    """Labels of the values that differ between two ``values`` answers, with both values."""
    return [f"{r.label} ({a!r} -> {b!r})" for r, a, b in zip(refs, before, after) if a != b]


def python_refs(modules: Sequence[Any], names: Sequence[str],
                loss_fn: Callable | None) -> list[Ref]:
    """Refs to the scalars of ``modules`` (named ``names``, "" for the root) and of what
    ``loss_fn`` reads (see the module doc)."""
    refs = []
    for mod, name in zip(modules, names):
        refs += _object_refs(mod, name or type(mod).__name__)
    if loss_fn is not None:
        refs += _callable_refs(loss_fn, "loss_fn", DEPTH, set())
    return refs


def _object_refs(obj: Any, label: str) -> list[Ref]:
    d = getattr(obj, "__dict__", None)
    if not isinstance(d, dict):
        return []
    return [Ref(f"{label}.{k}", d, k) for k, v in d.items()
            if type(v) in _SCALARS and not k.startswith("_") and k != "training"]


def _callable_refs(fn: Any, label: str, depth: int, seen: set[int]) -> list[Ref]:
    if depth <= 0 or id(fn) in seen:
        return []
    seen.add(id(fn))
    if isinstance(fn, functools.partial):
        return _callable_refs(fn.func, label, depth, seen)
    if isinstance(fn, types.MethodType):
        return (_object_refs(fn.__self__, f"{label}'s object")
                + _callable_refs(fn.__func__, label, depth, seen))
    if not isinstance(fn, types.FunctionType):
        # NOTE: a callable object (an nn.Module loss, a class with __call__): its own scalars
        return _object_refs(fn, label) if callable(fn) else []
    refs = []
    for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if type(v) in _SCALARS:
            refs.append(Ref(f"{label}'s closure {var}", cell, None))
        elif callable(v):
            refs += _callable_refs(v, f"{label}'s {var}", depth - 1, seen)
    g = fn.__globals__
    for name in _names(fn.__code__):
        v = g.get(name, _GONE)
        if type(v) in _SCALARS:
            refs.append(Ref(f"{label}'s global {name}", g, name))
        elif isinstance(v, (types.FunctionType, functools.partial)):
            refs += _callable_refs(v, f"{label}'s {name}", depth - 1, seen)
    return refs


def _names(code: types.CodeType) -> list[str]:
    """Global names a function's code (and the code of the functions it defines) reads."""
    out = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out += _names(c)
    return list(dict.fromkeys(out))


class StepValues:
    """The values one training step tracks (``python_refs`` of ``model`` and ``loss_fn``), for
    a cache of plans keyed by tuples whose last element is ``now()``."""

    def __init__(self, model: Any, loss_fn: Callable | None) -> None:
        named = list(model.named_modules())
        self.refs = python_refs([m for _, m in named], [n for n, _ in named], loss_fn)

    def now(self) -> tuple:
        return values(self.refs)

    def say_changed(self, plans: dict, key: tuple) -> None:
        """Law 5: where a plan is made again because a tracked value changed (a key of
        ``plans`` equal to ``key`` but in its values), warn, naming it."""
        for k in plans:
            if k[:-1] == key[:-1] and k[-1] != key[-1]:
                what = ", ".join(changed(self.refs, k[-1], key[-1]))
                warnings.warn(f"fitgraph: {what} changed since the step was planned: planning "
                              "it again (the step reads it as a constant; as a tensor — a "
                              "buffer, or a part of the batch — one plan serves every value)",
                              stacklevel=4)
                return

    def forget_forward_changes(self, plans: dict, key: tuple) -> tuple[dict, tuple]:
        """Values that changed since ``key`` was taken, by the capture itself (a forward's
        counter), are not the caller's: they would change at every call. Untracked from now on,
        with a warning; (``plans``, ``key``) keyed without them."""
        gone = {i for i, (a, b) in enumerate(zip(key[-1], self.now())) if a != b}
        if not gone:
            return plans, key
        warnings.warn("fitgraph: the model's forward changes "
                      f"{', '.join(self.refs[i].label for i in sorted(gone))}; the planned "
                      "step runs no Python, so it stays as the capture left it", stacklevel=4)
        self.refs = [r for i, r in enumerate(self.refs) if i not in gone]

        def keep(k: tuple) -> tuple:
            return (*k[:-1], tuple(v for i, v in enumerate(k[-1]) if i not in gone))

        return {keep(k): p for k, p in plans.items()}, keep(key)
