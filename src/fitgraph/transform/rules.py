"""Rewrite rules: the algebraic rewrites the coordinated search composes (issue 30, MAGIS/TASO).

A ``Rule`` is a declarative object: ``find`` (the pattern: every place in a graph it matches,
each match saying what it changes — ``bytes_saved``, the bytes of the tensors it no longer
makes less the ones it adds, and ``flops_saved``), ``rewrite`` (every match rewritten at once,
or, given ``matches``, some of ``find``'s: each match stands alone; the validity checks inside
``find``: a match is only found where the rewrite keeps the graph's values), ``exact``
(results bitwise as before, else allclose) and ``changes`` (what it changes, in words, for
reports). Rules rewrite values, not autograd: the captured graph is one dataflow
graph of the whole step, and a rule replaces nodes by others making the same values, so the
backward, which reads what it read, stays the gradient of the same function. A rule's
``transform`` is its rewrite in the one shape of every graph rewrite (``rewrite.Transform``:
checked, with what changed).

Example:
    >>> from fitgraph.transform.rules import RULES
    >>> sorted(RULES)[:2], RULES["scale_across_matmul"].exact, RULES["inverse_pairs"].exact
    (['inverse_pairs', 'merge_shared_matmuls'], False, True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from ..graph.ir import Graph
from .inverse_pairs import find_inverse_pairs, remove_inverse_pairs
from .merge_matmuls import find_shared_matmuls, merge_shared_matmuls
from .norm_from_stats import batch_norm_from_stats, find_norms_from_stats
from .per_operand_convolution import convolutions_per_operand, find_convolutions_per_operand
from .rewrite import Transform
from .scale_across_matmul import find_scaled_products, scale_across_matmul
from .split_matmul import find_packed_matmuls, split_packed_matmuls

__all__ = ["RULES", "Rule"]


@dataclass(frozen=True)
class Rule:
    """A rewrite rule (module doc). ``find(graph)``: its matches, each with ``bytes_saved``
    and ``flops_saved``; ``rewrite(graph, matches=None)``: the graph with every match (or
    every one of ``matches``, some of ``find(graph)``) rewritten (``graph`` itself where
    none)."""

    name: str
    find: Callable[[Graph], list]
    rewrite: Callable[..., Graph]
    exact: bool
    changes: str

    @property
    def transform(self) -> Transform:
        return Transform(self.name, self.rewrite, exact=self.exact)


RULES: dict[str, Rule] = {r.name: r for r in (
    Rule("scale_across_matmul", find_scaled_products, scale_across_matmul, exact=False,
         changes="a product scaled by a number is made from its smaller operand scaled: one "
                 "product-sized tensor and its elementwise pass fewer"),
    Rule("inverse_pairs", find_inverse_pairs, remove_inverse_pairs, exact=True,
         changes="a concatenation of a split's parts, a split of a concatenation, a "
                 "permutation undone: the copy (or the views) no longer made, readers read "
                 "the original"),
    Rule("split_packed_matmuls", find_packed_matmuls, split_packed_matmuls, exact=False,
         changes="a packed projection (q, k, v in one matmul) made as one matmul per part "
                 "on slices of its weight: each part a tensor of its own, dying (or "
                 "recomputed) alone; the input read once per part"),
    Rule("merge_shared_matmuls", find_shared_matmuls, merge_shared_matmuls, exact=False,
         changes="projections of one input (q, k, v; gate and up) made by one batched "
                 "matmul on their stacked weights: one launch, the weights stacked every "
                 "step; the parts share one storage"),
    Rule("norm_from_stats", find_norms_from_stats, batch_norm_from_stats, exact=True,
         changes="a training BatchNorm's output (and the activation made from it) re-made "
                 "for the backward from the saved statistics, one normalization pass: the "
                 "forward's copy dies in the forward"),
    Rule("norm_from_stats_through_sums", partial(find_norms_from_stats, through_sums=True),
         partial(batch_norm_from_stats, through_sums=True), exact=True,
         changes="as norm_from_stats, and where a residual sum lies between the BatchNorm and "
                 "the activation (its other tensor kept for the backward anyway): one pass "
                 "more re-made"),
    Rule("per_operand_convolution", find_convolutions_per_operand, convolutions_per_operand,
         exact=False,
         changes="a convolution of a concatenation along its channels (a U-Net's skip "
                 "connection, a feature pyramid's fusion) made per operand on the weight's "
                 "columns, forward and backward: the concatenation is not made (nor kept for "
                 "the weight gradient), each operand's gradient made apart"),
)}
