"""A captured training step as the multi-device planner's blocks: any model fitgraph captures.

The graph is cut into the chain fitgraph's Rotor peer cuts it into (``solvers.peers.rotor.
chain_stages``): what runs before the first repeated block, one block per repeated block (a
numbered module: ``h.3``, ``encoder.layer.11``, ``layer2.1``; top-level modules when the model
repeats none), then the head and loss; each backward unit goes with the block whose forward it
differentiates. A block's ops are its forward units (``solvers.remat.stages``), each timed by
the cost model (a roofline of the target device, or measured), saving what its block's
backward reads; its backward is timed whole (the weight-gradient part: units that make a
parameter's gradient). Values read beyond the next block (masks, skips) and random units are
kept, never re-made. So each block gets the same op-level time–memory curve as a GPT layer.

Scale: the graph is captured at ``batch_size`` samples; a micro-batch of ``b`` scales times,
activations and FLOPs by ``b / batch_size`` (linear in the batch, as the kernels are at the
sizes planned), parameters not. Tensor parallelism: the weight matmuls ``dist.graph_tp`` finds
splittable run on ``1/tp`` of their data with their all-reduces (Megatron's column/row pairs,
found from the graph's structure), the rest of each block whole on every device. Sequence
parallelism (``sp``): the ops ``dist.sequence_parts`` finds on parts of the sequence (from a
row-parallel matmul through dropout, residual adds and norms to the next matmul) run on
``1/tp`` of the rows, saving ``1/tp`` of what they save, and a block's input held so where it
is a part; each all-reduce becomes a reduce-scatter after the row-parallel matmul and an
all-gather before the column-parallel one (again in its backward, which holds only the
part), as ``dist.runtime.tp_layers`` runs them. ``loss_in_parts=False`` leaves out the head's option of
re-making its loss in parts (what ``dist.runtime`` runs).

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.cost import RooflineCostModel, get_device
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    >>> g = fitgraph.capture(model, torch.randn(32, 64), lambda m, b: m(b).square().mean())
    >>> gm = GraphModel(g, RooflineCostModel(get_device("a100-80gb")), batch_size=32)
    >>> len(gm.blocks(1, 32, False)), gm.why_not(1, 32, True) is not None
    (7, True)
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import replace

from ..cost.base import CostModel
from ..graph.dim_region import grow_region
from ..graph.ir import Graph, Phase, Role
from ..solvers.peers.rotor import chain_stages, rotor_chain, value_readers
from ..solvers.remat.stages import stage_graph
from .graph_tp import TensorParallelMap, tensor_parallel_map
from .ops import INPUT, Block, Collective, Op
from .sequence_parts import sequence_parts

__all__ = ["GraphModel", "GraphModelError"]


class GraphModelError(ValueError):
    """The captured graph cannot be cut into a chain of blocks."""


def param_signature(named_shapes) -> str:
    """A hash of a model's parameters, ``(name, shape)`` pairs in any order: what a plan made
    for a captured model records, and the runtime checks against the model it runs.

    Example:
        >>> param_signature([("w", (2, 3))]) == param_signature([("w", [2, 3])])
        True
    """
    import hashlib

    text = ";".join(f"{n}:{tuple(int(d) for d in s)}" for n, s in sorted(named_shapes))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class GraphModel:
    """A captured step (``graph``, timed by ``cost_model``) as a chain of blocks."""

    def __init__(self, graph: Graph, cost_model: CostModel, *, batch_size: int,
                 name: str = "", seq: int = 1, loss_in_parts: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size {batch_size}: the samples the graph was captured at")
        self.name = name or str(graph.meta.get("model", "captured"))
        self.seq = seq
        self.batch_size = batch_size
        self._chain = _Chain(graph, cost_model)
        if not loss_in_parts:
            # NOTE: what the runtime runs (dist.runtime): it re-makes no loss in parts yet
            self._chain.loss_parts = 1
        self._at: dict[tuple[int, bool], tuple[list[Block], str | None]] = {}
        self._flops = sum(n.flops for n in graph.nodes
                          if n.phase in (Phase.FORWARD, Phase.LOSS, Phase.BACKWARD))
        self.param_signature = param_signature(
            (name.removeprefix("param:"), graph.values[vid].shape)
            for name, vid in zip(graph.input_names, graph.inputs)
            if name.startswith("param:"))

    def blocks(self, tp: int, micro_batch: int, sp: bool) -> list[Block]:
        why = self.why_not(tp, micro_batch, sp)
        if why:
            raise ValueError(why)
        r = micro_batch / self.batch_size
        return [_scaled(b, r) for b in self._width(tp, sp)[0]]

    def why_not(self, tp: int, micro_batch: int, sp: bool) -> str | None:
        if micro_batch < 1 or tp < 1:
            return f"micro-batch {micro_batch}, tensor-parallel width {tp}"
        if sp and tp == 1:
            return "sequence parallelism splits between tensor-parallel devices: tp > 1"
        return self._width(tp, sp)[1]

    def tensor_parallel(self, tp: int) -> TensorParallelMap:
        """Which weight matmuls are split at width ``tp`` (and why others are not)."""
        return self._chain.tp_map(tp)

    def _width(self, tp: int, sp: bool = False) -> tuple[list[Block], str | None]:
        if (tp, sp) not in self._at:
            tpm = self._chain.tp_map(tp)
            why = None
            if tp > 1 and not tpm.groups:
                why = (f"{self.name}: no weight matmul splits over {tp} devices"
                       + (f" (first refusal: {tpm.refused[0]})" if tpm.refused else ""))
            self._at[(tp, sp)] = (self._chain.blocks(tpm, sp), why)
        return self._at[(tp, sp)]

    def model_flops(self, samples: int) -> float:
        return self._flops * samples / self.batch_size

    def retimed(self, cost_model: CostModel) -> GraphModel:
        """The same model timed by another cost model (a candidate chip, ``fitgraph.hw``):
        its chain, cuts and memory kept, each unit's seconds re-made from its nodes."""
        new = copy.copy(self)
        new._chain = self._chain.retimed(cost_model)
        new._at = {}
        return new

    def timed_nodes(self) -> list[int]:
        """The nodes whose times make the blocks' forward and backward seconds."""
        ch = self._chain
        return [m for u in sorted({*ch.fstage, *ch.bstage}) for m in ch.sg.units[u].members]

    def op_signature(self, block: str) -> list[list]:
        """The ops of ``block`` as the runtime finds them (``dist.runtime.op_recompute``): per
        op ``o{i}``, the ATen ops of its unit and whether the block's plan keeps its output
        (its backward, or a later block, reads it)."""
        ch = self._chain
        k = ch.names.index(block)
        units = sorted(u for u, s in ch.fstage.items() if s == k)
        ops = self._width(1)[0][k].ops
        return [[[str(ch.graph.nodes[m].target) for m in ch.sg.units[u].members],
                 ops[i].saved > 0] for i, u in enumerate(units)]


def _scaled(block: Block, r: float) -> Block:
    if r == 1:
        return block
    ops = tuple(replace(op, flops=op.flops * r, bytes=op.bytes * r, saved=op.saved * r,
                        bwd_flops=op.bwd_flops * r, bwd_bytes=op.bwd_bytes * r,
                        bwd_w_flops=op.bwd_w_flops * r,
                        seconds=None if op.seconds is None else op.seconds * r,
                        bwd_seconds=None if op.bwd_seconds is None else op.bwd_seconds * r,
                        bwd_w_seconds=None if op.bwd_w_seconds is None else op.bwd_w_seconds * r)
                for op in block.ops)
    return replace(block, ops=ops, input_bytes=block.input_bytes * r,
                   output_bytes=block.output_bytes * r, bwd_temp_bytes=block.bwd_temp_bytes * r)


class _Chain:
    """The graph cut into its chain once; blocks at any tensor-parallel width from it."""

    def __init__(self, graph: Graph, cost_model: CostModel) -> None:
        sg = stage_graph(graph, cost_model)
        fstage, bstage, names = chain_stages(graph, sg)
        if len(names) < 2 or not bstage:
            raise GraphModelError(
                f"{graph.meta.get('model', 'the graph')}: no chain of at least two blocks with "
                f"a backward was found (repeated numbered modules such as layers.0, layers.1, "
                f"or top-level modules); a model that is one block runs on one device per "
                f"replica: plan it with pp=1")
        self.graph, self.sg, self.fstage, self.bstage, self.names = (graph, sg, fstage, bstage,
                                                                     names)
        self.readers = value_readers(sg, fstage, bstage)
        # node -> block: unit members, then views (folded) with the block of what they view
        node_block: dict[int, int] = {}
        for u, k in fstage.items():
            for m in sg.units[u].members:
                node_block[m] = k
        for n in graph.nodes:
            if n.id not in node_block and n.phase in (Phase.FORWARD, Phase.LOSS):
                src = [graph.values[v].producer for v in n.inputs]
                ks = [node_block[p] for p in src if p is not None and p in node_block]
                if ks:
                    node_block[n.id] = ks[0]
        self.node_block = node_block
        self._maps: dict[int, TensorParallelMap] = {}
        # NOTE: each block's backward peak beyond what it holds (its gradients, the input
        # gradient it hands down): Rotor's chain model walks it unit by unit
        chain = rotor_chain(graph, sg)
        self.bwd_peak = list(chain.model.b_peak) if chain else [0] * len(names)
        self.loss_parts = _loss_parts(graph, sg, fstage, node_block, len(names) - 1)
        self.tied_add = _tied_grad_adds(graph, sg, bstage, len(names))

    def retimed(self, cost_model: CostModel) -> _Chain:
        new = copy.copy(self)
        g = self.graph
        new.sg = replace(self.sg, units=tuple(
            replace(u, seconds=sum(cost_model.node_cost(g, g.nodes[m]).seconds
                                   for m in u.members)) for u in self.sg.units))
        return new

    def tp_map(self, tp: int) -> TensorParallelMap:
        if tp not in self._maps:
            self._maps[tp] = tensor_parallel_map(self.graph, tp, self.node_block)
        return self._maps[tp]

    def blocks(self, tpm: TensorParallelMap, sp: bool = False) -> list[Block]:
        return _chain_blocks(self, tpm, sp and tpm.tp > 1)


LOSS_PARTS = 8


def _tied_grad_adds(graph: Graph, sg, bstage: dict[int, int], n: int) -> list[int]:
    """Per block, the bytes of the adds that sum a tied parameter's gradient contributions
    (the embedding's and the head's): one captured step adds them into a new tensor, which
    a pipeline does not — each stage's copy takes its own contribution and the copies'
    gradients are summed between stages after the backward."""
    tied = {}
    for name, vid in zip(graph.input_names, graph.inputs):
        if name.startswith("param:"):
            tied.setdefault(graph.values[vid].storage, []).append(name[len("param:"):])
    unit_of = {m: u for u, unit in enumerate(sg.units) for m in unit.members}
    out = [0] * n
    for names in tied.values():
        for name in names:
            vid = graph.outputs.get(f"grad:{name}")
            if vid is None:
                continue
            node = graph.values[vid].producer
            if node is None or "add" not in str(graph.nodes[node].target):
                continue
            # NOTE: an add of two gradients (both made in the backward) is a tied weight's
            # sum; an add of a gradient and a constant is not
            made = [graph.values[i].producer for i in graph.nodes[node].inputs]
            if sum(1 for p in made if p is not None
                   and graph.nodes[p].phase is Phase.BACKWARD) < 2:
                continue
            k = bstage.get(unit_of.get(node, -1))
            if k is not None:
                out[k] += graph.storages[graph.values[vid].storage].nbytes
    return out


def _loss_parts(graph: Graph, sg, fstage, node_block, k: int) -> int:
    """In how many parts the last block (head and loss) can run: its forward split along the
    tokens (or the batch) of what it reads from the block before, by fission's dimension rules
    (``graph.dim_region``) — the logits never whole, as fitgraph's fission does on one device;
    1 where its forward does not split so."""
    nodes = {m for u, s in fstage.items() if s == k for m in sg.units[u].members}
    ins = []
    for m in sorted(nodes):
        for v in graph.nodes[m].inputs:
            pr = graph.values[v].producer
            if pr is not None and node_block.get(pr) == k - 1 and v not in ins:
                ins.append(v)
    for v in ins[:1]:
        shape = graph.values[v].shape
        for dim in (1, 0):
            if dim < len(shape):
                region = grow_region(graph, v, dim)
                if nodes <= set(region.nodes) and region.length >= 2:
                    return min(LOSS_PARTS, region.length)
    return 1


def _tp_comm(m: int, tpm: TensorParallelMap, sp: bool) -> tuple[tuple, tuple]:
    """The forward and backward collectives of node ``m``: a row-parallel matmul's sums, a
    column-parallel group's input (``_tp_input_comm`` / ``_tp_output_comm`` of a GPT)."""
    fwd, bwd = [], []
    if m in tpm.reduce_bytes:
        b = tpm.reduce_bytes[m]
        if sp:
            fwd.append(Collective("reduce_scatter", b))
            bwd.append(Collective("all_gather", b))
        else:
            fwd.append(Collective("all_reduce", b))
    if m in tpm.input_grad_bytes:
        b = tpm.input_grad_bytes[m]
        if sp:
            fwd.append(Collective("all_gather", b))
            bwd += [Collective("all_gather", b), Collective("reduce_scatter", b)]
        else:
            bwd.append(Collective("all_reduce", b))
    return tuple(fwd), tuple(bwd)


def _chain_blocks(chain: _Chain, tpm: TensorParallelMap, sp: bool = False) -> list[Block]:
    graph, sg, fstage, bstage, names = (chain.graph, chain.sg, chain.fstage, chain.bstage,
                                        chain.names)
    readers = chain.readers
    tp = tpm.tp
    units, nodes, values = sg.units, graph.nodes, graph.values
    n = len(names)
    # parameters: storage -> (numel, the stages whose forward reads it)
    params: dict[int, int] = {}
    for vid in graph.inputs:
        v = values[vid]
        if v.role is Role.PARAMETER:
            params[v.storage] = math.prod(v.shape) if v.shape else 1
    reads_param: dict[int, set[int]] = {s: set() for s in params}
    for u, k in fstage.items():
        for m in units[u].members:
            for vid in nodes[m].inputs:
                st = values[vid].storage
                if st in reads_param:
                    reads_param[st].add(k)
    # buffers (a causal mask): resident on the stage of the first block that reads them
    buffers = [0] * n
    first_reader: dict[int, int] = {}
    buffer_storages = {values[vid].storage for vid in graph.inputs
                       if values[vid].role is Role.BUFFER}
    for u, k in sorted(fstage.items(), key=lambda x: x[1]):
        for m in units[u].members:
            for vid in nodes[m].inputs:
                st = values[vid].storage
                if st in buffer_storages and st not in first_reader:
                    first_reader[st] = k
                    buffers[k] += graph.storages[st].nbytes
    own = [0.0] * n
    shared: list[list[tuple[str, float]]] = [[] for _ in range(n)]
    for st, stages in reads_param.items():
        count = params[st] / (tp if st in tpm.sharded_params else 1)
        if len(stages) == 1:
            own[next(iter(stages))] += count
        elif stages:
            for k in stages:
                shared[k].append((f"storage{st}", float(count)))
    # values: the block each forward value belongs to, and who reads it
    bwd_seconds = [0.0] * n
    bwd_w = [0.0] * n
    bwd_flops = [0.0] * n
    for u, k in bstage.items():
        bwd_seconds[k] += units[u].seconds
        bwd_flops[k] += sum(nodes[m].flops for m in units[u].members)
        if any(side == "O" for v in units[u].values for side, _ in readers[v]):
            bwd_w[k] += units[u].seconds
    # NOTE: sequence parallel: the forward units on parts of the sequence (1/tp of the rows)
    parts = sequence_parts(graph, tpm) if sp else set()
    on_parts = {u for u in fstage if units[u].members[0] in parts}
    a = [0.0] * n            # bytes the next block's forward reads
    held = [0.0] * n         # ... of which each device holds (parts: 1/tp)
    for u, k in fstage.items():
        for v in units[u].values:
            if any(side == "F" and s == k + 1 for side, s in readers[v]):
                a[k] += sg.value_bytes[v]
                held[k] += sg.value_bytes[v] / (tp if u in on_parts else 1)
    blocks = []
    for k in range(n):
        mine = sorted(u for u, s in fstage.items() if s == k)
        # NOTE: ops are named by position in their block, so that blocks of one structure
        # (the repeated layers) have equal ops and share one kind: priced once
        local = {u: f"o{i}" for i, u in enumerate(mine)}
        ops = []
        fwd_all, fwd_sliced = 0.0, 0.0
        for u in mine:
            unit = units[u]
            # NOTE: a unit runs on 1/tp of its data where the op that makes it is sliced
            share = 1.0 / tp if unit.members[0] in tpm.sliced_nodes or u in on_parts else 1.0
            saved, far = 0.0, False
            for v in unit.values:
                rd = readers[v]
                if ("B", k) in rd:
                    saved += sg.value_bytes[v]
                # NOTE: read by another block's backward, by a forward past the next block,
                # or by the optimizer: held from this forward on, never re-made
                if any((side == "B" and s != k) or (side == "F" and s > k + 1) or side == "O"
                       for side, s in rd):
                    far = True
                    if ("B", k) not in rd:
                        saved += sg.value_bytes[v]
            deps = tuple(local[d] for d in unit.deps if fstage.get(d) == k)
            flops = sum(nodes[m].flops for m in unit.members)
            comm = [_tp_comm(m, tpm, sp) for m in unit.members]
            fwd_comm = tuple(c for f, _ in comm for c in f)
            bwd_comm = tuple(c for _, b in comm for c in b)
            fwd_all += unit.seconds
            fwd_sliced += unit.seconds * (1 - share)
            ops.append(Op(local[u], flops=flops * share, bytes=0.0, saved=saved * share,
                          reads=deps or (INPUT,), bwd_flops=0.0, bwd_bytes=0.0,
                          matmul=flops > 0, seconds=unit.seconds * share, bwd_seconds=0.0,
                          bwd_w_seconds=0.0, recomputable=unit.recomputable and not far,
                          fwd_comm=fwd_comm, bwd_comm=bwd_comm))
        # NOTE: the backward of sliced ops is sliced: the block's backward shrinks by the
        # share of its forward time that is sliced (timed whole, it is not split op by op)
        shrink = 1.0 - (fwd_sliced / fwd_all if fwd_all else 0.0)
        ops.append(Op("backward", reads=(INPUT,), bwd_flops=bwd_flops[k] * shrink,
                      matmul=False, seconds=0.0, bwd_seconds=bwd_seconds[k] * shrink,
                      bwd_w_seconds=bwd_w[k] * shrink))
        role = "embedding" if k == 0 else "head" if k == n - 1 else "body"
        ops = tuple(ops)
        largest = max((params[st] / (tp if st in tpm.sharded_params else 1)
                       for st, ks in reads_param.items() if k in ks), default=0.0)
        # NOTE: what makes a block's costs: a block holding a buffer is its own kind
        kind = "graph:" + hashlib.sha1(repr((ops, own[k], a[k - 1] if k else 0.0,
                                             a[k] if k < n - 1 else 0.0, buffers[k],
                                             held[k - 1] if k else 0.0,
                                             largest)).encode()).hexdigest()[:12]
        blocks.append(Block(
            names[k], kind, ops, params=own[k],
            input_bytes=held[k - 1] if k else 0.0, output_bytes=a[k] if k < n - 1 else 0.0,
            role=role, shared=tuple(shared[k]), tp=tp,
            bwd_temp_bytes=float(max(0, chain.bwd_peak[k] - chain.tied_add[k])),
            largest_param=largest,
            buffer_bytes=float(buffers[k]),
            fission=(((f"in {chain.loss_parts} parts", tuple(
                op.name for op in ops if op.saved > 0 and op.recomputable),
                chain.loss_parts),) if k == n - 1 and chain.loss_parts > 1 else ()),
            extra={"units": len(mine)}))
    return blocks
