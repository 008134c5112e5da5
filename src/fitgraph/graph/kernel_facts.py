"""What the planner asks of the device's kernels, answered by the runtime that has them.

Two rewrites depend on how torch's kernels behave, which the torch-free planner cannot ask
itself (DESIGN: graph/, transform/, solvers/ never import torch):

* ``packs_alike(device)``: whether fitgraph's bit packing (``fitgraph::pack_bits``) is exact on
  ``device`` (``transform.compact_masks`` packs a fused dropout's bool mask eight to a byte);
* ``strides_kept(graph, node, vid, stride)``: whether ``node``, run with value ``vid`` strided
  as ``stride``, makes the strides the graph records (``transform.elementwise_expands`` runs an
  op before an expand only where its readers' layouts hold);
* ``batch_norm_from_stats(device, dtype, eps)``: whether a training BatchNorm's output is made
  again bit for bit by the eval-mode kernel from the saved statistics
  (``transform.norm_from_stats``);
* ``optimizer_chunks_alike(device, dtype, kind, fused)``: whether torch's update of ``kind``
  ("adam", "sgd"; its fused kernel or not), run on row slices of a parameter one after another,
  makes the whole update's bits (``transform.optimizer_chunks``).

``fitgraph.execute`` registers torch's answers when it loads (every ``import fitgraph`` does).
In a process without torch the answer is the conservative one — no, for each: masks stay bool,
ops stay after their expands, BatchNorm outputs are not re-made, updates are not chunked; plans
are valid, only those rewrites are not made.

Example:
    >>> from fitgraph.graph.kernel_facts import Conservative, kernel_facts, use_kernel_facts
    >>> class Packs(Conservative):
    ...     def packs_alike(self, device): return device == "cpu"
    >>> before = use_kernel_facts(Packs())
    >>> kernel_facts().packs_alike("cpu"), kernel_facts().strides_kept(None, None, 0, ())
    (True, False)
    >>> kernel_facts().batch_norm_from_stats("cpu", "float32", 1e-5)
    False
    >>> _ = use_kernel_facts(before)
"""

from __future__ import annotations

from typing import Protocol

from .ir import Graph, Node

__all__ = ["Conservative", "KernelFacts", "kernel_facts", "use_kernel_facts"]


class KernelFacts(Protocol):
    """The questions about kernels that planning asks (see the module doc)."""

    def packs_alike(self, device: str) -> bool: ...

    def strides_kept(self, graph: Graph, node: Node, vid: int,
                     stride: tuple[int, ...]) -> bool: ...

    def batch_norm_from_stats(self, device: str, dtype: str, eps: float) -> bool: ...

    def optimizer_chunks_alike(self, device: str, dtype: str, kind: str, fused: bool) -> bool: ...


class Conservative:
    """The answers without a runtime: nothing is known to hold, so no rewrite relies on it."""

    def packs_alike(self, device: str) -> bool:
        return False

    def strides_kept(self, graph: Graph, node: Node, vid: int,
                     stride: tuple[int, ...]) -> bool:
        return False

    def batch_norm_from_stats(self, device: str, dtype: str, eps: float) -> bool:
        return False

    def optimizer_chunks_alike(self, device: str, dtype: str, kind: str, fused: bool) -> bool:
        return False


_FACTS: list[KernelFacts] = [Conservative()]


def kernel_facts() -> KernelFacts:
    """The registered answers (``Conservative`` where no runtime registered any)."""
    return _FACTS[0]


def use_kernel_facts(facts: KernelFacts) -> KernelFacts:
    """Answer with ``facts`` from now on; returns the ones they replace."""
    before, _FACTS[0] = _FACTS[0], facts
    return before
