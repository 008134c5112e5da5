"""The Plan IR: a flat list of frozen instructions that both the simulator and the executor walk.

One plan, two interpreters (DESIGN law 4): ``fitgraph.sim`` and ``fitgraph.execute`` each
dispatch on the instruction's class name (``getattr(self, "run_" + instr.op)``), so there is no
second representation of "what happens when".

Example:
    >>> from fitgraph.plan.instructions import Compute, Free, Plan
    >>> p = Plan((Compute(0), Free((3,)), Compute(1)))
    >>> [i.op for i in p]
    ['compute', 'free', 'compute']
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

__all__ = [
    "Compute", "Free", "Instruction", "Offload", "Plan", "Prefetch", "Recompute", "Wait",
]


@dataclass(frozen=True, slots=True)
class Instruction:
    op: ClassVar[str] = "instruction"


@dataclass(frozen=True, slots=True)
class Compute(Instruction):
    """Run graph node ``node`` on the compute stream; its fresh outputs become live."""

    node: int
    op: ClassVar[str] = "compute"


@dataclass(frozen=True, slots=True)
class Free(Instruction):
    """Release storages (every value that lives in them) from device memory."""

    storages: tuple[int, ...]
    op: ClassVar[str] = "free"


@dataclass(frozen=True, slots=True)
class Recompute(Instruction):
    """Run node ``node`` again to re-materialise outputs freed earlier (replaying its RNG state
    if it is random)."""

    node: int
    op: ClassVar[str] = "recompute"


@dataclass(frozen=True, slots=True)
class Offload(Instruction):
    """Start copying ``storage`` to host memory on the copy stream; device bytes are released
    once the copy completes (at the matching Wait or a later sync point)."""

    storage: int
    op: ClassVar[str] = "offload"


@dataclass(frozen=True, slots=True)
class Prefetch(Instruction):
    """Start copying ``storage`` back from host on the copy stream; it is device memory from the
    moment the copy starts."""

    storage: int
    op: ClassVar[str] = "prefetch"


@dataclass(frozen=True, slots=True)
class Wait(Instruction):
    """Make the compute stream wait for the copy of ``storage`` (offload or prefetch) to end."""

    storage: int
    op: ClassVar[str] = "wait"


@dataclass(frozen=True, slots=True)
class Plan:
    """An ordered, immutable program over one Graph."""

    instructions: tuple[Instruction, ...]
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __iter__(self) -> Iterator[Instruction]:
        return iter(self.instructions)

    def __len__(self) -> int:
        return len(self.instructions)

    def __getitem__(self, i: int) -> Instruction:
        return self.instructions[i]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for ins in self.instructions:
            out[ins.op] = out.get(ins.op, 0) + 1
        return out
