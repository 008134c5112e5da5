"""The one shape of a graph rewrite: a graph in, a graph out, what changed, checked.

A ``Transform`` wraps a rewrite ``graph -> graph`` (which returns the very graph it was given
where it changes nothing) with its name, the guarantee it keeps (``exact``: results bitwise as
before; otherwise allclose, as sums in parts are) and, where it can be impossible, ``why_not``
(None where it applies, else the reason in words). Calling it runs the rewrite, checks the
graph out (``graph.analysis.verify_graph``: one producer per value, storages and aliases
consistent, the outputs there) and says what changed (``Rewritten``: the nodes added and
removed, by name). ``compose`` runs several in order, as the solvers that read a graph
rewritten first do (``solvers.fission.split_backward.prepared``). Every transform the planners
use is in ``transform.registry.TRANSFORMS``; a new one is added there.

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> from fitgraph.transform.rewrite import Transform, compose
    >>> b = GraphBuilder(); x = b.add_input("x", (4,), "float32", Role.INPUT)
    >>> y = b.add_node("aten.relu.default", [x], [((4,), "float32")])[0]
    >>> g = b.finish({"loss": y})
    >>> same = Transform("nothing", lambda graph: graph, exact=True)
    >>> r = compose(g, [same, same])
    >>> r.graph is g, r.changed, r.applied
    (True, False, ('nothing', 'nothing'))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..graph.analysis import verify_graph
from ..graph.ir import Graph

__all__ = ["Rewritten", "Transform", "TransformError", "compose"]


class TransformError(ValueError):
    """A transform asked of a graph it does not apply to (``Transform.why_not`` says why)."""


@dataclass(frozen=True)
class Rewritten:
    """A graph out of one or more transforms, and what they changed."""

    graph: Graph
    applied: tuple[str, ...]   # the transforms run, in order
    added: tuple[str, ...]     # names of the nodes the graph in did not have
    removed: tuple[str, ...]   # names of the graph in's nodes that are gone

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed)


@dataclass(frozen=True)
class Transform:
    """A named rewrite ``graph -> graph`` (see the module doc). ``why_not(graph)``: None where
    the rewrite applies, else why not (a rewrite without one always applies)."""

    name: str
    rewrite: Callable[[Graph], Graph]
    exact: bool
    why_not: Callable[[Graph], str | None] | None = None

    def __call__(self, graph: Graph) -> Rewritten:
        out = self.apply(graph)
        return Rewritten(graph, (self.name,), (), ()) if out is graph else _diff(
            graph, out, (self.name,))

    def apply(self, graph: Graph) -> Graph:
        """The graph out alone, checked (``TransformError`` where the rewrite does not apply)."""
        if self.why_not is not None and (reason := self.why_not(graph)) is not None:
            raise TransformError(f"{self.name} does not apply: {reason}")
        out = self.rewrite(graph)
        if out is not graph:
            verify_graph(out)
        return out


def compose(graph: Graph, transforms: Iterable[Transform]) -> Rewritten:
    """``transforms`` run in order on ``graph``: the last graph out, every transform's name, and
    what changed from ``graph`` to it (one comparison, not one per transform)."""
    out, names = graph, []
    for t in transforms:
        out = t.apply(out)
        names.append(t.name)
    if out is graph:
        return Rewritten(graph, tuple(names), (), ())
    return _diff(graph, out, tuple(names))


def _diff(before: Graph, after: Graph, applied: tuple[str, ...]) -> Rewritten:
    had = {n.name for n in before.nodes}
    has = {n.name for n in after.nodes}
    return Rewritten(after, applied, tuple(n.name for n in after.nodes if n.name not in had),
                     tuple(n.name for n in before.nodes if n.name not in has))
