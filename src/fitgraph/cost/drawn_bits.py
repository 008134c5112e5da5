"""Which bool tensors hold random bits, and how dense: so the profiler draws them alike.

The profiler fills synthetic bool inputs with ones (``cost/profiler.py``). For a causal or a
padding mask that is close enough, but a dropout mask kept as bits (``transform.compact_masks``:
``ne(bernoulli_(p) mask, 0)``) is a random pattern, and a ``where`` over random bits runs
branches the CPU cannot predict: on ViT small the re-made masks' ``where`` measured 12.0 ms a
step in place against 4.3 ms profiled over ones. ``bit_densities(graph)`` names each bool
storage computed from a random draw with the chance that an element is True, and the profiler
fills those with Bernoulli bits of that density (keyed apart from the ones-filled
measurement). (On the CPU, ``compact_masks`` draws the bits straight into a bool tensor; the
``ne`` form is the one it makes elsewhere.)

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> b = GraphBuilder(); x = b.add_input("x", (64,), "float32", Role.INPUT)
    >>> m = b.add_node("aten.empty_like.default", [x], [((64,), "float32")])[0]
    >>> d = b.add_node("aten.bernoulli_.float", [m], [((64,), "float32")], args=(None, 0.9),
    ...                mutates=[m], alias_of={0: m}, random=True)[0]
    >>> bits = b.add_node("aten.ne.Scalar", [d], [((64,), "bool")], args=(None, 0))[0]
    >>> g = b.finish({"bits": bits})
    >>> bit_densities(g) == {g.values[bits].storage: 0.9}
    True
"""

from __future__ import annotations

from ..graph.ir import Graph, Node
from ..graph.own_ops import PACK_BITS, UNPACK_BITS

__all__ = ["UNKNOWN_DENSITY", "bit_densities"]

# NOTE: bits drawn some other way: half set is the hardest pattern to predict, the safe price
UNKNOWN_DENSITY = 0.5


def _draw_density(node: Node) -> float:
    """The chance that an element the random ``node`` writes is nonzero."""
    if node.target == "aten.bernoulli_.float":
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        if isinstance(p, (int, float)):
            return float(p)
    return UNKNOWN_DENSITY


def bit_densities(graph: Graph) -> dict[int, float]:
    """bool (or packed-bits) storage id -> the fraction of its elements that are True, for bool tensors a
    random op draws into (at its density) and the bool outputs of nodes that read a storage a
    random op wrote: ``ne(x, 0)`` keeps the draw's density, ``eq(x, 0)`` flips it; any other
    reading gets ``UNKNOWN_DENSITY``; bits packed eight to a byte (``fitgraph::pack_bits``) and
    unpacked again keep the density of the bits they hold."""
    drawn: dict[int, float] = {}
    for n in graph.nodes:
        if n.random:
            for vid in (*n.mutates, *(o for o in n.outputs if o is not None)):
                drawn[graph.values[vid].storage] = _draw_density(n)
    out: dict[int, float] = {}
    for n in graph.nodes:
        if n.random:  # NOTE: bits drawn straight into a bool tensor
            for o in n.outputs:
                if o is not None and graph.values[o].dtype == "bool":
                    out[graph.values[o].storage] = _draw_density(n)
            continue
        if n.target in (PACK_BITS, UNPACK_BITS):  # NOTE: the same bits, packed or unpacked
            known = [out[graph.values[v].storage] for v in n.inputs[:1]
                     if graph.values[v].storage in out]
            if known:
                out[graph.values[n.outputs[0]].storage] = known[0]
            continue
        read = [drawn[graph.values[v].storage] for v in n.inputs
                if graph.values[v].storage in drawn]
        if not read:
            continue
        for o in n.outputs:
            if o is None or graph.values[o].dtype != "bool":
                continue
            zero = len(n.args) > 1 and n.args[1] == 0
            if n.target == "aten.ne.Scalar" and zero and len(read) == 1:
                density = read[0]
            elif n.target == "aten.eq.Scalar" and zero and len(read) == 1:
                density = 1.0 - read[0]
            else:
                density = UNKNOWN_DENSITY
            out[graph.values[o].storage] = density
    return out
