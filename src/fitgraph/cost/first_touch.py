"""First touch: the page faults a CPU op pays when it writes memory nothing has written yet.

On the CPU a large tensor comes from the C library's ``malloc`` straight from the kernel
(``mmap``): its pages are mapped on first write, one fault per 4 KiB page. An op that fills
such memory in place pays those faults, and they are not small: on this 2-core VM about
0.55 ms per MiB, five times a ``fill_`` of warm memory. Dropout is the case that matters:
``empty_like`` (nothing written) then ``bernoulli_`` into it. The profiler measures
``bernoulli_`` on an input it made itself (already written), so it saw none of this: in a real
GPT-2 step the 13 masks cost 95 ms more than profiled, 1.8x, and a plan that recomputes them
(RNG replay) pays it again — the simulator under-priced exactly the recomputes planners like.

``untouched_writes(graph)`` names, per node, the bytes it writes first into storage made by
an uninitialised allocation (``empty``, ``empty_like``, ``new_empty``, ``empty_strided``);
``ProfiledCostModel`` adds ``bytes × seconds_per_byte`` to such a node's measured time, with
``seconds_per_byte`` measured once per machine (``measure_seconds_per_byte``: a fresh 64 MiB
buffer filled against the same buffer filled again). On CUDA the caching allocator hands back
memory already mapped, so there is nothing to add; on a CPU whose freed memory is kept mapped
(``execute/host_memory.py``) only blocks of 32 MiB or more come fresh, and only those are
charged. (Without it, which blocks come fresh depends on glibc's adaptive thresholds: in a
later GPT-2 step the same masks measured 11 ms *below* the charged price, their pages warm.)

Example:
    >>> from fitgraph.graph.ir import GraphBuilder, Role
    >>> b = GraphBuilder(); x = b.add_input("x", (1024,), "float32", Role.INPUT)
    >>> m = b.add_node("aten.empty_like.default", [x], [((1024,), "float32")])[0]
    >>> w = b.add_node("aten.bernoulli_.float", [m], [((1024,), "float32")], mutates=[m],
    ...                alias_of={0: m})[0]
    >>> untouched_writes(b.finish({"loss": w}))
    {1: 4096}
"""

from __future__ import annotations

import statistics
import time

import torch

from ..graph.ir import Graph

__all__ = ["UNINITIALISED", "measure_seconds_per_byte", "untouched_writes"]

# NOTE: ops whose fresh storage holds whatever the allocator returned: nothing wrote it yet
UNINITIALISED = frozenset({
    "aten.empty.memory_format", "aten.empty_like.default", "aten.new_empty.default",
    "aten.empty_strided.default", "aten.new_empty_strided.default",
})
# NOTE: far above glibc's largest mmap threshold (32 MiB): always fresh pages from the kernel
_PROBE_BYTES = 64 * 2**20
_PROBE_REPEATS = 7


def untouched_writes(graph: Graph, min_bytes: int = 0) -> dict[int, int]:
    """node id -> bytes of storage it is the first to write, where an uninitialising
    allocation made that storage of at least ``min_bytes``. Nodes that write nothing untouched
    are absent.

    NOTE: with ``execute.host_memory.keep_host_memory`` in force, a block below glibc's mmap
    ceiling comes back warm from the heap from the second step on: only larger ones fault
    (``ProfiledCostModel`` passes the ceiling then)."""
    made_blank: dict[int, int] = {}   # storage -> bytes, until its first writer
    out: dict[int, int] = {}
    for n in graph.nodes:
        for vid in n.mutates:
            st = graph.values[vid].storage
            if st in made_blank:
                out[n.id] = out.get(n.id, 0) + made_blank.pop(st)
        if n.target in UNINITIALISED:
            for vid in n.outputs:
                if vid is not None:
                    st = graph.storages[graph.values[vid].storage]
                    if st.nbytes >= min_bytes:
                        made_blank[st.id] = st.nbytes
    return out


def measure_seconds_per_byte() -> float:
    """Seconds per byte of first-touch page faults on this machine's CPU (0 if none seen)."""
    warm = torch.empty(_PROBE_BYTES, dtype=torch.uint8)
    warm.fill_(1)
    fresh_s, warm_s = [], []
    for _ in range(_PROBE_REPEATS):
        t0 = time.perf_counter()
        x = torch.empty(_PROBE_BYTES, dtype=torch.uint8)
        x.fill_(1)
        fresh_s.append(time.perf_counter() - t0)
        del x
        t0 = time.perf_counter()
        warm.fill_(2)
        warm_s.append(time.perf_counter() - t0)
    return max(0.0, statistics.median(fresh_s) - statistics.median(warm_s)) / _PROBE_BYTES
