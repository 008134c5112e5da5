"""Dimension analysis for operator fission: along which dims each node can run in parts.

For a node and a dim of one of its tensors, ``split_dims`` says which dim of every other input
and output corresponds (``Along``), which are needed whole by every part (``None``: weights,
masks), and which outputs are partial results to combine (``Reduced``). The rules live in
``dim_rules*.py``; an op without a rule is a region boundary — ``node_splits`` raises for it
rather than guess (law 5); a rule that fails on a node's arguments makes that node a boundary
whose reason says so (``splits_or_reason``), never an exception out of the planner. Regions grown from these rules: ``fitgraph.graph.dim_region``.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.graph.dims import split_dims
    >>> b = GraphBuilder()
    >>> x = b.add_input("x", (8, 4), "float32", Role.INPUT)
    >>> w = b.add_input("w", (4, 6), "float32", Role.PARAMETER)
    >>> y = b.add_node("aten.mm.default", [x, w], [((8, 6), "float32")])[0]
    >>> g = b.finish({"loss": y})
    >>> split_dims(g, 0, x, 0)          # rows of x -> rows of y; w is read whole
    {0: Along(0), 1: None, 2: Along(0)}
    >>> split_dims(g, 0, x, 1)[y]       # the contracted dim: partial sums
    Reduced('sum')
"""

from __future__ import annotations

import logging
from typing import Any

from .analysis import flatten_refs
from .dim_rules import BOUNDARY, BOUNDARY_PREFIXES, RANDOM_CHECKED, RULES
from .dim_types import Along, Entry, Reduced, SizeArg, Split, Window
from .ir import Graph, Node

log = logging.getLogger(__name__)

__all__ = ["Along", "DimRuleMissing", "Reduced", "SizeArg", "Split", "Window", "boundary_reason",
           "has_rule", "node_shapes", "node_splits", "operands", "part_args", "split_dims", "splits_or_reason",
           "value_entries"]


class DimRuleMissing(KeyError):
    """A node whose op has no dimension rule: fission cannot reason about it."""


def operands(node: Node) -> list[int]:
    """Value ids of the node's tensor arguments in argument order (args, then kwargs), repeats
    kept: the order of ``Split.operands``."""
    return flatten_refs((node.args, node.kwargs))


def has_rule(target: str) -> bool:
    return target in RULES


def boundary_reason(graph: Graph, node: Node) -> str | None:
    """Why ``node`` can never be in a fission region (None: it has a rule and may be)."""
    t = node.target
    if t in BOUNDARY:
        return BOUNDARY[t]
    for prefix, why in BOUNDARY_PREFIXES.items():
        if t.startswith(prefix):
            return why
    if t not in RULES:
        return (f"no dimension rule for {t}: add one to fitgraph/graph/dim_rules*.py (with an "
                "empirical check in tests/test_dims.py) or list it in dim_rules.BOUNDARY")
    if node.random and t not in RANDOM_CHECKED:
        return "random: a part would draw other numbers than the whole op (law 1)"
    return None


def node_splits(graph: Graph, node: Node) -> list[Split]:
    """Every way ``node`` can run in parts ([] for a boundary op, or where its rule fails);
    raises ``DimRuleMissing`` naming the node when its op has no rule and is not a listed
    boundary."""
    got = splits_or_reason(graph, node)
    if isinstance(got, str):
        if node.target not in RULES and node.target not in BOUNDARY and not any(
                node.target.startswith(p) for p in BOUNDARY_PREFIXES):
            raise DimRuleMissing(f"node {node.name} ({node.target}): {got}")
        return []
    return got


def splits_or_reason(graph: Graph, node: Node) -> list[Split] | str:
    """``node``'s splits, or why it can have none: ``boundary_reason``, else its rule's own
    failure. A rule that raises on arguments it does not understand makes the node a
    boundary whose reason names the op and the error (logged once per op and error), never
    an exception out of the planner."""
    why = boundary_reason(graph, node)
    if why is not None:
        return why
    ins, outs = node_shapes(graph, node)
    try:
        return RULES[node.target](node, ins, outs)
    except Exception as e:  # NOTE: any rule bug or unforeseen argument form: no split, said
        why = (f"the dimension rule for {node.target} failed on node {node.name} "
               f"({type(e).__name__}: {e}): no split (report this op and its arguments)")
        _warn_once(node.target, type(e).__name__, why)
        return why


def node_shapes(graph: Graph, node: Node) -> tuple[list[tuple[int, ...]], list]:
    """(operand shapes, output shapes; None for an output not made) as rules read them."""
    return ([graph.values[v].shape for v in operands(node)],
            [graph.values[v].shape if v is not None else None for v in node.outputs])


_WARNED: set[tuple[str, str]] = set()


def _warn_once(target: str, error: str, why: str) -> None:
    if (target, error) not in _WARNED:
        _WARNED.add((target, error))
        log.warning("%s", why)


def value_entries(node: Node, split: Split, ops: list[int] | None = None) -> dict[int, Entry] | None:
    """value id -> entry of one split of ``node``; None when a value repeated among the
    operands would need two different entries (``mul(x, x.t())``-like). ``ops``: the node's
    ``operands`` if already known."""
    table: dict[int, Entry] = {}
    for vid, e in zip(operands(node) if ops is None else ops, split.operands):
        if vid in table and table[vid] != e:
            return None
        table[vid] = e
    for vid, e in zip(node.outputs, split.outputs):
        if vid is not None:
            table[vid] = e
    return table


def split_dims(graph: Graph, node_id: int, value_id: int, dim: int) -> dict[int, Entry] | None:
    """For ``node_id`` split along ``dim`` of ``value_id`` (one of its inputs or outputs): value
    id -> Along / None (whole) / Reduced for every tensor it touches; None if it cannot."""
    node = graph.nodes[node_id]
    nd = len(graph.values[value_id].shape)
    dim = dim + nd if dim < 0 else dim
    for split in node_splits(graph, node):
        table = value_entries(node, split)
        if table is None:
            continue
        e = table.get(value_id)
        if isinstance(e, Along) and e.dim == dim:
            return table
    return None


def part_args(node: Node, split: Split, in_shapes: list[tuple[int, ...]],
              out_shapes: list[tuple[int, ...] | None]) -> tuple[tuple, dict]:
    """The args and kwargs one part runs with: split sizes rewritten (``SizeArg``) from the
    part's shapes, the padding of a windowed dim zeroed (the part pads explicitly)."""
    args: Any = list(node.args)
    kwargs = dict(node.kwargs)
    root = {"args": args, "kwargs": kwargs}
    for s in split.sizes:
        shapes = in_shapes if s.tensor[0] == "in" else out_shapes
        _set(root, s.path, shapes[s.tensor[1]][s.dim] // s.per)
    for e in split.operands:
        if isinstance(e, Along) and e.window is not None and e.window.pad_path:
            _set(root, e.window.pad_path, 0)
    return tuple(root["args"]), root["kwargs"]


def _set(root: dict, path: tuple, value: Any) -> None:
    """Set ``path`` (into args, or kwargs when it starts with a name), copying lists on the way."""
    container = root["kwargs"] if isinstance(path[0], str) else root["args"]
    *head, last = path
    for key in head:
        child = container[key]
        child = list(child)  # NOTE: never write into the node's own (shared) lists
        container[key] = child
        container = child
    container[last] = value
