"""Keep dropout masks as bits: the float mask is re-made from a bool mask where it is read.

A captured dropout builds its mask in place — ``empty_like → bernoulli_(p) → div_(p)`` — a
tensor of the activation's dtype whose entries are 0 or one value ``1/p``, saved for the
backward. Kept as it is, each mask costs as much memory as its activation (the attention
dropout's mask as much as the softmax); re-made by recompute it replays the random draw, which
on a CPU is the dearest op of a transformer's forward. Here each such mask becomes bits: on the
CPU the draw goes straight into a bool tensor (``empty_like(x, dtype=bool) → bernoulli_(p)``:
the same draw, the generator left in the same state, ``draws_alike``), elsewhere the float mask
is read once, right after it is made, into ``bits = mask != 0``. The bits are packed eight to a
byte (``fitgraph::pack_bits``, where the mask's size is a multiple of 8 and
``kernel_facts().packs_alike`` its device; in rows of the last dim where that is a multiple of
8, ``own_ops.packed_shape``, so a part of a split region unpacks its own rows), and every reader
gets ``full``: the mask re-made from the packed bytes in one gather (``fitgraph::unpack_scaled``:
a 256-entry table of each byte's eight elements, 0 or 1 of the mask's dtype put through the
chain's own in-place scalings, ``div_(p)``), so equal to the mask bit for bit. Where the bits do
not pack, ``full`` is the bool bits converted to the mask's dtype and put through the scalings.
``full`` is a cheap, deterministic recompute of the packed bytes, so a planner drops it and
re-makes it just before the backward (and the dropout's output from it) where memory is short —
the bytes kept drop from 4 to 1/8 per element for float32 at the cost of one gather per make
(0.36-0.43 of the time unpacking to bools, converting and scaling took: ``python -m
fitgraph.bench.mask_remake``). (The first version re-made it as ``where(bits, 1/p, 0)``: over random
bits a ``where`` mispredicts its branches, 2.1 ms against 0.82 for the conversion and scaling
on GPT-2's 2M-element attention masks. Packing took BERT small within 1.10x of eager's step
from 0.404x to 0.394x of its peak, simulated on this CPU's costs.)

Whether that pays depends on the budget (``python -m fitgraph.bench.compact_masks_tradeoff``,
small configs, this CPU's measured op costs, one thread, simulated, AdamW): the rewrite's eager
plan is 0.8-2.2% slower (it draws, packs and re-makes the bits), and ``hotspot`` within 1.10x
of eager's step time reaches 0.605x / 0.607x / 0.557x of the eager peak (GPT-2 / BERT / ViT) on
the rewritten graph against 0.680x / 0.690x / 0.653x on the captured one; at a budget of 0.5x it
plans 8-9% faster. Where no remat is needed the captured graph is faster, so ``auto`` plans
both graphs and keeps the better.
Remat moves never absorb the bits nor their packed bytes (``solvers.remat.candidates.forward_chains``):
re-made, a mask needs only its packed bits.

Only clean chains are rewritten: a fresh storage made by ``empty_like``/``empty``, written in
place by ``bernoulli_`` then any ``div_``/``mul_`` by a constant, contiguous, and read after
the chain only through its final value. Others are left as they are.

CUDA runs dropout as one fused kernel, ``native_dropout(x, p, train) -> (output, mask)``, whose
mask is already bool (a byte an element) and read by ``native_dropout_backward``. There the
mask is only packed: ``fitgraph::pack_bits`` right after the kernel, ``unpack_bits`` for its
readers (a cheap deterministic recompute of the packed bytes, as above), where the mask is
contiguous, its size a multiple of 8 and ``kernel_facts().packs_alike`` its device: 1/8 of the bytes kept.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> from fitgraph.transform.compact_masks import compact_masks, dropout_masks
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.1),
    ...                             torch.nn.Linear(32, 2))
    >>> batch = torch.randn(4, 8)
    >>> g = fitgraph.capture(model, batch, lambda m, b: m(b).square().mean())
    >>> len(dropout_masks(g)), len(dropout_masks(compact_masks(g)))
    (1, 0)
    >>> [n.target.split(".")[1] for n in compact_masks(g).nodes if ".mask." in n.name]
    ['empty_like', 'bernoulli_', 'pack_bits', 'unpack_scaled']
    >>> _ = torch.manual_seed(0); a = execute(g, fitgraph.eager_plan(g), model, batch)
    >>> model.zero_grad(set_to_none=True)
    >>> c = compact_masks(g)
    >>> _ = torch.manual_seed(0); b = execute(c, fitgraph.eager_plan(c), model, batch)
    >>> torch.equal(a, b)
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real

from ..graph.analysis import verify_graph
from ..graph.ir import Graph, Node, Role, ValueRef, contiguous_strides
from ..graph.kernel_facts import kernel_facts
from ..graph.own_ops import MASK_SCALINGS, PACK_BITS, UNPACK_BITS, UNPACK_SCALED, packed_shape
from ..graph.recompute_rules import inplace_chains
from .fission_meta import Meta
from .fission_writer import GraphWriter, OutSpec

__all__ = ["DropoutMask", "compact_masks", "draws_alike", "dropout_masks"]

_CREATORS = frozenset({"aten.empty_like.default", "aten.empty.memory_format"})
_DRAWS = frozenset({"aten.bernoulli_.float", "aten.bernoulli_.Tensor"})
_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
_FUSED = "aten.native_dropout.default"


@dataclass(frozen=True)
class DropoutMask:
    """A dropout mask built in place: its chain of nodes and the value readers read."""

    chain: tuple[int, ...]     # creator, bernoulli_, scalings (node ids); or the fused
    #                            ``native_dropout`` alone
    value: int                 # the final value (the last writer's output; the fused mask)

    @property
    def fused(self) -> bool:
        return len(self.chain) == 1


def dropout_masks(graph: Graph) -> list[DropoutMask]:
    """The dropout masks of ``graph`` that ``compact_masks`` rewrites, in graph order."""
    out = []
    readers: dict[int, set[int]] = {}
    reader_names: dict[int, set[str]] = {}
    for n in graph.nodes:
        for v in n.inputs:
            readers.setdefault(graph.values[v].storage, set()).add(v)
            reader_names.setdefault(v, set()).add(n.name)
    for st, chain in sorted(inplace_chains(graph).items(), key=lambda kv: kv[1][0]):
        creator, draw, *scalings = (graph.nodes[i] for i in chain)
        if (creator.target not in _CREATORS or draw.target not in _DRAWS
                or any(s.target not in MASK_SCALINGS or not _constant(s) for s in scalings)):
            continue
        last = graph.nodes[chain[-1]]
        if not last.outputs or last.outputs[0] is None:
            continue
        value = graph.values[last.outputs[0]]
        if (value.dtype not in _FLOATS or value.storage != st or value.storage_offset
                or value.stride != contiguous_strides(value.shape)
                or graph.storages[st].nbytes != value.nbytes):
            continue
        chain_values = {o for i in chain for o in graph.nodes[i].outputs if o is not None}
        chain_values |= {v for i in chain for v in graph.nodes[i].inputs
                         if graph.values[v].storage == st}
        read_after = {v for v in readers.get(st, ()) if v not in chain_values or v == value.id}
        if read_after != {value.id}:
            continue  # NOTE: read through a view or an earlier version: not rewritten
        if all(r.startswith(f"{last.name}.mask.") for r in reader_names[value.id]):
            continue  # NOTE: kept as bits already
        out.append(DropoutMask(tuple(chain), value.id))
    out += _fused_masks(graph, readers, reader_names)
    return sorted(out, key=lambda m: m.chain[0])


def _fused_masks(graph: Graph, readers: dict[int, set[int]],
                 reader_names: dict[int, set[str]]) -> list[DropoutMask]:
    """The bool masks of fused ``native_dropout`` nodes that packing shrinks."""
    out = []
    for n in graph.nodes:
        if n.target != _FUSED or len(n.outputs) != 2 or n.outputs[1] is None:
            continue
        m = graph.values[n.outputs[1]]
        if (m.dtype != "bool" or m.storage_offset or m.numel % 8
                or m.stride != contiguous_strides(m.shape)
                or graph.storages[m.storage].nbytes != m.nbytes
                or readers.get(m.storage, set()) - {m.id}
                or not kernel_facts().packs_alike(graph.storages[m.storage].device)):
            continue  # NOTE: read through a view, or not packable: left as it is
        if m.id in reader_names and all(r.startswith(f"{n.name}.mask.")
                                        for r in reader_names[m.id]):
            continue  # NOTE: packed already
        out.append(DropoutMask((n.id,), m.id))
    return out


def _constant(node: Node) -> bool:
    return len(node.args) == 2 and isinstance(node.args[1], Real) and not node.kwargs


def compact_masks(graph: Graph, masks: list[DropoutMask] | None = None) -> Graph:
    """A copy of ``graph`` whose dropout masks (``dropout_masks``, or those given) are kept as
    bits (see the module doc); ``graph`` itself when there are none."""
    masks = dropout_masks(graph) if masks is None else masks
    if not masks:
        return graph
    fused = {m.chain[0]: m for m in masks if m.fused}
    chained = [m for m in masks if not m.fused]
    direct = {m.chain[1]: m for m in chained if draws_alike(graph.storages[
        graph.values[m.value].storage].device)}
    dropped = {i for m in direct.values() for i in m.chain}
    at_end = {m.chain[-1]: m for m in chained if m.chain[1] not in direct}
    w = GraphWriter(graph)
    for n in graph.nodes:
        if n.id in direct:
            _drawn_bits(w, graph, direct[n.id])
        if n.id in dropped:
            continue
        w.copy_node(n)
        if n.id in at_end:
            _bits(w, graph, at_end[n.id])
        if n.id in fused:
            name, kw = _names(graph, fused[n.id], n)
            m = fused[n.id].value
            w.whole[m] = _packed(w, graph, fused[n.id], w.whole[m], name, kw)
    out = w.finish(dict(graph.meta))
    verify_graph(out)
    return out


_ALIKE: dict[str, bool] = {}
_PROBE = 4099  # NOTE: odd, so a vectorised body and its scalar tail are both drawn


def draws_alike(device: str) -> bool:
    """Whether ``bernoulli_`` on ``device`` draws the same bits, leaving the generator in the
    same state, into a bool tensor as into a float one — so a mask's bits can be drawn
    directly, bit for bit what eager draws. The CPU's kernels draw in double precision (or MKL
    integers) whatever the dtype; a probe on a private generator confirms it. Other devices:
    False (not relied on)."""
    if device not in _ALIKE:
        import torch  # NOTE: local: planning modules import without torch (test_boundary)

        ok = device == "cpu"
        if ok:
            a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
            x = torch.empty(_PROBE).bernoulli_(0.9, generator=a)
            y = torch.empty(_PROBE, dtype=torch.bool).bernoulli_(0.9, generator=b)
            ok = torch.equal(x != 0, y) and torch.equal(a.get_state(), b.get_state())
        _ALIKE[device] = ok
    return _ALIKE[device]


def _names(graph: Graph, mask: DropoutMask, at: Node) -> tuple[str, dict]:
    """The re-made mask's node-name prefix and the phase/module/device its nodes take (those
    of ``at``, the chain node they stand beside)."""
    v = graph.values[mask.value]
    return (f"{graph.nodes[mask.chain[-1]].name}.mask",
            dict(phase=at.phase, module=at.module, device=graph.storages[v.storage].device))


def _drawn_bits(w: GraphWriter, graph: Graph, mask: DropoutMask) -> None:
    """In place of the chain, at its draw: the bits drawn straight into a bool tensor (the
    same draw, ``draws_alike``), and the mask re-made from them; readers get the re-made one."""
    import torch

    creator, draw = graph.nodes[mask.chain[0]], graph.nodes[mask.chain[1]]
    v = graph.values[mask.value]
    name, kw = _names(graph, mask, draw)
    dense = Meta(v.shape, v.stride, 0)
    role = Role.ACTIVATION
    args, kwargs = w.remapped(creator.args, creator.kwargs)
    blank = w.add_node(f"{name}.blank", creator.target, args, dict(kwargs, dtype=torch.bool),
                       [OutSpec(f"{name}.blank", dense, "bool", role=role)], **kw)[0]
    st = w.values[blank].storage
    bits = w.add_node(f"{name}.bits", draw.target, (ValueRef(blank), *draw.args[1:]),
                      dict(draw.kwargs), [OutSpec(f"{name}.bits", dense, "bool", storage=st,
                                                  role=role)],
                      mutates=(blank,), random=True, **kw)[0]
    w.whole[mask.value] = _remade(w, graph, mask, bits, name, kw)


def _remade(w: GraphWriter, graph: Graph, mask: DropoutMask, bits: int, name: str,
            kw: dict) -> int:
    """The mask from its bits: converted to the mask's dtype (0 or 1, as the draw left them)
    and put through the chain's own in-place scalings, so equal to it bit for bit — from the
    bits packed eight to a byte in one gather (``fitgraph::unpack_scaled``) where they pack
    (``_pack``), else from the bool bits by a conversion and the scalings."""
    import torch

    v = graph.values[mask.value]
    dense = Meta(v.shape, v.stride, 0)
    packed = _pack(w, graph, mask, bits, name, kw)
    if packed is not None:
        scalings = [graph.nodes[i] for i in mask.chain[2:]]
        return w.add_node(f"{name}.full", UNPACK_SCALED,
                          (ValueRef(packed), list(v.shape), getattr(torch, v.dtype),
                           ",".join(s.target for s in scalings),
                           [float(s.args[1]) for s in scalings]), {},
                          [OutSpec(f"{name}.full", dense, v.dtype, role=Role.ACTIVATION)],
                          **kw)[0]
    # NOTE: a conversion reads the bits without a branch: where(bits, scale, 0) measured
    # 2.1 ms against 0.82 on GPT-2's 2M-element attention masks (random bits defeat its
    # branches)
    full = w.add_node(f"{name}.full", "aten._to_copy.default", (ValueRef(bits),),
                      {"dtype": getattr(torch, v.dtype)},
                      [OutSpec(f"{name}.full", dense, v.dtype, role=Role.ACTIVATION)], **kw)[0]
    for j, i in enumerate(mask.chain[2:]):
        s, tag = graph.nodes[i], f"{name}.scale" + (f"{j}" if j else "")
        st = w.values[full].storage
        full = w.add_node(tag, s.target, (ValueRef(full), s.args[1]), {},
                          [OutSpec(tag, dense, v.dtype, storage=st, role=Role.ACTIVATION)],
                          mutates=(full,), **kw)[0]
    return full


def _bits(w: GraphWriter, graph: Graph, mask: DropoutMask) -> None:
    """After the chain's last writer: the bits and the re-made mask (the bits as the mask's
    dtype, put through the chain's own in-place scalings); readers of the mask are remapped to
    the re-made one."""
    v = graph.values[mask.value]
    name, kw = _names(graph, mask, graph.nodes[mask.chain[-1]])
    made = ValueRef(w.whole[mask.value])
    bits = w.add_node(f"{name}.bits", "aten.ne.Scalar", (made, 0), {},
                      [OutSpec(f"{name}.bits", Meta(v.shape, v.stride, 0), "bool",
                               role=Role.ACTIVATION)], **kw)[0]
    w.whole[mask.value] = _remade(w, graph, mask, bits, name, kw)


def _packed(w: GraphWriter, graph: Graph, mask: DropoutMask, bits: int, name: str,
            kw: dict) -> int:
    """A fused dropout's bool mask packed eight to a byte and unpacked again (the value its
    readers read), where it packs (``_pack``); else ``bits`` itself. The packed bytes are what
    a plan keeps: the unpacked bits are a cheap deterministic recompute (0.12 ms for 1.2M
    elements on this CPU)."""
    v = graph.values[mask.value]
    packed = _pack(w, graph, mask, bits, name, kw)
    if packed is None:
        return bits
    return w.add_node(f"{name}.unpacked", UNPACK_BITS, (ValueRef(packed), list(v.shape)), {},
                      [OutSpec(f"{name}.unpacked", Meta(v.shape, v.stride, 0), "bool",
                               role=Role.ACTIVATION)], **kw)[0]


def _pack(w: GraphWriter, graph: Graph, mask: DropoutMask, bits: int, name: str,
          kw: dict) -> int | None:
    """``bits`` packed eight to a byte (in rows where it can: ``packed_shape``), where the
    mask's size is a multiple of 8 and ``kernel_facts().packs_alike`` its device; else None."""
    v = graph.values[mask.value]
    if v.numel % 8 or not kernel_facts().packs_alike(kw["device"]):
        return None
    rows = packed_shape(v.shape)
    return w.add_node(f"{name}.packed", PACK_BITS, (ValueRef(bits),), {},
                      [OutSpec(f"{name}.packed", Meta(rows, contiguous_strides(rows), 0),
                               "uint8", role=Role.ACTIVATION)], **kw)[0]
