"""A block as the multi-device planner sees it: the kernels of one micro-batch on one device.

A pipeline stage is a run of contiguous *blocks* (the embedding, each transformer layer, the
head and loss). A ``Block`` lists its forward ops, already sharded for its tensor-parallel
width: each ``Op`` has the FLOPs and device-memory bytes of its forward and backward on one
device, the bytes of its outputs the backward reads (``saved``: what the block keeps per
micro-batch unless the memory plan re-makes it), the ops whose outputs it reads (so a re-made
output knows what it needs), and the tensor-parallel collectives it runs. Units: FLOPs, bytes.

Pricing (``dist.block_cost``) turns a block into seconds on a device and a time–memory curve of
op-level recompute choices. The blocks come from a model's shape (``dist.gpt_blocks``) or, for
a captured graph, from its nodes.

Example:
    >>> op = Op("fc1", flops=8e9, bytes=1e8, saved=4e6, reads=("ln2",))
    >>> op.bwd_flops, op.matmul
    (16000000000.0, True)
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["COLLECTIVES", "INPUT", "Block", "Collective", "Op", "stage_params"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# NOTE: the name an op reads for the block's input: kept whatever the memory plan (it is the
# checkpoint full recompute starts from), and sent by the stage before.
INPUT = "input"


@dataclass(frozen=True)
class Collective:
    """A collective over the tensor-parallel group: ``kind`` on ``nbytes`` (the whole tensor,
    as ``dist.collectives`` counts it)."""

    kind: str
    nbytes: float

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {self.kind!r}: one of {COLLECTIVES}")
        if self.nbytes < 0:
            raise ValueError(f"collective {self.kind} of {self.nbytes} bytes")


@dataclass(frozen=True)
class Op:
    """One forward kernel and its backward, on one device, for one micro-batch.

    ``bwd_flops`` defaults to twice the forward's (input and weight gradients of a matmul) and
    ``bwd_bytes`` to the forward's; ``bwd_w_flops`` is the weight-gradient part of the backward
    (what a zero-bubble schedule defers). ``matmul`` ops run at the device's matmul peak, the
    others are bound by memory bandwidth. Where a cost model already timed the op (a captured
    graph's nodes), ``seconds``/``bwd_seconds``/``bwd_w_seconds`` hold its times on one device
    and pricing takes them as they are; ``recomputable`` False keeps its outputs whatever the
    memory plan (a random op drawn once, a value read far down the model).
    """

    name: str
    flops: float = 0.0
    bytes: float = 0.0
    saved: float = 0.0
    reads: tuple[str, ...] = ()
    bwd_flops: float | None = None
    bwd_bytes: float | None = None
    bwd_w_flops: float = 0.0
    matmul: bool | None = None
    fwd_comm: tuple[Collective, ...] = ()
    bwd_comm: tuple[Collective, ...] = ()
    seconds: float | None = None       # measured/modelled seconds, instead of the roofline
    bwd_seconds: float | None = None
    bwd_w_seconds: float | None = None
    recomputable: bool = True
    # NOTE: the matmuls it runs, (M, N, K, batch) each: a device that times GEMMs by their
    # shapes (``fitgraph.hw``'s chips) prices them so; a roofline by the FLOPs otherwise
    gemms: tuple[tuple[int, int, int, int], ...] = ()
    # NOTE: an elementwise op's arithmetic on the vector units (forward, backward): bound by
    # memory on GPUs, not on a chip with few vector lanes; not model FLOPs (MFU counts matmuls)
    vector_flops: float = 0.0
    bwd_vector_flops: float = 0.0

    def __post_init__(self) -> None:
        if self.bwd_flops is None:
            object.__setattr__(self, "bwd_flops", 2.0 * self.flops)
        if self.bwd_bytes is None:
            object.__setattr__(self, "bwd_bytes", float(self.bytes))
        if self.matmul is None:
            object.__setattr__(self, "matmul", self.flops > 0)
        if min(self.flops, self.bytes, self.saved, self.bwd_flops, self.bwd_bytes,
               self.bwd_w_flops) < 0:
            raise ValueError(f"op {self.name}: negative FLOPs or bytes")
        if self.bwd_w_flops > self.bwd_flops:
            raise ValueError(f"op {self.name}: weight-gradient FLOPs above the backward's")


@dataclass(frozen=True)
class Block:
    """A block's ops on one device at tensor-parallel width ``tp``, for one micro-batch.

    ``params``: parameters this device holds; ``input_bytes``: the block's input, kept through
    the backward (per device); ``output_bytes``: what it sends to the next block (a pipeline
    stage boundary's point-to-point); ``kind`` names the block's structure (blocks of one kind
    at one shape cost the same). ``model_flops``: the FLOPs of forward + backward the model
    needs (per device, no recompute) — what MFU counts. ``bwd_temp_bytes``: gradient buffers
    alive at once in the block's backward, beyond what it keeps. ``options``: named memory
    plans (name, ops whose saved outputs are re-made), e.g. Megatron's selective recompute.
    ``fission``: memory plans that re-make ops in parts (name, ops, parts): the re-made
    outputs and their gradients are alive one part at a time (a loss over a large vocabulary
    computed chunk by chunk, the logits never whole: Liger-Kernel's fused linear
    cross-entropy, what fitgraph's fission finds on one device).
    ``role``: "embedding", "body" or "head"; a recompute policy asked by name ("full",
    "selective") applies to the body's blocks, as Megatron-LM's does to its layers.
    ``shared``: parameters other blocks read too (name, count on this device), not in
    ``params``: a stage holds each once (``stage_params``); stages apart hold a copy each and
    reduce its gradient together (a tied embedding and LM head). ``largest_param``: the
    elements of its largest parameter tensor on this device (0: not known), what a
    one-tensor-at-a-time optimizer step's temporaries scale with; ``buffer_bytes``: buffers
    it reads (a causal mask), resident like its weights.
    """

    name: str
    kind: str
    ops: tuple[Op, ...]
    params: float
    input_bytes: float
    output_bytes: float
    tp: int = 1
    role: str = "body"
    shared: tuple[tuple[str, float], ...] = ()
    bwd_temp_bytes: float = 0.0
    options: tuple[tuple[str, tuple[str, ...]], ...] = ()
    fission: tuple[tuple[str, tuple[str, ...], int], ...] = ()
    largest_param: float = 0.0
    buffer_bytes: float = 0.0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        names = [op.name for op in self.ops]
        if len(set(names)) != len(names) or INPUT in names:
            raise ValueError(f"block {self.name}: op names must be unique and not {INPUT!r}")
        if self.role not in ("embedding", "body", "head"):
            raise ValueError(f"block {self.name}: role {self.role!r}")
        seen = {INPUT}
        for op in self.ops:
            missing = [r for r in op.reads if r not in seen]
            if missing:
                raise ValueError(f"block {self.name}: op {op.name} reads {missing}, which no "
                                 f"earlier op makes")
            seen.add(op.name)
        for name, dropped, *_ in self.options + self.fission:
            if set(dropped) - seen:
                raise ValueError(f"block {self.name}: option {name} re-makes unknown ops "
                                 f"{sorted(set(dropped) - seen)}")

    @property
    def model_flops(self) -> float:
        return sum(op.flops + op.bwd_flops for op in self.ops)

    @property
    def saved_bytes(self) -> float:
        """Activation bytes kept per micro-batch when nothing is re-made (input included)."""
        return self.input_bytes + sum(op.saved for op in self.ops)


def stage_params(blocks) -> float:
    """Parameters a run of blocks holds on one device: each block's own, each shared one once."""
    shared: dict[str, float] = {}
    for b in blocks:
        for name, count in b.shared:
            shared[name] = count
    return sum(b.params for b in blocks) + sum(shared.values())
