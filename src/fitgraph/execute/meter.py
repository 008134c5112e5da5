"""Exact allocator-level memory measurement of a region of code.

:class:`MemoryMeter` answers "how many bytes did this region make the tensor
allocator hand out, at most, and how many are still held at the end?" with
numbers taken from the allocator itself, never from the process RSS.

On the CPU it records the allocator's own ``[memory]`` events with the PyTorch
profiler (one signed event per allocation and per free) and replays them in
time order; on CUDA it reads the caching allocator's counters.

Example (runnable; the CPU allocator does not round, so the numbers are exact)::

    >>> import torch
    >>> from fitgraph.execute.meter import MemoryMeter, measure_peak
    >>> with MemoryMeter() as m:
    ...     a = torch.empty(1000)                  # +4000 bytes (float32)
    ...     tmp = torch.empty(500)                 # +2000 bytes
    ...     del tmp                                # -2000 bytes
    >>> m.peak_bytes, m.end_bytes, m.events
    (6000, 4000, 3)
    >>> m.timeline
    [4000, 6000, 4000]
    >>> out, m2 = measure_peak(torch.ones, 10, dtype=torch.float64)
    >>> m2.peak_bytes, m2.end_bytes
    (80, 80)

What is and is not counted on the CPU (read this before trusting a number):

* Every allocation and free made by the default CPU allocator on the thread
  that entered the meter (and on threads the profiler propagates to, such as
  the autograd engine's) is counted, with its exact requested size: the CPU
  allocator does not round, ``torch.empty(3, dtype=torch.float16)`` is 6 bytes.
  That includes buffers allocated *inside* kernels (oneDNN reorders and
  workspaces of ``conv2d``, the flash-attention buffers of CPU SDPA, the
  temporaries of ``sort``) and work done under ``torch.no_grad()`` or in
  ``torch.autograd.grad`` backward passes.
* A free of a block allocated *before* the meter was entered is only reported
  by PyTorch when the allocator knows the block's size, i.e. when the block was
  itself allocated while a memory profiler (for instance an earlier
  ``MemoryMeter``) was active: c10's ``ProfiledCPUMemoryReporter`` only records
  sizes while memory profiling is on and drops the free of any other block
  (it only logs "Memory block of unknown size was allocated before the
  profiling started"). Such frees are then missing, which makes ``peak_bytes``
  and ``end_bytes`` upper bounds. To get exact numbers for frees of
  pre-existing state, allocate that state inside a ``MemoryMeter`` region too
  (e.g. measure a warm-up step). Beware a stale size: when a block allocated
  under a profiler is freed outside one, its size stays in c10's table, and if
  a block allocated outside a profiler later reuses that address and is freed
  inside a meter, PyTorch reports the free with the *old* block's size.
* Not seen: memory that bypasses the default CPU allocator (e.g. whatever a
  library mallocs itself; pinned host memory on CUDA builds was not checked),
  and allocations made on intra-op worker threads inside ``at::parallel_for``
  bodies (the profiler's state is thread-local and ATen does not propagate it
  there; none of the kernels tried, conv2d, SDPA, sort, unique, cdist, ...,
  allocate there).

On CUDA the numbers come from the caching allocator's ``requested_bytes``
statistics (``torch.cuda.memory_stats``): the bytes tensors asked for, as on
the CPU, so they compare exactly with the simulator's. ``block_peak_bytes``
is the peak in the allocator's rounded blocks (multiples of 512 bytes,
``torch.cuda.max_memory_allocated``), what the card gives out. Where a torch
build lacks requested bytes, both are the block numbers. ``timeline`` is
empty there, and entering the meter resets the device's peak statistics.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["MemoryMeter", "measure_peak"]

T = TypeVar("T")

# The profiler names every allocator event "[memory]" (see
# torch.autograd.profiler_util.MEMORY_EVENT_NAME); "[OutOfMemory]" events also
# carry a size and must not be counted.
_MEMORY_EVENT_NAME = "[memory]"

# Process-wide bookkeeping of open meters. The kineto profiler session is
# process-global: a second CPU session started on another thread while one is
# open stops the first one's kineto session ("disableProfiler called but no
# active profiling session found"). CUDA meters reset the device's peak
# counter, so two on the same device would corrupt each other's peak.
_LOCK = threading.Lock()
_ACTIVE_CPU: list[MemoryMeter] = []
_ACTIVE_CUDA: dict[int, MemoryMeter] = {}


def _host_device_types() -> frozenset[Any]:
    """Profiler device types whose allocations are host (CPU) memory.

    Same set torch itself sums as "CPU memory" in ``_parse_kineto_results``;
    on CUDA builds the profiler also reports CUDA allocations, which a CPU
    meter must not count.
    """
    from torch._C._autograd import DeviceType

    names = ("CPU", "MKLDNN", "IDEEP")
    return frozenset(getattr(DeviceType, n) for n in names if hasattr(DeviceType, n))


def _resolve_device(device: str | torch.device | int | None) -> torch.device:
    if device is None:
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"MemoryMeter(device={str(dev)!r}): CUDA is not available")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        return torch.device("cuda", index)
    raise ValueError(f"MemoryMeter supports 'cpu' and 'cuda' devices, got {str(dev)!r}")


# NOTE: kineto (the profiler's backend) prints "USDT: ... profiler_start/stop" and "STAGE" lines
# to stderr at every session below this level; fitgraph opens hundreds while profiling. Kineto
# reads the level once, at its first session in the process: a level the user set is kept.
KINETO_QUIET_LEVEL = "6"


def quiet_kineto() -> None:
    """Silence kineto's per-session stderr lines unless ``KINETO_LOG_LEVEL`` is set already
    (takes effect where the process has not started a profiler session yet)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)


def _profiler_active_anywhere() -> bool:
    """True if a PyTorch profiler session is open on this thread or any other."""
    if torch.autograd._profiler_enabled():  # this thread (C++ thread-local state)
        return True
    # Process-wide flag torch.autograd.profiler keeps for its own sessions.
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


class MemoryMeter:
    """Measure exact allocator bytes of the code run inside a ``with`` block.

    Args:
        device: ``None`` or ``"cpu"`` (default) to meter the CPU allocator;
            ``"cuda"``, ``"cuda:N"`` or a ``torch.device`` to meter a CUDA
            device's caching allocator.

    After the block, these read-only results are available (reading them
    earlier raises ``RuntimeError``):

    * ``peak_bytes`` (int, >= 0): maximum over the region of
      (bytes allocated in the region - bytes freed in the region), i.e. the
      peak of the running sum relative to entry.
    * ``end_bytes`` (int): net bytes still allocated at exit relative to entry;
      negative when the region freed more pre-existing memory than it kept.
    * ``timeline`` (list[int]): running sum after every allocator event, in
      time order (CPU only; empty on CUDA).
    * ``events`` (int): number of allocator events (0 on CUDA).

    CPU meters cannot be nested, nor opened while another CPU meter or any
    ``torch.profiler`` session is open (on any thread); CUDA meters cannot be
    nested on the same device. Both raise ``RuntimeError`` on entry. A meter
    object may be reused for several sequential regions; each entry starts
    from scratch.

    Example::

        >>> import torch
        >>> x = torch.randn(8, 16, 32, 32)
        >>> w = torch.randn(16, 16, 3, 3)
        >>> with MemoryMeter() as m:
        ...     y = torch.nn.functional.conv2d(x, w, padding=1)
        >>> m.end_bytes == y.nbytes
        True
        >>> m.peak_bytes >= y.nbytes
        True

    See the module docstring for what the CPU meter can and cannot see.
    """

    def __init__(self, device: str | torch.device | int | None = None) -> None:
        self.device: torch.device = _resolve_device(device)
        self._active = False
        self._done = False
        self._prof: Any = None
        self._thread: int | None = None
        self._start = 0
        self._peak = 0
        self._block_peak = 0
        self._start_requested = 0
        self._end = 0
        self._timeline: list[int] = []

    # ------------------------------------------------------------------ results
    def _result(self, value: T) -> T:
        if not self._done:
            state = "still open" if self._active else "never been closed"
            raise RuntimeError(
                f"MemoryMeter results are read after the with-block; this meter has {state}"
            )
        return value

    @property
    def peak_bytes(self) -> int:
        """Peak of (allocated - freed) bytes inside the region, relative to entry (>= 0)."""
        return self._result(self._peak)

    @property
    def block_peak_bytes(self) -> int:
        """CUDA: the peak in the caching allocator's rounded blocks (what the card handed out),
        relative to entry; on the CPU the same as ``peak_bytes``."""
        return self._result(self._block_peak if self.device.type == "cuda" else self._peak)

    @property
    def end_bytes(self) -> int:
        """Net bytes still allocated at exit, relative to entry (may be negative)."""
        return self._result(self._end)

    @property
    def timeline(self) -> list[int]:
        """Running sum after every allocator event, in time order (CPU only)."""
        return self._result(self._timeline)

    @property
    def events(self) -> int:
        """Number of allocator events seen in the region (CPU only)."""
        return self._result(len(self._timeline))

    def __repr__(self) -> str:
        if not self._done:
            return f"MemoryMeter(device={str(self.device)!r}, open={self._active})"
        return (
            f"MemoryMeter(device={str(self.device)!r}, peak_bytes={self._peak}, "
            f"end_bytes={self._end}, events={len(self._timeline)})"
        )

    # ---------------------------------------------------------- context manager
    def __enter__(self) -> MemoryMeter:
        if self._active:
            raise RuntimeError("this MemoryMeter is already open; use a new one to nest")
        self._done = False
        self._timeline = []
        self._peak = self._end = 0
        if self.device.type == "cuda":
            self._enter_cuda()
        else:
            self._enter_cpu()
        self._active = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._active:
            return
        self._active = False
        if self.device.type == "cuda":
            self._exit_cuda()
        else:
            self._exit_cpu()
        self._done = True

    # ---------------------------------------------------------------------- CPU
    # NOTE: why profiler "[memory]" events, and not RSS or a dispatch-mode tracker?
    # * RSS (psutil, /proc) measures pages, not tensors: glibc keeps freed chunks
    #   in its arenas, large blocks are mmap'd lazily (untouched pages never count),
    #   and every Python object, import and thread stack moves it. It can neither
    #   give a byte-exact peak nor see a short-lived buffer between two samples.
    # * A TorchDispatchMode/storage tracker sees only the tensors an operator
    #   returns. It misses what kernels allocate internally and free before
    #   returning (conv2d's oneDNN reorders and im2col columns, CPU flash-SDPA's
    #   per-thread buffers, sort's temporaries), which is often the peak. It
    #   also sees frees only through Python weakrefs, late and incompletely.
    # * The CPU allocator itself reports every allocation and free to the
    #   profiler (c10::ProfiledCPUMemoryReporter -> reportMemoryUsageToProfiler)
    #   with the exact requested size, from wherever it happens, kernels
    #   included. Summing those signed events in time order gives the exact
    #   running total of live allocator bytes, hence an exact peak.
    def _enter_cpu(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        with _LOCK:
            if _ACTIVE_CPU:
                where = (
                    "on this thread"
                    if any(m._thread == threading.get_ident() for m in _ACTIVE_CPU)
                    else "on another thread"
                )
                raise RuntimeError(
                    f"MemoryMeter(device='cpu') cannot be nested: another CPU MemoryMeter "
                    f"is already open {where}. The PyTorch profiler it relies on is not "
                    "reentrant (an inner session would take the outer one's memory events "
                    "and leave it with wrong numbers). Measure the outer region and read "
                    "the inner part from its timeline, or use sequential meters."
                )
            if _profiler_active_anywhere():
                raise RuntimeError(
                    "MemoryMeter(device='cpu') cannot run while a torch.profiler / "
                    "torch.autograd.profiler session is active: the PyTorch profiler is not "
                    "reentrant and the meter needs its own session for the allocator's "
                    "memory events."
                )
            quiet_kineto()
            # Only record what is needed: no shapes, no stacks, no flops/modules.
            # These keep the per-op overhead at its minimum; allocator events do
            # not need them.
            prof = profile(
                activities=[ProfilerActivity.CPU],
                profile_memory=True,
                record_shapes=False,
                with_stack=False,
                with_flops=False,
                with_modules=False,
            )
            self._thread = threading.get_ident()
            _ACTIVE_CPU.append(self)
        try:
            prof.__enter__()
        except BaseException:
            with _LOCK:
                _ACTIVE_CPU.remove(self)
            raise
        self._prof = prof

    def _exit_cpu(self) -> None:
        prof, self._prof = self._prof, None
        try:
            prof.__exit__(None, None, None)
            # NOTE: the raw kineto result, not prof.events()/key_averages(): the
            # latter build FunctionEvents and attach memory records to their
            # enclosing ops, losing order and costing far more; _memory_profile()
            # needs record_shapes and with_stack. kineto_results.events() is the
            # flat list of every recorded event, allocator events included, each
            # with its signed size (nbytes) and timestamp.
            result = prof.profiler.kineto_results
            records = _memory_records(result.events())
        finally:
            with _LOCK:
                if self in _ACTIVE_CPU:
                    _ACTIVE_CPU.remove(self)
        running = peak = 0
        timeline = []
        for _, nbytes in records:
            running += nbytes
            timeline.append(running)
            if running > peak:
                peak = running
        self._timeline = timeline
        self._peak = peak
        self._end = running

    # --------------------------------------------------------------------- CUDA
    # NOTE: on CUDA the caching allocator keeps exact counters of the bytes it
    # has handed out (rounded to its block sizes), including a resettable peak,
    # so no profiler is needed; synchronizing first makes pending frees that
    # the allocator defers to stream completion visible in the counters.
    def _enter_cuda(self) -> None:
        index = self.device.index
        assert index is not None
        with _LOCK:
            if index in _ACTIVE_CUDA:
                raise RuntimeError(
                    f"MemoryMeter(device='cuda:{index}') cannot be nested: another CUDA "
                    f"MemoryMeter is already open on cuda:{index}, and entering resets the "
                    "device's peak-memory statistics that the outer meter relies on."
                )
            _ACTIVE_CUDA[index] = self
        try:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            self._start_requested = _requested(self.device, "current", self._start)
        except BaseException:
            with _LOCK:
                _ACTIVE_CUDA.pop(index, None)
            raise

    def _exit_cuda(self) -> None:
        index = self.device.index
        try:
            torch.cuda.synchronize(self.device)
            blocks = torch.cuda.max_memory_allocated(self.device) - self._start
            end_blocks = torch.cuda.memory_allocated(self.device)
            peak = _requested(self.device, "peak", blocks + self._start) - self._start_requested
            end = _requested(self.device, "current", end_blocks) - self._start_requested
        finally:
            with _LOCK:
                _ACTIVE_CUDA.pop(index, None)  # type: ignore[arg-type]
        # reset_peak_memory_stats() sets the peak to the current allocation, so
        # peak >= 0 already; max() guards against a concurrent reset elsewhere.
        self._peak = max(peak, 0)
        self._block_peak = max(blocks, 0)
        self._end = end
        self._timeline = []


def _memory_records(events: Any) -> list[tuple[int, int]]:
    """(timestamp_ns, signed_bytes) of the host allocator events, in time order.

    ``events`` is ``_ProfilerResult.events()``. Only allocator events carry a
    non-zero ``nbytes()`` (and the allocator never reports 0-byte blocks), so
    testing it first avoids building a name string for every operator event.
    """
    host = _host_device_types()
    records = []
    for ev in events:
        nbytes = ev.nbytes()
        if nbytes and ev.name() == _MEMORY_EVENT_NAME and ev.device_type() in host:
            records.append((ev.start_ns(), nbytes))
    # NOTE: ordering. The running sum is only exact if events are replayed in
    # the order they happened. Each event carries the time it was recorded; the
    # profiler collects them per thread (in recording order) and, in torch 2.13,
    # already hands them out stable-sorted by timestamp. Sort again anyway, with
    # a *stable* sort (Timsort: O(n) on sorted input) so as not to depend on
    # that: events of one thread sharing a nanosecond keep their recording
    # order (an alloc is never moved after its own free); only same-nanosecond
    # events of two different threads, whose true order nobody knows, keep the
    # profiler's order.
    records.sort(key=_timestamp)
    return records


def _timestamp(record: tuple[int, int]) -> int:
    return record[0]


def measure_peak(
    fn: Callable[..., T],
    *args: Any,
    device: str | torch.device | int | None = None,
    **kwargs: Any,
) -> tuple[T, MemoryMeter]:
    """Run ``fn(*args, **kwargs)`` inside a :class:`MemoryMeter`.

    Returns ``(result, meter)``. The result is still alive when the meter
    closes, so its bytes are part of ``meter.end_bytes``.

        >>> import torch
        >>> y, m = measure_peak(torch.zeros, 256, dtype=torch.int32)
        >>> m.peak_bytes, m.end_bytes
        (1024, 1024)
    """
    with MemoryMeter(device) as meter:
        result = fn(*args, **kwargs)
    return result, meter


def _requested(device: torch.device, which: str, fallback: int) -> int:
    """The CUDA allocator's ``requested_bytes.all.<which>`` (exact tensor bytes), or
    ``fallback`` (block bytes) where this torch build does not count them."""
    return int(torch.cuda.memory_stats(device).get(f"requested_bytes.all.{which}", fallback))
