"""The Plan IR: a flat list of frozen instructions that both the simulator and the executor walk.

One plan, two interpreters (DESIGN law 4): ``fitgraph.sim`` and ``fitgraph.execute`` each
dispatch on the instruction's class name (``getattr(self, "run_" + instr.op)``), so there is no
second representation of "what happens when".

Offloading, in three instructions (the simulator, the verifier and the executor all follow it):

* ``Offload(s)`` starts copying storage ``s`` to host memory on the copy stream, once the data is
  ready (after everything the compute stream was given before it). ``s`` stays on device and may
  still be read, not written, until the ``Wait(s)`` that ends this offload: there the compute
  stream waits for the copy, ``s`` counts as host memory, and its device bytes are released
  (every value of ``s`` is gone from device, as after a ``Free``).
* ``Prefetch(s)`` starts copying ``s`` back; ``s`` is device memory from the moment the copy
  starts (its device buffer is allocated then). The ``Wait(s)`` that ends the prefetch comes
  before the first reader: the compute stream waits for the copy there, and the values of ``s``
  that existed at the release are back, same shape, strides and offset.
* Reading ``s`` between its release and its prefetch, or between a prefetch and its Wait, writing
  it while its offload is in flight, freeing it with a copy in flight, or ending the plan with a
  copy not waited for are plan errors (``fitgraph.plan.verify``). Resident storages and step
  outputs are never offloaded: the model and the caller hold them.

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
    """Start copying ``storage`` to host memory on the copy stream once its data is ready; its
    device bytes are released at the ``Wait`` that ends this offload (see the module doc)."""

    storage: int
    op: ClassVar[str] = "offload"


@dataclass(frozen=True, slots=True)
class Prefetch(Instruction):
    """Start copying an offloaded, released ``storage`` back from host on the copy stream; it is
    device memory from the moment the copy starts, readable after its ``Wait``."""

    storage: int
    op: ClassVar[str] = "prefetch"


@dataclass(frozen=True, slots=True)
class Wait(Instruction):
    """Make the compute stream wait for the copy of ``storage`` in flight to end: after an
    offload, the device bytes are released here; after a prefetch, readers may follow."""

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
