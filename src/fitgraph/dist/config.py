"""A parallel configuration: how a training step is spread over devices.

``tp × pp × dp`` devices: tensor-parallel width, pipeline stages, data-parallel replicas;
``micro_batch`` samples per micro-batch, ``n_micro`` micro-batches per step per replica (the
global batch is ``dp × micro_batch × n_micro``); the pipeline ``schedule`` with ``chunks`` model
chunks per device (interleaved); ZeRO stage; sequence parallelism; the memory plan
(``recompute``: ``"auto"`` lets each stage choose op by op, or a global policy by name); and
whether the data-parallel gradient reduction overlaps the last backward. Stages may differ in
width (Piper's heterogeneous stages): every stage has ``tp × dp`` devices, stage ``k`` splits
them as ``widths[k]`` = (its tp, its dp), each of its replicas taking ``micro_batch × dp /
its dp`` samples of each micro-batch; ``per_stage`` asks the planner to choose them.

Ranks are laid out as Megatron-LM lays them: tensor-parallel fastest, then data-parallel, then
pipeline: rank ``= stage·(dp·tp) + replica·tp + shard``.

Example:
    >>> par = Parallelism(tp=8, pp=8, dp=16, micro_batch=1, n_micro=96)
    >>> par.devices, par.global_batch, par.tp_group(0), par.dp_group(0)[:3]
    (1024, 1536, [0, 1, 2, 3, 4, 5, 6, 7], [0, 8, 16])
    >>> parse_fix("tp=8,pp=8,dp=16,microbatch=1,schedule=1f1b")["schedule"]
    '1f1b'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .schedules import SCHEDULES

__all__ = ["ALL_SCHEDULES", "RECOMPUTE", "Parallelism", "parse_fix"]

ALL_SCHEDULES = (*SCHEDULES, "zb-h1", "zb-v")
RECOMPUTE = ("auto", "none", "selective", "full")


@dataclass(frozen=True)
class Parallelism:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    n_micro: int
    schedule: str = "1f1b"
    chunks: int = 1
    zero: int = 0
    sp: bool = False
    recompute: str = "auto"
    overlap_grad_reduce: bool = True
    widths: tuple[tuple[int, int], ...] = ()
    per_stage: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "micro_batch", "n_micro", "chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.schedule not in ALL_SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}: one of {ALL_SCHEDULES}")
        if self.schedule == "zb-v" and self.chunks != 2:
            raise ValueError(f"zb-v runs two chunks per device in a V, not {self.chunks}")
        if self.schedule not in ("interleaved", "zb-v") and self.chunks != 1:
            raise ValueError(f"{self.chunks} chunks per device with schedule {self.schedule}: "
                             f"only the interleaved and zb-v schedules run more than one")
        if self.schedule == "interleaved" and self.chunks < 2:
            raise ValueError("the interleaved schedule runs at least 2 chunks per device")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage {self.zero}: one of 0, 1, 2, 3")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute {self.recompute!r}: one of {RECOMPUTE}")
        if self.sp and self.tp == 1 and not (self.widths or self.per_stage):
            raise ValueError("sequence parallelism needs a tensor-parallel width above 1")
        if self.widths or self.per_stage:
            if self.chunks != 1:
                raise ValueError("per-stage widths need one chunk per device (not "
                                 f"{self.schedule} with {self.chunks})")
        if self.widths:
            object.__setattr__(self, "widths", tuple(tuple(w) for w in self.widths))
            if len(self.widths) != self.pp:
                raise ValueError(f"{len(self.widths)} stage widths for {self.pp} stages")
            for t, d in self.widths:
                if t * d != self.tp * self.dp or t < 1 or d < 1:
                    raise ValueError(f"stage width tp {t} x dp {d}: every stage has "
                                     f"{self.tp * self.dp} devices")
                if (self.micro_batch * self.dp) % d:
                    raise ValueError(f"stage dp {d} does not divide the {self.micro_batch * self.dp}"
                                     f" samples of a micro-batch")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.n_micro

    def stage_width(self, stage: int) -> tuple[int, int]:
        """(tp, dp) of ``stage``: its own where ``widths`` says, else the common one."""
        return self.widths[stage] if self.widths else (self.tp, self.dp)

    def rank(self, stage: int, replica: int, shard: int) -> int:
        t, _ = self.stage_width(stage)
        return stage * self.dp * self.tp + replica * t + shard

    def tp_group(self, rank: int) -> list[int]:
        base = rank - rank % self.tp
        return list(range(base, base + self.tp))

    def dp_group(self, stage: int, shard: int = 0) -> list[int]:
        return [self.rank(stage, r, shard) for r in range(self.stage_width(stage)[1])]

    def stage_tp_group(self, stage: int, replica: int = 0) -> list[int]:
        t, _ = self.stage_width(stage)
        return [self.rank(stage, replica, s) for s in range(t)]

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.dp * self.tp, (stage + 1) * self.dp * self.tp))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> Parallelism:
        return dataclasses.replace(self, **changes)


# NOTE: the names a user writes in --fix, and the fields they set.
_FIX_KEYS = {"tp": "tp", "pp": "pp", "dp": "dp", "microbatch": "micro_batch",
             "micro_batch": "micro_batch", "n_micro": "n_micro", "microbatches": "n_micro",
             "schedule": "schedule", "chunks": "chunks", "v": "chunks", "zero": "zero",
             "sp": "sp", "recompute": "recompute", "overlap": "overlap_grad_reduce",
             "per_stage": "per_stage"}
_BOOL = {"1": True, "true": True, "yes": True, "on": True,
         "0": False, "false": False, "no": False, "off": False}


def parse_fix(text: str) -> dict:
    """``"tp=8,pp=8,dp=16,microbatch=1,schedule=1f1b"`` -> the fields a search must keep."""
    out: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in _FIX_KEYS:
            raise ValueError(f"--fix {item!r}: expected key=value with key one of "
                             f"{', '.join(sorted(set(_FIX_KEYS)))}")
        field = _FIX_KEYS[key]
        value = value.strip().lower()
        if field in ("sp", "overlap_grad_reduce", "per_stage"):
            if value not in _BOOL:
                raise ValueError(f"--fix {key}={value}: expected 0/1, true/false")
            out[field] = _BOOL[value]
        elif field in ("schedule", "recompute"):
            out[field] = value
        else:
            try:
                out[field] = int(value)
            except ValueError:
                raise ValueError(f"--fix {key}={value}: expected an integer") from None
    return out
