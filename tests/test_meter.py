"""MemoryMeter: exact allocator bytes of a region (CPU via profiler events, CUDA via counters)."""

from __future__ import annotations

import doctest
import threading

import pytest
import torch
import torch.nn.functional as F

from fitgraph.execute import meter as meter_module
from fitgraph.execute.meter import MemoryMeter, measure_peak

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _check_consistent(m: MemoryMeter) -> None:
    assert m.events == len(m.timeline)
    assert m.end_bytes == (m.timeline[-1] if m.timeline else 0)
    assert m.peak_bytes == max([0, *m.timeline])


def test_known_sizes_are_exact_and_not_rounded():
    # Verified: the default CPU allocator reports the requested size, unrounded.
    with MemoryMeter() as m:
        a = torch.empty(1000, dtype=torch.float32)  # 4000
        b = torch.empty(3, dtype=torch.float16)  # 6
        c = torch.empty(1, dtype=torch.uint8)  # 1
        d = torch.empty(0)  # no storage: no event
    assert m.timeline == [4000, 4006, 4007]
    assert (m.peak_bytes, m.end_bytes, m.events) == (4007, 4007, 3)
    _check_consistent(m)
    del a, b, c, d


def test_free_of_preexisting_tensor_gives_negative_end():
    # The pre-existing tensor must be allocated under a memory profiler, else the
    # CPU allocator does not know its size and PyTorch drops its free (see module doc).
    with MemoryMeter():
        big = torch.empty(1000)  # 4000 bytes, allocated before the measured region
    with MemoryMeter() as m:
        small = torch.empty(250)  # +1000 -> 1000 (the peak)
        del big  # -4000 -> -3000
        tail = torch.empty(100)  # +400 -> -2600
    assert m.timeline == [1000, -3000, -2600]
    assert (m.peak_bytes, m.end_bytes) == (1000, -2600)
    _check_consistent(m)
    del small, tail


def test_free_first_keeps_peak_at_zero():
    with MemoryMeter():
        big = torch.empty(2000)  # 8000
    with MemoryMeter() as m:
        del big
        a = torch.empty(500)  # 2000
    assert m.timeline == [-8000, -6000]
    assert (m.peak_bytes, m.end_bytes) == (0, -6000)
    del a


def test_conv2d_workspace_is_seen():
    x = torch.randn(8, 64, 56, 56)
    w = torch.randn(64, 64, 3, 3)
    with MemoryMeter() as m:
        y = F.conv2d(x, w, padding=1)
    assert y.nbytes == 8 * 64 * 56 * 56 * 4
    assert m.end_bytes == y.nbytes
    # the kernel's internal buffers (oneDNN reorders) exist only inside the call
    assert m.peak_bytes > y.nbytes
    _check_consistent(m)


def test_temporary_raises_peak_not_end():
    def f(x):
        tmp = torch.empty(10_000)  # 40000 bytes, freed on return
        tmp.zero_()
        # NOTE: no Python scalars here: `x + 1` or `fill_(1.0)` allocate (and free)
        # small wrapped-number tensors, which the meter rightly counts.
        return x.neg()  # 400 bytes, kept

    x = torch.zeros(100)
    with MemoryMeter() as m:
        y = f(x)
    assert m.timeline == [40_000, 40_400, 400]
    assert (m.peak_bytes, m.end_bytes) == (40_400, 400)
    del y


def test_measure_peak_returns_result_and_meter():
    y, m = measure_peak(torch.zeros, 256, dtype=torch.int32)
    assert isinstance(m, MemoryMeter)
    assert y.shape == (256,)
    assert (m.peak_bytes, m.end_bytes) == (1024, 1024)

    def g(n, *, scale):
        return torch.full((n,), scale, dtype=torch.float64)

    y, m = measure_peak(g, 10, scale=2.0, device="cpu")
    assert torch.equal(y, torch.full((10,), 2.0, dtype=torch.float64))
    assert (m.peak_bytes, m.end_bytes) == (80, 80)


def test_allocations_under_no_grad_are_seen():
    with torch.no_grad(), MemoryMeter() as m:
        a = torch.empty(1000)
    assert m.timeline == [4000]
    del a


class _AllocInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        scratch = torch.empty(12_345, dtype=torch.uint8)  # seen, then freed
        del scratch
        return g * 2


def test_allocations_inside_autograd_grad_backward_are_seen():
    x = torch.randn(100, requires_grad=True)
    y = _AllocInBackward.apply(x).sum()
    with MemoryMeter() as m:
        (gx,) = torch.autograd.grad(y, x)
    deltas = [b - a for a, b in zip([0, *m.timeline], m.timeline)]
    assert 12_345 in deltas and -12_345 in deltas
    assert torch.equal(gx, torch.full((100,), 2.0))


def test_nested_meter_raises_and_outer_still_exact():
    with MemoryMeter() as outer:
        a = torch.empty(100)
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with MemoryMeter():
                pass
        b = torch.empty(50)
    assert outer.timeline == [400, 600]
    del a, b


def test_meter_inside_torch_profiler_raises():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="profiler"):
            with MemoryMeter():
                pass
    with MemoryMeter() as m:  # usable again afterwards
        a = torch.empty(10)
    assert m.timeline == [40]
    del a


def test_meter_on_another_thread_raises():
    errors = []

    def other():
        try:
            with MemoryMeter():
                pass
        except RuntimeError as e:
            errors.append(str(e))

    with MemoryMeter() as m:
        t = threading.Thread(target=other)
        t.start()
        t.join()
        a = torch.empty(5)
    assert len(errors) == 1 and "another thread" in errors[0]
    assert m.timeline == [20]
    del a


def test_results_before_exit_raise_and_meter_is_reusable():
    m = MemoryMeter()
    with pytest.raises(RuntimeError, match="after the with-block"):
        _ = m.peak_bytes
    with m:
        with pytest.raises(RuntimeError, match="still open"):
            _ = m.end_bytes
        with pytest.raises(RuntimeError, match="already open"):
            m.__enter__()
        a = torch.empty(10)
    assert m.timeline == [40]
    with m:
        b = torch.empty(20)
    assert m.timeline == [80]
    assert "peak_bytes=80" in repr(m)
    del a, b


def test_exception_in_region_propagates_and_closes_profiler():
    m = MemoryMeter()
    with pytest.raises(ValueError, match="boom"):
        with m:
            a = torch.empty(10)
            raise ValueError("boom")
    assert m.timeline == [40]
    assert not torch.autograd._profiler_enabled()
    with MemoryMeter() as m2:
        b = torch.empty(3)
    assert m2.timeline == [12]
    del a, b


def test_unsupported_device_raises():
    with pytest.raises(ValueError, match="cpu.*cuda"):
        MemoryMeter(device="meta")


def test_docstring_examples_run():
    result = doctest.testmod(meter_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0


@cuda_only
def test_cuda_meter_counts_device_bytes():
    dev = torch.device("cuda")
    keep = torch.empty(1024, device=dev)  # pre-existing, freed in region
    with MemoryMeter(device="cuda") as m:
        a = torch.empty(1 << 20, device=dev)  # 4 MiB, kept
        tmp = torch.empty(1 << 21, device=dev)  # 8 MiB, temporary
        del tmp
        del keep  # 4096 bytes (a multiple of 512: not rounded)
    assert m.timeline == [] and m.events == 0
    assert m.peak_bytes == (1 << 22) + (1 << 23)
    assert m.end_bytes == (1 << 22) - 4096
    with MemoryMeter(device="cuda"):
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with MemoryMeter(device=dev):
                pass
    del a
