"""A block's op-level memory plan, run: the ops the plan drops (``drop:o2+o9``) are re-made in
the backward, the outputs of the others kept, as ``dist.block_cost`` priced it.

While the block's forward runs, a dispatch mode records each ATen op: its function and its
tensor arguments, as references to the records that made them (tensors made outside the
block — its inputs, parameters — are held as they are). The ops that make new tensors are
matched, in order, to the plan's units (each unit's ATen ops and whether the block's
backward reads it: ``DistPlan.stages[i]["block_ops"]``); ops whose outputs alias an input
(views) are not units, and the plan's constants eager does not dispatch (a tensor made from
Python data, lifted in the capture) are passed. Autograd's saved-tensor hooks then leave every tensor as it is except a
dropped unit's (or a view of one), which they swap for a handle. At the block's first unpack
in the backward, every handle's tensor is re-made at once, under ``no_grad``: the dropped ops
re-run, with the ops they read that the backward does not keep (``block_cost._rerun``), from
the kept tensors. The block keeps what the plan keeps and re-runs what it re-runs.

Never a wrong value: an op that drew random numbers is not re-run (one that may but did not,
attention at dropout 0, is), nor an op from another library (a collective), nor one that
writes in place; a tensor read after it was changed in place is not
re-made from the op that made it. Where a dropped tensor cannot be re-made from tensors that
are alive, it is kept (the rank keeps more than planned) and a note says so; where the ops do
not match the plan, later calls re-make the whole block and a note says so.

Example (an MLP whose ReLU output is re-made from the first matmul's, itself re-run):
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    >>> units = [[["aten.addmm.default"], False], [["aten.relu.default"], True],
    ...          [["aten.addmm.default"], False]]
    >>> notes = []
    >>> recompute_ops(net, units, {1}, "mlp", notes)
    >>> net(torch.randn(4, 8)).sum().backward()
    >>> notes, net[0].weight.grad.shape
    ([], torch.Size([8, 8]))
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

from .tp_layers import in_glue

__all__ = ["recompute_ops", "plan_units"]

KEEP, DROP, UNSAVED, VIEW, OPAQUE = "keep", "drop", "unsaved", "view", "opaque"


def plan_units(signature: list, dropped: set[int]) -> list[str]:
    """Per unit of a block's plan signature ``[[ops...], saved], ...``: keep, drop or
    unsaved (its backward reads none of it: re-run where a dropped op needs it)."""
    return [DROP if i in dropped else KEEP if saved else UNSAVED
            for i, (_, saved) in enumerate(signature)]


def recompute_ops(module: torch.nn.Module, signature: list, dropped: set[int], block: str,
                  notes: list[str]) -> None:
    """Run ``module`` so that its backward re-makes the units ``dropped`` (indices into
    ``signature``, the plan's units of the block) and keeps the rest."""
    from torch.utils.checkpoint import checkpoint

    inner = module.forward
    decisions = plan_units(signature, dropped)
    ops = [(name, d) for (names, _), d in zip(signature, decisions) for name in names]
    whole = []

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if whole:
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        rec = _Recorder(ops, block)
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack), rec:
            out = inner(*args, **kwargs)
        rec.finish()
        for note in rec.notes:
            if note not in notes:
                # NOTE: law 5: said when found, not only in report()
                warnings.warn(f"fitgraph.dist: {note}", stacklevel=2)
                notes.append(note)
        if rec.mismatch:
            whole.append(True)
        return out

    module.forward = forward


class _Ref:
    """An argument made in the block: output ``index`` of ``record``."""

    __slots__ = ("record", "index")

    def __init__(self, record: _Record, index: int) -> None:
        self.record, self.index = record, index


class _Held:
    """An argument held as it is: made outside the block, or changed in place since made
    (then only while alive: ``weak``)."""

    __slots__ = ("tensor", "version", "weak", "changed")

    def __init__(self, t: torch.Tensor, weak: bool) -> None:
        self.weak = self.changed = weak
        self.tensor = weakref.ref(t) if weak else t
        self.version = t._version

    def get(self) -> torch.Tensor | None:
        return self.tensor() if self.weak else self.tensor

    def pin(self) -> bool:
        """Hold it from now on (a re-made output needs it); False if it is gone."""
        t = self.get()
        if t is None:
            return False
        self.tensor, self.weak = t, False
        return True


class _Record:
    __slots__ = ("func", "spec", "leaves", "outs", "decision", "base", "__weakref__")

    def __init__(self, func, spec, leaves, outs, decision, base) -> None:
        self.func, self.spec, self.leaves = func, spec, leaves
        self.outs = outs            # weak references to the outputs
        self.decision = decision
        self.base = base            # a view's record: the record whose tensor it views

    def kind(self) -> str:
        r = self
        while r.decision == VIEW and r.base is not None:
            r = r.base
        return r.decision if r.decision != VIEW else KEEP


class _Handle:
    """What autograd holds for a dropped tensor until the backward needs it."""

    __slots__ = ("ref", "value", "__weakref__")

    def __init__(self, ref: _Ref) -> None:
        self.ref, self.value = ref, None


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list[tuple[str, str]], block: str) -> None:
        super().__init__()
        self.ops, self.block, self.pos = ops, block, 0
        self.made = WeakTensorKeyDictionary()     # tensor -> (record, output index, version)
        self.handles: list[_Handle] = []
        self.closures: dict[int, list[_Record] | None] = {}
        self.pins: dict[tuple[int, int], torch.Tensor] = {}
        self.unplanned: set[tuple[int, int]] = set()   # pins the plan does not keep
        self.notes: list[str] = []
        self.mismatch = False
        self.kept_bytes = 0

    # --- forward: record -------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seeded = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        before = _rng_states() if seeded else None
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if outs:
            # NOTE: an op that may draw random numbers (dropout, attention with dropout) drew
            # none if the generators did not move (attention at dropout 0): it re-runs alike
            drew = seeded and not _same(before, _rng_states())
            self._record(func, args, kwargs, outs, drew)
        return out

    def _record(self, func, args, kwargs, outs, drew: bool = False) -> None:
        flat, spec = tree_flatten((args, kwargs))
        leaves = []
        storages = {}
        for a in flat:
            if not isinstance(a, torch.Tensor):
                leaves.append(a)
                continue
            storages.setdefault(_storage(a), a)
            hit = self.made.get(a)
            if hit is not None and hit[2] == a._version:
                leaves.append(_Ref(hit[0], hit[1]))
            else:
                # NOTE: made outside the block (held: a checkpoint keeps its inputs too), or
                # changed in place since made (its maker would re-make the old value)
                leaves.append(_Held(a, weak=hit is not None))
        name = str(func)
        base = None
        aliases = all(_storage(t) in storages for t in outs)
        glue = in_glue()
        if not glue:
            self._skip_constants(name)
        if glue:
            # NOTE: a tensor-parallel collective and its copies (tp_layers): not the plan's
            # units, never re-run; what reads their outputs reads them as made
            decision = OPAQUE
        elif self.pos < len(self.ops) and not self.mismatch and name == self.ops[self.pos][0]:
            decision = self.ops[self.pos][1]
            self.pos += 1
        elif aliases:
            decision = VIEW
            hit = self.made.get(storages[_storage(outs[0])])
            base = hit[0] if hit is not None else None
        elif not storages and _constant(name):
            # NOTE: a constant the capture lifted out of the graph (made from no tensor): not
            # a unit of the plan; made again where a re-made op reads it
            decision = UNSAVED
        else:
            decision = OPAQUE
            if not self.mismatch:
                self.mismatch = True
                want = (f"the plan's op {self.pos} ({self.ops[self.pos][0]})"
                        if self.pos < len(self.ops) else "the plan's last op")
                self.notes.append(f"{self.block}: op {name} at run time is not {want}: later "
                                  f"calls re-make the whole block")
        if drew or not _replayable(func):
            if decision == DROP:
                self.notes.append(f"{self.block}: {name} (a unit the plan re-makes) "
                                  f"{'draws random numbers' if drew else 'writes in place'}: "
                                  f"kept")
            decision = OPAQUE
        record = _Record(func, spec, leaves, [weakref.ref(t) for t in outs], decision, base)
        writes = func._schema.is_mutable
        for i, t in enumerate(outs):
            # NOTE: the version a reader will see: autograd shares a view's counter with what
            # it views, and counts a write in place, only once this op has returned
            viewed = storages.get(_storage(t))
            version = t._version if viewed is None else viewed._version + int(writes)
            self.made[t] = (record, i, version)

    # --- forward: what autograd saves ---------------------------------------------------
    def pack(self, t: torch.Tensor):
        hit = self.made.get(t)
        if hit is None or hit[2] != t._version:
            return t
        record, index, _ = hit
        if record.kind() != DROP:
            return t
        closure = self._closure(record)
        if closure is None:
            self.kept_bytes += t.untyped_storage().nbytes()
            return t
        handle = _Handle(_Ref(record, index))
        self.handles.append(handle)
        return handle

    def _closure(self, record: _Record) -> list[_Record] | None:
        """The records to re-run to re-make ``record``'s outputs, in forward order; None
        where some tensor it needs is neither kept nor re-makeable."""
        key = id(record)
        if key in self.closures:
            return self.closures[key]
        self.closures[key] = None     # NOTE: cycle guard (a record never reads a later one)
        need: list[_Record] = []
        ok = True
        for leaf in record.leaves:
            if isinstance(leaf, _Held):
                ok = ok and leaf.pin()
            elif isinstance(leaf, _Ref):
                ok = ok and self._need(leaf, need)
        result = None
        if ok:
            seen: set[int] = set()
            result = [r for r in [*need, record] if not (id(r) in seen or seen.add(id(r)))]
        self.closures[key] = result
        return result

    def _need(self, ref: _Ref, need: list[_Record]) -> bool:
        """Add what re-makes ``ref`` to ``need``: a kept output is held (pinned) as it is,
        any other re-run; False where that cannot be done."""
        q = ref.record
        if q.decision in (KEEP, OPAQUE):
            t = q.outs[ref.index]()
            if t is not None:
                self.pins[(id(q), ref.index)] = t
                if q.decision == OPAQUE:
                    self.unplanned.add((id(q), ref.index))
                return True
            if q.decision == OPAQUE:
                return False
        sub = self._closure(q)
        if sub is None:
            return False
        need.extend(sub)
        return True

    def _skip_constants(self, name: str | None) -> None:
        """Pass the plan's constants that eager does not dispatch (a tensor made from Python
        data is lifted in the capture, made outside any op at run time)."""
        while (self.pos < len(self.ops) and not self.mismatch and self.ops[self.pos][0] != name
               and _constant(self.ops[self.pos][0])):
            self.pos += 1

    def finish(self) -> None:
        """The forward is over: keep only what the handles need."""
        self._skip_constants(None)
        if self.pos < len(self.ops) and not self.mismatch:
            self.mismatch = True
            self.notes.append(f"{self.block}: the ops at run time stop before the plan's op "
                              f"{self.pos} ({self.ops[self.pos][0]}): later calls re-make the "
                              f"whole block")
        self.made = WeakTensorKeyDictionary()
        needed = {id(r): r for h in self.handles for r in self.closures[id(h.ref.record)]}
        read = {(id(leaf.record), leaf.index) for r in needed.values() for leaf in r.leaves
                if isinstance(leaf, _Ref)}
        self.pins = {k: v for k, v in self.pins.items() if k in read}
        extra = {_storage(t): t.untyped_storage().nbytes()
                 for k, t in self.pins.items() if k in self.unplanned}
        extra.update({_storage(leaf.get()): leaf.get().untyped_storage().nbytes()
                      for r in needed.values() for leaf in r.leaves
                      if isinstance(leaf, _Held) and leaf.changed})
        if self.kept_bytes or extra:
            self.notes.append(
                f"{self.block}: keeps {self.kept_bytes + sum(extra.values())} bytes the plan "
                f"does not (outputs of random ops, collectives or writes in place that a "
                f"re-made op reads, or dropped outputs that need them)")
        self.closures = {k: v for k, v in self.closures.items() if k in needed}
        self.handles = [weakref.ref(h) for h in self.handles]

    # --- backward: re-make ---------------------------------------------------------------
    def unpack(self, h):
        if not isinstance(h, _Handle):
            return h
        if h.value is None:
            self._remake()
        return h.value

    def _remake(self) -> None:
        live = [h for h in (w() for w in self.handles) if h is not None and h.value is None]
        order: dict[int, _Record] = {}
        for h in live:
            for r in self.closures[id(h.ref.record)]:
                order.setdefault(id(r), r)
        values: dict[tuple[int, int], torch.Tensor] = dict(self.pins)
        with torch.no_grad(), _no_autocast():
            for key, r in order.items():
                args, kwargs = tree_unflatten([_value(leaf, values) for leaf in r.leaves],
                                              r.spec)
                out = r.func(*args, **kwargs)
                for i, t in enumerate(t for t in tree_flatten(out)[0]
                                      if isinstance(t, torch.Tensor)):
                    values.setdefault((key, i), t)     # NOTE: a pinned output stays
        for h in live:
            h.value = values[(id(h.ref.record), h.ref.index)]
        self.pins.clear()
        self.closures.clear()


def _value(leaf, values):
    if isinstance(leaf, _Ref):
        return values[(id(leaf.record), leaf.index)]
    if isinstance(leaf, _Held):
        t = leaf.get()
        if t is None:
            raise RuntimeError("fitgraph.dist: a tensor needed to re-make a dropped output was "
                               "freed")
        if not isinstance(t, torch.nn.Parameter) and t._version != leaf.version:
            raise RuntimeError("fitgraph.dist: one of the tensors needed to re-make a dropped "
                               "output was changed in place after the forward read it")
        return t
    return leaf


def _no_autocast() -> contextlib.ExitStack:
    """Ops re-run as recorded: autocast's casts were recorded as ops of their own."""
    stack = contextlib.ExitStack()
    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t)


def _constant(name: str) -> bool:
    """An op that makes a tensor from no other (a lifted constant, a factory)."""
    if name.split(".")[1:2] in (["lift_fresh_copy"], ["lift_fresh"]):
        return True
    try:
        ns, op, overload = name.split(".")
        schema = getattr(getattr(getattr(torch.ops, ns), op), overload)._schema
    except (AttributeError, ValueError, RuntimeError):
        return False
    return not any("Tensor" in str(a.type) for a in schema.arguments)


def _replayable(func) -> bool:
    """An ATen op that writes nothing in place (whether it drew random numbers is seen when
    it runs)."""
    return getattr(func, "namespace", "") == "aten" and not func._schema.is_mutable


def _rng_states() -> list[torch.Tensor]:
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
