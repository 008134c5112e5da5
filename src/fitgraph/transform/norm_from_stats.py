"""A training BatchNorm's output re-made for the backward from its saved statistics.

In training, ``native_batch_norm(x, w, b, running_mean, running_var, True, momentum, eps)``
makes ``y`` and the batch's ``mean`` and ``invstd`` (saved for its backward, which reads ``x``,
not ``y``). The activation after it (``z = relu(y)``) is saved for the next convolution's
backward and the activation's own: a CNN keeps two tensors a layer, ``x`` and ``z``. Remat may
drop ``z`` and run the BatchNorm again — in training mode, so it reduces over ``x`` again for
statistics it already has (1.7 ms against 0.34 ms for the normalization alone on a
``16x64x32x32`` float32 tensor on this CPU, one thread). Here the backward reads ``y`` and what
the forward made from it by elementwise ops and views (``z``) as copies re-made, right before
the first backward reader, from ``x`` and the saved statistics: ``native_batch_norm(x, invstd *
w, b, mean, 1 - eps, False, ...)`` — the normalization alone, with the same scale and shift the
training kernel computed (``invstd * w``, ``b - mean * invstd * w``), so ``y`` is re-made bit
for bit where ``kernel_facts().batch_norm_from_stats`` says the device's kernels do so (a probe:
float32 and float64 on the CPU here); elsewhere the rule does not match. The forward's ``z``
then dies in the forward: one tensor a layer (``x``) is kept where two were, for one
normalization pass in the backward.

Every match's copy is made, so the rule trades time for memory at every BatchNorm it matches:
a planner cannot undo it. On ResNet-50 (small) the chains through activations alone (33
BatchNorms) lower the eager plan's peak to 0.84x at 5% more step on the roofline of cpu-generic,
through the residual sums too (45) to 0.78x at 14% more (``python -m
fitgraph.bench.coordinated_search --rules``); measured, the search's plan on the first within
1.10x of eager's step had a 4.6% lower peak than ``auto``'s, the second never won (BENCHMARKS.md,
"The coordinated search against auto"). So the search (``solvers.coordinated``) has both as
rules (``norm_from_stats``, ``norm_from_stats_through_sums``) and keeps what it simulates better.

Matched where: the BatchNorm is in training mode with statistics of the input's dtype; the
backward reads ``y`` or a value made from it by the forward through ops that read nothing else
(``CHAIN``: activations, views, copies; with ``through_sums``, also ``BINARY``: a residual
sum whose other tensor the backward reads anyway); nothing writes ``x``, ``w``, ``b`` or the statistics in
place before the last such reader (an optimizer in the backward); and no chain value is a step
output or written in place by an op outside the chain.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> from fitgraph.transform.norm_from_stats import batch_norm_from_stats, find_norms_from_stats
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
    ...                             torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    >>> batch = torch.randn(4, 3, 12, 12)
    >>> loss = lambda m, b: m(b).square().mean()
    >>> g = fitgraph.capture(model, batch, loss)
    >>> [m.bytes_saved for m in find_norms_from_stats(g)]
    [12800]
    >>> g2 = batch_norm_from_stats(g)
    >>> [n.name for n in g2.nodes if n.name.endswith(".re")][2:]
    ['native_batch_norm.re', 'relu.re', 'detach.re']
    >>> _ = torch.manual_seed(0); a = execute(g, fitgraph.eager_plan(g), model, batch)
    >>> model.zero_grad(set_to_none=True)
    >>> _ = torch.manual_seed(0); b = execute(g2, fitgraph.eager_plan(g2), model, batch)
    >>> torch.equal(a, b)
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..graph.analysis import new_storages, users
from ..graph.ir import Graph, Phase, Role, ValueRef
from ..graph.kernel_facts import kernel_facts
from .fission_meta import VIEW_TARGETS, Meta
from .fission_writer import GraphWriter, OutSpec
from .recompute_copies import COPY_SUFFIX, copy_nodes
from .relayout import copy_relaid, rewrite_nodes

__all__ = ["CHAIN", "NormFromStats", "batch_norm_from_stats", "find_norms_from_stats"]

_BN = "aten.native_batch_norm.default"
_TRAINING, _MOMENTUM, _EPS = 5, 6, 7
# NOTE: ops a chain from the BatchNorm's output may pass through: they read the chain value
# alone (and constants), are cheap and deterministic; the in-place ones write the chain's own
# tensor (torchvision's ReLU(inplace=True))
CHAIN = frozenset({
    "aten.relu.default", "aten.relu_.default", "aten.gelu.default", "aten.silu.default",
    "aten.silu_.default", "aten.sigmoid.default", "aten.tanh.default",
    "aten.hardtanh.default", "aten.hardtanh_.default", "aten.leaky_relu.default",
    "aten.leaky_relu_.default", "aten.elu.default", "aten.elu_.default",
    "aten.hardswish.default", "aten.hardswish_.default", "aten.mish.default",
    "aten.clone.default", "aten.contiguous.default",
}) | VIEW_TARGETS
# NOTE: ops of two tensors a chain passes through where the other one is read by the backward
# anyway (kept for it): a residual block's sum of its BatchNorm's output and its input
BINARY = frozenset({"aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor"})


@dataclass(frozen=True)
class NormFromStats:
    """One training BatchNorm whose output the backward reads re-made: the BatchNorm node, the
    chain nodes copied after it (graph order), the first backward node reading the chain, and
    the bytes of the chain's tensors no longer kept from the forward for the backward."""

    norm: int
    chain: tuple[int, ...]
    first: int
    bytes_saved: int
    # NOTE: the normalization made again costs bytes, not FLOPs (cost.roofline)
    flops_saved: float = 0.0


def find_norms_from_stats(graph: Graph, through_sums: bool = False) -> list[NormFromStats]:
    """Every training BatchNorm whose output (or what the forward makes from it alone) the
    backward reads, re-makeable bit for bit from its saved statistics (module doc);
    ``through_sums``: chains pass ``BINARY`` ops too."""
    readers = users(graph)
    outputs = {graph.values[v].storage for v in graph.outputs.values()}
    writes: dict[int, list[int]] = {}   # storage -> nodes writing it in place
    for n in graph.nodes:
        for v in n.mutates:
            writes.setdefault(graph.values[v].storage, []).append(n.id)
    found = []
    for n in graph.nodes:
        if n.target != _BN or n.phase is not Phase.FORWARD or not _matchable(graph, n):
            continue
        y = n.outputs[0]
        chain, values = _chain(graph, readers, y, through_sums)
        late = {r for v in values for r in readers[v] if graph.nodes[r].phase is not Phase.FORWARD}
        if not late:
            continue
        first, last = min(late), max(late)
        forward = {r for v in values for r in readers[v]} - late
        storages = {graph.values[v].storage for v in values}
        needed = _needed(graph, chain, {v for v in values
                                        if any(r in late for r in readers[v])})
        # NOTE: what the copies read besides the chain must be as it was in the forward
        stable = {graph.values[v.id].storage for v in n.args[:3] if isinstance(v, ValueRef)}
        stable |= {graph.values[o].storage for o in n.outputs[1:]}
        stable |= {graph.values[v].storage for c in needed for v in graph.nodes[c].inputs
                   if v not in values}
        if (max(forward, default=n.id) > first or storages & outputs
                or any(w not in chain for st in storages for w in writes.get(st, ()))
                or any(n.id < w <= last for st in stable for w in writes.get(st, ()))):
            continue
        kept = {graph.values[v].storage for v in values if any(r in late for r in readers[v])}
        found.append(NormFromStats(n.id, needed, first,
                                   sum(graph.storages[st].nbytes for st in kept)))
    return found


def _matchable(graph: Graph, n) -> bool:
    """Training mode, statistics and affine parameters of the input's dtype, a kernel that
    re-makes the output bit for bit on this device."""
    args = n.args
    if len(args) != 8 or args[_TRAINING] is not True or not isinstance(args[0], ValueRef):
        return False
    x = graph.values[args[0].id]
    if any(isinstance(a, ValueRef) and graph.values[a.id].dtype != x.dtype for a in args[1:3]):
        return False
    if any(o is None or graph.values[o].dtype != x.dtype for o in n.outputs):
        return False
    device = graph.storages[x.storage].device
    return kernel_facts().batch_norm_from_stats(device, x.dtype, float(args[_EPS]))


def _chain(graph: Graph, readers: dict[int, list[int]], y: int,
           through_sums: bool) -> tuple[set[int], set[int]]:
    """The forward nodes reachable from ``y`` through ``CHAIN`` ops reading the chain value
    alone and ``BINARY`` ops whose other tensor the backward reads, and the values: ``y`` and
    theirs."""
    nodes, values, todo = set(), {y}, [y]
    while todo:
        v = todo.pop()
        for r in readers[v]:
            node = graph.nodes[r]
            if r in nodes or node.phase is not Phase.FORWARD or node.random:
                continue
            others = set(node.inputs) - {v}
            if not (node.target in CHAIN and not others) and not (
                    through_sums and node.target in BINARY and len(others) == 1 and any(
                        graph.nodes[u].phase is not Phase.FORWARD
                        for u in readers[next(iter(others))])):
                continue
            nodes.add(r)
            for o in node.outputs:
                if o is not None and o not in values:
                    values.add(o)
                    todo.append(o)
    return nodes, values


def _needed(graph: Graph, chain: set[int], wanted: set[int]) -> tuple[int, ...]:
    """The chain nodes making ``wanted`` (and what they read from the chain), in graph order;
    with the in-place writes on their tensors before them."""
    need: set[int] = set()
    todo = [graph.values[v].producer for v in wanted]
    while todo:
        nid = todo.pop()
        if nid not in chain or nid in need:
            continue
        need.add(nid)
        todo += [graph.values[v].producer for v in graph.nodes[nid].inputs]
    return tuple(sorted(need))


def batch_norm_from_stats(graph: Graph, through_sums: bool = False,
                          matches: list[NormFromStats] | None = None) -> Graph:
    """A copy of ``graph`` in which the backward reads each matched BatchNorm's output (and the
    chain made from it) re-made from the saved statistics (module doc; ``through_sums`` as in
    ``find_norms_from_stats``; ``matches``: some of them only); ``graph`` itself where nothing
    matches."""
    if matches is None:
        matches = find_norms_from_stats(graph, through_sums)
    if not matches:
        return graph
    at: dict[int, list[NormFromStats]] = {}
    for m in matches:
        at.setdefault(m.first, []).append(m)
    fresh = new_storages(graph)
    return rewrite_nodes(graph, {k: partial(_remake_then_copy, graph=graph, ms=ms, fresh=fresh)
                                 for k, ms in at.items()}, set())


def _remake_then_copy(w: GraphWriter, *, graph: Graph, ms: list[NormFromStats],
                      fresh: dict[int, list[int]]) -> None:
    """At the first backward reader: each match's output and chain re-made (the backward reads
    them from here on), then the reader itself."""
    for m in ms:
        _remake(w, graph, m, fresh)
    reader = graph.nodes[ms[0].first]
    copy_relaid(w, graph, reader)


def _remake(w: GraphWriter, graph: Graph, m: NormFromStats, fresh: dict[int, list[int]]) -> None:
    """``native_batch_norm(x, invstd * w, b, mean, 1 - eps, False, momentum, eps)`` and the
    chain's copies on its output; ``w.whole`` maps the originals to them."""
    n = graph.nodes[m.norm]
    x, weight, bias = n.args[:3]
    y, mean, invstd = n.outputs
    new_x, new_mean, new_invstd = w.whole[x.id], w.whole[mean], w.whole[invstd]
    stats = w.values[new_mean]
    dev = w.device_of(new_x)
    kw = dict(phase=Phase.BACKWARD, module=n.module, device=dev)
    small = Meta(stats.shape, stats.stride, 0)
    scale = new_invstd
    if isinstance(weight, ValueRef):
        scale = w.add_node(f"{n.name}.scale{COPY_SUFFIX}", "aten.mul.Tensor",
                           (ValueRef(new_invstd), ValueRef(w.whole[weight.id])), {},
                           [OutSpec(f"{n.name}.scale{COPY_SUFFIX}", small, stats.dtype,
                                    role=Role.ACTIVATION)], **kw)[0]
    eps = float(n.args[_EPS])
    # NOTE: the running variance 1 - eps makes the kernel's 1/sqrt(var + eps) exactly 1
    # (kernel_facts().batch_norm_from_stats checked it with this very construction)
    var = w.add_node(f"{n.name}.var{COPY_SUFFIX}", "aten.new_full.default",
                     (ValueRef(new_mean), list(stats.shape), 1.0 - eps), {},
                     [OutSpec(f"{n.name}.var{COPY_SUFFIX}", small, stats.dtype,
                              role=Role.ACTIVATION)], **kw)[0]
    bias_ref = ValueRef(w.whole[bias.id]) if isinstance(bias, ValueRef) else None
    yv = graph.values[y]
    empty = Meta((0,), (1,), 0)
    outs = [OutSpec(f"{yv.name}{COPY_SUFFIX}", Meta(yv.shape, yv.stride, 0), yv.dtype,
                    role=Role.ACTIVATION)]
    outs += [OutSpec(f"{n.name}.{i}{COPY_SUFFIX}", empty, stats.dtype, role=Role.ACTIVATION)
             for i in (1, 2)]
    made = w.add_node(f"{n.name}{COPY_SUFFIX}", _BN,
                      (ValueRef(new_x), ValueRef(scale), bias_ref, ValueRef(new_mean),
                       ValueRef(var), False, n.args[_MOMENTUM], eps), {}, outs,
                      out_is_tuple=True, **kw)
    w.whole[y] = made[0]
    # NOTE: the chain's views and in-place writes of ``y`` live in the re-made output's storage
    copy_nodes(w, graph, list(m.chain), fresh,
               {yv.storage: w.values[made[0]].storage})
