"""Fewer cyclic garbage collections while a solver runs (``solve`` wraps every solver in it, and
the torch.compile backend its solver).

A solver allocates millions of short-lived tuples, lists and dicts. CPython's cyclic collector
runs a young-generation pass every 700 net allocations of container objects, and every hundred
of those a pass over every tracked object in the process: the model, its optimizer state, the
captured graph, the cost cache, the solver's own memo of split graphs. Measured on this 2-core
CPU (`python -m fitgraph.bench.solve_collector`), those passes were 15–29% of ``auto``'s time
on the zoo's small models. ``fewer_collections`` raises the young generation's threshold to
``SOLVE_THRESHOLD`` for the duration: collections still run, so the cyclic garbage a long
search makes stays bounded, just a hundred times less often. Plans do not change: nothing a
solver decides depends on when garbage is collected.

Example:
    >>> import gc
    >>> from fitgraph.solvers.collector import fewer_collections
    >>> before = gc.get_threshold()
    >>> with fewer_collections():
    ...     gc.get_threshold()[0] >= 100_000
    True
    >>> gc.get_threshold() == before
    True
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["SOLVE_THRESHOLD", "fewer_collections"]

# NOTE: gc.set_threshold's three numbers while solving. 100,000 young allocations between
# passes came within 0.1-0.5 s of no collection at all (ResNet-50 small at 0.7 of eager: 2.7 s
# against 2.6 s, 3.5 s by default; BERT's at 0.5: 11 s against 10 s, 14 s by default); the older
# generations keep their ratios
SOLVE_THRESHOLD = (100_000, 10, 10)


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Within the block, the cyclic collector runs at most as often as ``SOLVE_THRESHOLD``
    says (never more often than before); the thresholds in force before are restored after,
    also when the block raises. A threshold of 0 (collection off) is left as it is."""
    before = gc.get_threshold()
    if before[0] == 0:
        yield
        return
    gc.set_threshold(*(max(old, new) for old, new in zip(before, SOLVE_THRESHOLD)))
    try:
        yield
    finally:
        gc.set_threshold(*before)
