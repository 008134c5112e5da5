"""Rotor's chain model and its dynamic program (Beaumont, Eyraud-Dubois, Herrmann, Joly,
Shilova, "Optimal checkpointing for heterogeneous chains", 2019) — plain numbers, no graph.

A chain of stages ``0..n-1``: stage ``k`` runs forward ``F_k`` from ``a_{k-1}`` (what stage
``k - 1`` hands on; ``a_{-1}`` is the batch, resident) to ``a_k``, and backward ``B_k`` from
``δ_k`` (the gradient of ``a_k``) to ``δ_{k-1}``. ``F_k`` runs either without tape (keeps only
``a_k``) or with tape (keeps ``ā_k ⊇ a_k``, everything ``B_k`` reads); ``B_k`` needs ``ā_k``,
``δ_k`` and ``a_{k-1}``, frees ``ā_k`` and ``δ_k`` and leaves ``δ_{k-1}`` and the weight
gradients ``g_k``. ``r_k`` bytes (what cannot be recomputed) are held from the start until
``B_k``. Peaks: ``F_k`` adds ``f_ck[k]`` / ``f_all[k]`` to what is held (its output included),
``B_k`` adds ``b_peak[k]`` (``δ_{k-1}`` and ``g_k`` included).

``C(s, t, m)``, the least time to run the backward of stages ``s..t`` given ``a_{s-1}`` (held
outside ``m``) and ``δ_t``, within ``m`` bytes (which hold ``δ_t`` and ``r_s..r_t``, and at the
end ``δ_{s-1}`` and ``g_s..g_t``), is the least of
  - *tape*: ``F_s`` with tape, ``C(s+1, t, m - ā_s - r_s)``, then ``B_s``;
  - *checkpoint at s'*: ``F_s .. F_{s'-1}`` without tape (each input freed once used),
    ``C(s', t, m - a_{s'-1} - r_s..r_{s'-1})``, free ``a_{s'-1}``, then
    ``C(s, s'-1, m - g_{s'}..g_t)``,
with memory counted in ``SLOTS`` slots (sizes rounded up: the DP never under-counts). The
schedule it returns recomputes a stage as often as the nesting asks (several times at low m).

Example:
    >>> from fitgraph.solvers.peers.rotor_chain import ChainModel, replay, rotor_dp
    >>> m = ChainModel.uniform(4, uf=1.0, ub=2.0, a=10, tape=30)
    >>> full, low = rotor_dp(m, 200), rotor_dp(m, 60)
    >>> full.seconds, low.seconds > full.seconds, replay(m, low.ops)[1] <= 60
    (12.0, True, True)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SLOTS", "ChainModel", "Op", "RotorSchedule", "RotorTable", "replay", "rotor_dp"]

SLOTS = 500    # NOTE: the paper's memory discretisation; sizes are rounded up to a slot
_ALL = -1      # choice: forward with tape (or the single-stage base case)
_NONE = -2     # choice: infeasible


@dataclass(frozen=True)
class ChainModel:
    """Per stage ``k``: times, sizes (bytes) and transient peaks; see the module docstring."""

    uf: tuple[float, ...]      # time of F_k (a recompute)
    ub: tuple[float, ...]      # time of B_k
    a: tuple[int, ...]         # a_k: what F_k hands on to stage k + 1
    tape: tuple[int, ...]      # ā_k: what F_k with tape keeps (a_k included)
    fixed: tuple[int, ...]     # r_k: held from the start until B_k (never recomputed)
    delta: tuple[int, ...]     # δ_k: gradients held when B_k starts that outlive it
    grads: tuple[int, ...]     # g_k: what B_k leaves for the rest of the step
    f_ck: tuple[int, ...]      # peak of F_k without tape, beyond what is held (a_k included)
    f_all: tuple[int, ...]     # peak of F_k with tape (ā_k included)
    b_peak: tuple[int, ...]    # peak of B_k beyond what is held (δ_{k-1} and g_k included)

    @property
    def n(self) -> int:
        return len(self.uf)

    @classmethod
    def uniform(cls, n: int, uf: float, ub: float, a: int, tape: int) -> ChainModel:
        """``n`` equal stages whose gradients are the size of their activations."""
        return cls((uf,) * n, (ub,) * n, (a,) * n, (tape,) * n, (0,) * n,
                   (a,) * (n - 1) + (0,), (0,) * n, (a,) * n, (tape,) * n, (a,) * n)


@dataclass(frozen=True)
class Op:
    """``F`` (``tape``: keep ā_k), ``B`` or ``D`` (free a_k) of stage ``stage``."""

    kind: str
    stage: int
    tape: bool = False


@dataclass(frozen=True)
class RotorSchedule:
    ops: tuple[Op, ...]
    seconds: float             # the chain model's time of the whole sequence
    slot_bytes: int


def rotor_dp(model: ChainModel, memory: int, slots: int = SLOTS) -> RotorSchedule | None:
    """The least-time operation sequence within ``memory`` bytes (chain model), or None."""
    if memory <= 0 or model.n == 0:
        return None
    return RotorTable(model, memory, slots).schedule(memory)


class RotorTable:
    """The DP solved once for every memory up to ``memory`` bytes (``slots`` slots of
    ``unit`` bytes); ``schedule(m)`` reads the least-time sequence within ``m`` bytes off it."""

    def __init__(self, model: ChainModel, memory: int, slots: int = SLOTS) -> None:
        n = self.n = model.n
        self.unit = unit = max(1, -(-max(memory, 1) // slots))
        self.top = top = max(memory, 0) // unit

        def q(xs) -> np.ndarray:
            return np.array([-(-x // unit) for x in xs], dtype=np.int64)

        a, tape, r, d, g = (q(xs) for xs in (model.a, model.tape, model.fixed, model.delta,
                                             model.grads))
        fck, fall, bpk = q(model.f_ck), q(model.f_all), q(model.b_peak)
        uf = np.array(model.uf, dtype=float)
        rsum, gsum = np.cumsum([0, *r]), np.cumsum([0, *g])
        self.a, self.tape, self.r, self.rsum, self.gsum = a, tape, r, rsum, gsum
        slot = np.arange(top + 1)
        pad = self.pad = top + 1

        def shifted(rows: np.ndarray, by: np.ndarray) -> np.ndarray:
            """rows[j][m - by[j]] (inf where m < by[j]): the cost with ``by`` slots held
            outside."""
            start = pad - np.minimum(by, pad)
            return rows[np.arange(len(by))[:, None], start[:, None] + slot[None, :]]

        # NOTE: cost[s, t, pad + m] as one array, inf-padded on the left (m < 0): the
        # checkpoint option reads a row of subchains at once
        cost = self.cost = np.full((n, n, 2 * pad), np.inf)
        choice = self.choice = np.full((n, n, top + 1), _NONE, dtype=np.int32)
        for length in range(n):
            for s in range(n - length):
                t = s + length
                if s == t:
                    need = d[s] + r[s] + max(fall[s], tape[s] + bpk[s])
                    cost[s, s, pad + need:] = model.uf[s] + model.ub[s]
                    choice[s, s, need:] = _ALL
                    continue
                need = max(d[t] + rsum[t + 1] - rsum[s] + fall[s],
                           d[s] + gsum[t + 1] - gsum[s + 1] + r[s] + tape[s] + bpk[s])
                best = model.uf[s] + model.ub[s] + shifted(cost[s + 1, t][None],
                                                           tape[s:s + 1] + r[s])[0]
                best[:need] = np.inf
                pick = np.where(np.isfinite(best), _ALL, _NONE)
                # checkpoint after stage k = s..t-1 (s' = k + 1): forwards s..k without tape
                k = np.arange(s, t)
                inputs = np.concatenate(([0], a[s:t - 1]))
                fneed = np.maximum.accumulate(d[t] + rsum[t + 1] - rsum[s] + inputs + fck[s:t])
                ck = (np.cumsum(uf[s:t])[:, None]
                      + shifted(cost[s + 1:t + 1, t], a[s:t] + rsum[k + 1] - rsum[s])
                      + shifted(cost[s, s:t], gsum[t + 1] - gsum[k + 1]))
                ck[slot[None, :] < fneed[:, None]] = np.inf
                j = np.argmin(ck, axis=0)
                ck_best = ck[j, slot]
                better = ck_best < best
                best[better], pick[better] = ck_best[better], s + 1 + j[better]
                cost[s, t, pad:], choice[s, t] = best, pick

    def schedule(self, memory: int) -> RotorSchedule | None:
        """The least-time sequence within ``memory`` bytes (at most the table's), or None."""
        m = min(memory // self.unit, self.top) if memory > 0 else -1
        if m < 0 or not np.isfinite(self.cost[0, self.n - 1, self.pad + m]):
            return None
        a, tape, r, rsum, gsum = self.a, self.tape, self.r, self.rsum, self.gsum
        ops: list[Op] = []

        def emit(s: int, t: int, m: int) -> None:
            c = int(self.choice[s, t, m])
            if s == t:
                ops.extend((Op("F", s, True), Op("B", s)))
            elif c == _ALL:
                ops.append(Op("F", s, True))
                emit(s + 1, t, m - int(tape[s] + r[s]))
                ops.append(Op("B", s))
            else:
                ops.append(Op("F", s))
                for k in range(s + 1, c):
                    ops.extend((Op("F", k), Op("D", k - 1)))
                emit(c, t, m - int(a[c - 1] + rsum[c] - rsum[s]))
                ops.append(Op("D", c - 1))
                emit(s, c - 1, m - int(gsum[t + 1] - gsum[c]))

        emit(0, self.n - 1, m)
        return RotorSchedule(tuple(ops), float(self.cost[0, self.n - 1, self.pad + m]),
                             self.unit)


def replay(model: ChainModel, ops) -> tuple[float, int]:
    """(time, peak bytes) of an op sequence in the chain model; a ValueError names an op whose
    inputs are not held. The peak counts the bytes of the chain only (not resident ones)."""
    n = model.n
    a_held: set[int] = set()
    tape_held: set[int] = set()
    nxt, seconds = n - 1, 0.0
    mem = sum(model.fixed) + model.delta[n - 1]
    peak = mem

    def has(k: int) -> bool:
        return k < 0 or k in a_held or k in tape_held

    for i, op in enumerate(ops):
        k = op.stage
        if op.kind == "F":
            if not has(k - 1) or k > nxt or k in tape_held or (k in a_held and not op.tape):
                raise ValueError(f"op {i} {op}: input a_{k - 1} missing or output held")
            if op.tape:
                peak = max(peak, mem + model.f_all[k])
                if k in a_held:
                    a_held.remove(k)
                    mem -= model.a[k]
                tape_held.add(k)
                mem += model.tape[k]
            else:
                peak = max(peak, mem + model.f_ck[k])
                a_held.add(k)
                mem += model.a[k]
            seconds += model.uf[k]
        elif op.kind == "D":
            if k not in a_held:
                raise ValueError(f"op {i} {op}: a_{k} is not held")
            a_held.remove(k)
            mem -= model.a[k]
        else:
            if k != nxt or k not in tape_held or not has(k - 1):
                raise ValueError(f"op {i} {op}: B_{k} out of order or its inputs missing")
            peak = max(peak, mem + model.b_peak[k])
            tape_held.remove(k)
            mem += (model.grads[k] - model.tape[k] - model.fixed[k] - model.delta[k]
                    + (model.delta[k - 1] if k else 0))
            nxt -= 1
            seconds += model.ub[k]
    if nxt != -1:
        raise ValueError(f"the sequence ends before B_{nxt}")
    return seconds, peak
