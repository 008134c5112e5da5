"""Every whole-graph transform the planners use, by name, in the one shape (``rewrite.Transform``).

``exact``: the rewrite keeps results bitwise (an ``exact=True`` problem may use it); the others
sum or normalise in another order (allclose). Fission's own splits (``transform.fission``:
a region in parts) and re-made regions (``transform.recompute_copies``) take a region and a
part count: the solvers that search them (``solvers.fission``) call them directly. A new
transform is added here.

Example:
    >>> from fitgraph.transform.registry import TRANSFORMS
    >>> TRANSFORMS["compact_masks"].exact, TRANSFORMS["group_norm_stats"].exact
    (True, False)
"""

from __future__ import annotations

from .compact_masks import compact_masks
from .constant_predicates import fold_constant_predicates
from .elementwise_expands import elementwise_before_expands
from .elementwise_views import elementwise_before_reshapes
from .fission_halo_grads import separate_input_grads
from .fission_loss import count_targets_apart
from .fission_shift import unshift_losses
from .group_norm_stats import group_norms_from_stats
from .loss_sums import losses_as_sums
from .optimizer_in_backward import optimizer_in_backward, why_not
from .products_into_sums import products_into_sums
from .rewrite import Transform
from .rules import RULES
from .saved_views import copy_saved_views
from .scatter_sums import stack_scatter_sums
from .sums_in_place import sums_in_place
from .view_chains import collapse_view_chains

__all__ = ["FISSION_READS", "FISSION_SEARCH_READS", "TRANSFORMS", "fission_reads"]

TRANSFORMS: dict[str, Transform] = {t.name: t for t in (
    Transform("compact_masks", compact_masks, exact=True),
    Transform("constant_predicates", fold_constant_predicates, exact=True),
    Transform("elementwise_before_expands", elementwise_before_expands, exact=True),
    Transform("elementwise_before_reshapes", elementwise_before_reshapes, exact=True),
    Transform("saved_views", copy_saved_views, exact=True),
    Transform("view_chains", collapse_view_chains, exact=True),
    Transform("count_targets_apart", count_targets_apart, exact=True),
    Transform("optimizer_in_backward", optimizer_in_backward, exact=True, why_not=why_not),
    Transform("unshift_losses", unshift_losses, exact=False),
    Transform("loss_sums", losses_as_sums, exact=False),
    Transform("group_norm_stats", group_norms_from_stats, exact=False),
    Transform("scatter_sums", stack_scatter_sums, exact=False),
    Transform("products_into_sums", products_into_sums, exact=False),
    Transform("sums_in_place", sums_in_place, exact=False),
    Transform("separate_input_grads", separate_input_grads, exact=False),
    # NOTE: the rewrite rules the coordinated search composes (solvers.coordinated); fission
    # reads per_operand_convolution, one of them, too
    *(rule.transform for rule in RULES.values()),
)}

# NOTE: the graph fission's searches read (solvers.fission: search, split_backward), in order:
# a convolution of a concatenation per operand and a group norm from its statistics (so a
# region runs along the time through them), mask predicates folded and elementwise ops run
# before their expands (a mask made once per batch row), saved views copied out (a packed
# projection dies in the forward), masks as bits, a shifted loss read whole and its targets
# counted apart and mean-reduced pointwise losses as sums (a loss is then in a region),
# reshape round trips read through, scattered sums stacked
FISSION_READS = ("per_operand_convolution", "group_norm_stats", "constant_predicates",
                 "elementwise_before_expands", "saved_views", "compact_masks", "unshift_losses",
                 "count_targets_apart", "loss_sums", "view_chains", "scatter_sums")
# NOTE: the region search from the eager peak (solvers.fission.search) reads the last five
FISSION_SEARCH_READS = FISSION_READS[-5:]


def fission_reads(graph, names: tuple[str, ...] = FISSION_READS):
    """``graph`` rewritten by the transforms ``names``, in order (the very graph where none
    changes it)."""
    for n in names:
        graph = TRANSFORMS[n].apply(graph)
    return graph
