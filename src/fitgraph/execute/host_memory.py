"""Keep freed host memory mapped, so a CPU step does not page-fault on memory it had before.

PyTorch's CPU allocator is the C library's ``malloc``. glibc's defaults adapt as a program runs:
a block above the mmap threshold (128 KiB at start, raised to the size of each mapped block
freed, up to 32 MiB) is mapped fresh from the kernel and unmapped on free, and the top of the
heap is handed back once more than the trim threshold is free there. Which tensors of a
training step come back as fresh pages — one fault per 4 KiB page, about 0.5 ms per MiB on
this 2-core VM, five times a warm write — then depends on the order of every earlier
allocation and free. On GPT-2 small a split loss's ``log_softmax`` parts measured 12.7 ms in
the step against 3.4 ms profiled; the eager step itself went from 506 to 485 ms with memory
kept. A plan that frees early and re-allocates (rematerialization) meets more of those faults
than eager does, and the simulator, fed warm measurements, cannot see them.

``keep_host_memory()`` fixes both thresholds (glibc's ``mallopt``): no trimming, and the
mmap threshold at the ceiling of glibc's adaptive one, 32 MiB. Then every block below 32 MiB is
reused warm from the second step on, and a block of 32 MiB or more is mapped fresh — unless a
free chunk or the untrimmed top of the heap is large enough, which malloc tries first: BERT
small's 120-MiB logits faulted 16k pages a step in one process and 32k in another (its step
time moved by under 1%). ``cost/first_touch.py`` charges the writes into blocks of 32 MiB or
more, as if always mapped fresh. This is
what the CUDA caching allocator does for device memory, and why PyTorch's CPU tuning guide
recommends jemalloc or tcmalloc; the process's resident memory stays at its high-water mark.
What this does not fix: PyTorch asks for 64-byte-aligned blocks (``posix_memalign``), and
glibc serves an aligned request with a chunk a little larger than the request, so a block just
freed is too small for the next request of the same size. Unless its neighbours are free too,
the new block is carved from the heap's top, fresh pages again: an op run on the same inputs in
a loop faulted its whole 8 MiB output each time in some processes and never in others (3.5
against 0.9 ms). That stays as run-to-run noise, in the profile and in the step.

It changes the whole process's allocator, so a library must not do it behind the user's back:
it is opt-in. ``ProfiledCostModel(keep_host_memory=True)`` applies it where it profiles on the
CPU; the ``fitgraph`` command (a process of its own), the benchmarks and the tests apply it
before timing eager PyTorch and fitgraph alike. Without it the simulator's times may miss page
faults a plan meets (``cost/first_touch.py`` reads ``kept()``). Other C libraries: nothing is
changed and ``kept()`` is False.

Example:
    >>> from fitgraph.execute.host_memory import keep_host_memory, kept
    >>> keep_host_memory() == kept()
    True
"""

from __future__ import annotations

import ctypes
import platform

__all__ = ["MMAP_CEILING_BYTES", "keep_host_memory", "kept"]

# NOTE: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit (4 MiB * sizeof(long)), where its adaptive
# threshold stops; glibc 2.36 took larger values here too, but faults then came and went with
# the process (64 and 256 MiB each faulted 32 MiB blocks in one process, not in another)
MMAP_CEILING_BYTES = 32 * 2**20
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_NEVER_TRIM = 2**31 - 1  # NOTE: mallopt takes an int; 2 GiB free at the top before a trim

_state: dict[str, bool] = {}


def kept() -> bool:
    """Whether ``keep_host_memory`` has fixed glibc's thresholds in this process."""
    return _state.get("kept", False)


def keep_host_memory() -> bool:
    """Fix glibc malloc's trim and mmap thresholds (see the module doc); True if they are.

    Idempotent. Does nothing (False) on other C libraries.
    """
    if "kept" in _state:
        return _state["kept"]
    ok = False
    if platform.libc_ver()[0] == "glibc":
        try:
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)) and bool(
                mallopt(_M_MMAP_THRESHOLD, MMAP_CEILING_BYTES))
        except (OSError, AttributeError):  # NOTE: a static or unusual libc: leave it alone
            ok = False
    _state["kept"] = ok
    return ok
