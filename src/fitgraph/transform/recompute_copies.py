"""Re-make forward tensors in the backward as graph nodes, so the backward can run them in parts.

Remat (``plan.remat``) re-makes a dropped tensor whole, right before the backward reads it. For
attention that is four ``[batch, heads, T, T]`` tensors at once in the backward (the scores'
softmax, the dropout mask, the gradient of the probabilities and its product with the mask):
one block's recomputed attention then sets the peak of a step that is otherwise small. Fission
cannot split the forward and the backward of one block together (every later block and the
loss lie between them: no such region is convex). Here the forward nodes ``nodes`` are copied
into the backward, right before its first reader of what they make, and every backward reader
reads the copies; the originals' outputs are then read by the forward alone. The copies and the
backward ops that read them are one convex region of the backward, which ``split_region`` runs
in parts (heads, rows): the attention's backward then holds one part's tensors at a time.

The copies compute the same ops on the same inputs, so results are bitwise those of the graph
(the executor runs them as it runs any node). Only deterministic nodes are copied (a random
draw re-run draws again: compact the dropout masks to bits first, ``compact_masks``, and the
mask is re-made from its packed bits). A copy's in-place write lands in the copy of the tensor
it writes, which the copies made; a node that writes a tensor made elsewhere is not copied.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role, Phase
    >>> from fitgraph.transform.recompute_copies import recompute_copies
    >>> b = GraphBuilder(); x = b.add_input("x", (4, 8), "float32", Role.PARAMETER)
    >>> e = b.add_node("aten.exp.default", [x], [((4, 8), "float32")])[0]
    >>> s = b.add_node("aten.sum.default", [e], [((), "float32")])[0]
    >>> gx = b.add_node("aten.mul.Tensor", [s, e], [((4, 8), "float32")],
    ...                 phase=Phase.BACKWARD)[0]
    >>> g = recompute_copies(b.finish({"loss": s, "grad:x": gx}), [0])
    >>> [(n.name, n.phase.value) for n in g.nodes]
    [('exp_0', 'forward'), ('sum_1', 'forward'), ('exp_0.re', 'backward'), ('mul_2', 'backward')]
"""

from __future__ import annotations

from collections.abc import Iterable

from ..graph.analysis import new_storages, users, verify_graph
from ..graph.ir import Graph, Node, Phase, Role
from .fission_meta import Meta
from .fission_writer import GraphWriter, OutSpec

__all__ = ["COPY_SUFFIX", "CopyError", "copy_nodes", "copy_set", "copyable", "first_reader",
           "recompute_copies"]

COPY_SUFFIX = ".re"


class CopyError(ValueError):
    """The nodes cannot be copied into the backward (the message says which and why)."""


def copyable(graph: Graph, nid: int, inside: set[int], fresh: dict[int, list[int]] | None = None
             ) -> str:
    """Why node ``nid`` cannot be copied into the backward with the nodes ``inside`` ("" if it
    can): a random draw, a forward-only node, a graph output, or an in-place write to a tensor
    the copies do not make."""
    n = graph.nodes[nid]
    fresh = new_storages(graph) if fresh is None else fresh
    if n.phase is not Phase.FORWARD:
        return f"{n.name} runs in the {n.phase.value}, not the forward"
    if n.random:
        return f"{n.name} draws random numbers (compact dropout masks to bits first)"
    if n.name in graph.meta.get("pinned", ()):
        return f"{n.name} is pinned (never run again: graph.meta['pinned'])"
    outputs = set(graph.outputs.values())
    if any(o in outputs for o in n.outputs if o is not None):
        return f"{n.name} makes a step output"
    made = {st for m in inside for st in fresh.get(m, ())}
    for v in n.mutates:
        if graph.values[v].storage not in made:
            return f"{n.name} writes {graph.values[v].name} in place, which the copies do not make"
    return ""


# NOTE: a producer whose tensor is this many times the bytes it reads is copied with its readers
# (a dropout mask re-made from packed bits: 8x to bool, 4x more to float32), so the copies read
# the small tensor and the large one exists only in parts
EXPANDS = 2


def copy_set(graph: Graph, nodes: Iterable[int]) -> set[int]:
    """The copyable ones of ``nodes`` (``copyable``), plus the forward producers of their
    inputs whose tensor is ``EXPANDS`` times the bytes they read, with the in-place writes
    that finish it (a mask's scaling), transitively: what ``recompute_copies`` should copy so
    that the backward re-makes large tensors from small ones."""
    fresh = new_storages(graph)
    maker = {st: nid for nid, sts in fresh.items() for st in sts}
    writers: dict[int, list[int]] = {}
    for n in graph.nodes:
        for v in n.mutates:
            writers.setdefault(graph.values[v].storage, []).append(n.id)
    fwd_readers: dict[int, set[int]] = {}   # storage -> forward nodes that read it
    for n in graph.nodes:
        if n.phase is Phase.FORWARD:
            for v in n.inputs:
                fwd_readers.setdefault(graph.values[v].storage, set()).add(n.id)
    inside: set[int] = set()
    for nid in sorted(set(nodes)):
        if not copyable(graph, nid, inside | {nid}, fresh):
            inside.add(nid)
    todo = sorted(inside)
    while todo:
        for x in graph.nodes[todo.pop()].inputs:
            v = graph.values[x]
            mk = maker.get(v.storage)
            if v.producer is None or v.producer in inside or mk is None:
                continue
            chain = {mk, *(w for w in writers.get(v.storage, ()) if w <= v.producer)}
            read = sum(graph.values[i].nbytes for i in graph.nodes[mk].inputs)
            # NOTE: only a tensor the copies alone read in the forward: one every block reads
            # (an attention mask made once) would be copied with each block's region, and the
            # backward of every block would read the first block's copies
            if (graph.storages[v.storage].nbytes > EXPANDS * read
                    and fwd_readers.get(v.storage, set()) <= inside | chain
                    and not any(copyable(graph, c, inside | chain, fresh) for c in chain)):
                new = chain - inside
                inside |= new
                todo.extend(sorted(new))
    return inside


def recompute_copies(graph: Graph, nodes: Iterable[int],
                     readers: Iterable[int] | None = None) -> Graph:
    """A copy of ``graph`` in which the backward reads copies of ``nodes``' outputs, made right
    before its first reader (see the module doc); ``readers``: only those backward nodes read
    the copies, the others what they read before. Raises CopyError where a node cannot be
    copied (``copyable``) or no backward node reads what they make."""
    inside = set(nodes)
    only = None if readers is None else set(readers)
    fresh = new_storages(graph)
    for nid in sorted(inside):
        why = copyable(graph, nid, inside, fresh)
        if why:
            raise CopyError(why)
    _check_writers_copied(graph, inside, fresh)
    first = first_reader(graph, inside, only)
    if first is None:
        raise CopyError("no backward node reads what the nodes make: nothing to re-make")
    if max(inside) > first:
        raise CopyError(f"{graph.nodes[first].name} reads what the nodes make before "
                        f"{graph.nodes[max(inside)].name} runs: no place to re-make them")
    w = GraphWriter(graph)
    copied: dict[int, int] = {}   # NOTE: old value -> its copy, once made
    for n in graph.nodes:
        if n.id == first:
            before = dict(w.whole)
            copied = copy_nodes(w, graph, sorted(inside), fresh)
        if only is None or n.id in only or not any(v in copied for v in n.inputs):
            w.copy_node(n)
            continue
        # NOTE: not one of ``readers``: it reads the tensors it read before
        for v in n.inputs:
            if v in copied:
                w.whole[v] = before[v]
        w.copy_node(n)
        w.whole.update(copied)
    out = w.finish(dict(graph.meta))
    verify_graph(out)
    return out


def _check_writers_copied(graph: Graph, inside: set[int], fresh: dict[int, list[int]]) -> None:
    """Raise CopyError where a tensor the copies make is read after a node not copied wrote it
    in place: the copy would be read without that write.

    NOTE: a forward tensor made in parts is a ``new_empty_strided`` buffer that ``copy_`` nodes
    fill, and its readers read the buffer's own value after them. Re-made alone (HuBERT, a
    region re-made along the time over one an earlier split re-made along the batch), the
    backward read an unwritten buffer and the first layer's weight gradient was wrong. A
    tensor read only up to the write (a dropout mask's blank, which the unpacking writes and
    returns) is copied as before: its readers read what the write returns."""
    made = {st for nid in inside for st in fresh.get(nid, ())}
    first_write: dict[int, Node] = {}
    for n in graph.nodes:
        if n.id not in inside:
            for v in n.mutates:
                if graph.values[v].storage in made:
                    first_write.setdefault(graph.values[v].storage, n)
    readers = users(graph)
    for nid in sorted(inside):
        for v in graph.nodes[nid].outputs:
            w = first_write.get(graph.values[v].storage) if v is not None else None
            late = [r for r in readers[v] if r > w.id] if w is not None else []
            if late:
                raise CopyError(f"{graph.nodes[late[0]].name} reads {graph.values[v].name} "
                                f"after {w.name} writes it in place, and "
                                f"{graph.nodes[nid].name} would be copied without that write")


def first_reader(graph: Graph, nodes: Iterable[int],
                 readers: set[int] | None = None) -> int | None:
    """The first node outside the forward (of ``readers``, where given) that reads what
    ``nodes`` make (None: none does): ``recompute_copies`` puts the copies right before it,
    so the nodes before it keep their ids in the graph it returns."""
    made = {o for nid in nodes for o in graph.nodes[nid].outputs if o is not None}
    return next((n.id for n in graph.nodes if n.phase is not Phase.FORWARD
                 and (readers is None or n.id in readers)
                 and any(v in made for v in n.inputs)), None)


def copy_nodes(w: GraphWriter, graph: Graph, nodes: list[int], fresh: dict[int, list[int]],
               storage: dict[int, int] | None = None) -> dict[int, int]:
    """The nodes again, in graph order, as backward nodes; from here on every node reads the
    copies (``w.whole`` maps the originals' outputs to them). ``storage``: old storage -> the
    new one that a copy made before stands for (a view or an in-place write of it lives there).
    Returns old value -> copy."""
    remap: dict[int, int] = {}        # old value -> its copy
    storage = dict(storage or {})     # old storage the copies make -> new storage
    for nid in nodes:
        n: Node = graph.nodes[nid]
        for st in fresh.get(nid, ()):
            s = graph.storages[st]
            storage[st] = w.new_storage(s.nbytes, s.device, Role.ACTIVATION, s.name + COPY_SUFFIX)
        whole = dict(w.whole)
        whole.update(remap)
        saved, w.whole = w.whole, whole
        args, kwargs = w.remapped(n.args, n.kwargs)
        w.whole = saved
        outs: list[OutSpec | None] = []
        for o in n.outputs:
            if o is None:
                outs.append(None)
                continue
            v = graph.values[o]
            st = storage.get(v.storage, w.mapped_storage(v.storage))
            outs.append(OutSpec(v.name + COPY_SUFFIX, Meta(v.shape, v.stride, v.storage_offset),
                                v.dtype, storage=st, role=Role.ACTIVATION))
        mutates = tuple(whole[v] for v in n.mutates)
        new = w.add_node(n.name + COPY_SUFFIX, n.target, args, kwargs, outs, phase=Phase.BACKWARD,
                         module=n.module, device=_device(graph, n), mutates=mutates,
                         flops=n.flops, out_is_tuple=n.out_is_tuple)
        for o, c in zip(n.outputs, new):
            if o is not None:
                remap[o] = c
    w.whole.update(remap)
    return remap


def _device(graph: Graph, n: Node) -> str:
    vids = [o for o in n.outputs if o is not None] or list(n.inputs)
    return graph.storages[graph.values[vids[0]].storage].device if vids else "cpu"
