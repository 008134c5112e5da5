"""Several torch optimizers stepped as one: Muon for a model's matrices and AdamW for the rest
(Muon updates 2-D parameters only), or any split of the parameters among optimizers.

``fitgraph.optimize(model, batch, loss_fn, [muon, adamw])`` wraps the list in a
``CombinedOptimizer``: its ``param_groups`` are the members' own group dicts, in order (so an
LR scheduler of either member is seen by the step), its ``state`` reads and writes the member
that owns each parameter, and ``step()`` / ``zero_grad()`` call each member's. A captured step
updates each parameter with its own optimizer's rule; the members' step hooks run as each
member's ``step()`` runs them: every member's pre-hooks before the first update, every
member's post-hooks after the last one.

Example:
    >>> import torch
    >>> net = torch.nn.Linear(4, 3)
    >>> both = CombinedOptimizer([torch.optim.Muon([net.weight], lr=0.02),
    ...                           torch.optim.AdamW([net.bias], lr=1e-3)])
    >>> len(both.param_groups), both.kinds()
    (2, ['muon', 'adam'])
    >>> net(torch.randn(2, 4)).sum().backward(); both.step()
    >>> sorted(both.state[net.weight]), sorted(both.state[net.bias])
    (['momentum_buffer'], ['exp_avg', 'exp_avg_sq', 'step'])
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

__all__ = ["CombinedOptimizer", "as_optimizer", "members"]


class CombinedOptimizer:
    """``optimizers`` (torch optimizers over disjoint parameters) stepped as one (module doc)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        opts = tuple(optimizers)
        if not opts:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        for o in opts:
            if isinstance(o, CombinedOptimizer) or not isinstance(o, torch.optim.Optimizer):
                raise TypeError(f"CombinedOptimizer takes torch.optim.Optimizer objects, not "
                                f"{type(o).__name__}")
        seen: dict[int, str] = {}
        for o in opts:
            for p in (p for g in o.param_groups for p in g["params"]):
                if id(p) in seen:
                    raise ValueError(
                        f"a parameter of shape {tuple(p.shape)} is in {seen[id(p)]} and in "
                        f"{type(o).__name__}: each parameter must have one optimizer (eager "
                        "would update it twice a step)")
                seen[id(p)] = type(o).__name__
        self.optimizers = opts
        self.state = _State(self)

    @property
    def param_groups(self) -> list[dict]:
        """The members' param groups (the same dicts), member by member."""
        return [g for o in self.optimizers for g in o.param_groups]

    def kinds(self) -> list[str]:
        """Each param group's optimizer kind (``optimizer_kinds.KINDS``; "?" where fitgraph
        does not capture the member)."""
        from .optimizer_kinds import kind_of

        out = []
        for o in self.optimizers:
            kind = kind_of(o)
            out += [kind.name if kind is not None else "?"] * len(o.param_groups)
        return out

    def step(self, closure=None):
        """Each member's ``step()``, in order (as a loop calling them one after another)."""
        if closure is not None:
            raise ValueError("CombinedOptimizer.step takes no closure: step each member yourself")
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for o, s in zip(self.optimizers, state["optimizers"], strict=True):
            o.load_state_dict(s)

    def __repr__(self) -> str:
        return f"CombinedOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"


class _State(Mapping):
    """The members' ``state`` as one mapping: a parameter's entry is its owner's (created, as
    torch's defaultdict creates it, on first read of an owned parameter)."""

    def __init__(self, combined: CombinedOptimizer) -> None:
        self._combined = combined
        self._owner: dict[int, torch.optim.Optimizer] = {}
        self._sizes: tuple = ()

    def _owner_of(self, p) -> torch.optim.Optimizer | None:
        groups = self._combined.param_groups
        sizes = tuple(len(g["params"]) for g in groups)
        if sizes != self._sizes:  # NOTE: add_param_group on a member: map again
            self._owner = {id(q): o for o in self._combined.optimizers
                           for g in o.param_groups for q in g["params"]}
            self._sizes = sizes
        return self._owner.get(id(p))

    def __getitem__(self, p) -> dict:
        owner = self._owner_of(p)
        if owner is None:
            raise KeyError(f"tensor of shape {tuple(p.shape)} is in none of the optimizers")
        return owner.state[p]

    def get(self, p, default=None):
        owner = self._owner_of(p)
        return default if owner is None else owner.state.get(p, default)

    def __contains__(self, p) -> bool:
        owner = self._owner_of(p)
        return owner is not None and p in owner.state

    def __iter__(self) -> Iterator:
        for o in self._combined.optimizers:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._combined.optimizers)


def as_optimizer(optimizer):
    """``optimizer`` as the step holds it: a list or tuple of optimizers becomes one
    ``CombinedOptimizer`` (one optimizer alone stays itself); anything else is returned as is."""
    if isinstance(optimizer, (list, tuple)):
        return optimizer[0] if len(optimizer) == 1 else CombinedOptimizer(optimizer)
    return optimizer


def members(optimizer) -> tuple:
    """The torch optimizers ``optimizer`` steps: a ``CombinedOptimizer``'s members, else itself."""
    if optimizer is None:
        return ()
    return optimizer.optimizers if isinstance(optimizer, CombinedOptimizer) else (optimizer,)
