"""First-touch page faults: the op that first writes an ``empty_like`` (dropout's mask) is priced
with them; nothing else is."""

from __future__ import annotations

import pytest
import torch

import fitgraph
from fitgraph.cost import ProfiledCostModel
from fitgraph.cost.first_touch import untouched_writes
from fitgraph.execute.host_memory import MMAP_CEILING_BYTES


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FITGRAPH_CACHE_DIR", str(tmp_path / "cache"))


def _dropout_graph():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.5),
                                torch.nn.Linear(64, 10))
    batch = torch.randn(16, 32)
    return fitgraph.capture(model, batch, lambda m, b: m(b).square().mean())


def test_the_first_writer_of_an_empty_like_writes_it_untouched():
    g = _dropout_graph()
    blank = untouched_writes(g)
    (nid, nbytes), = blank.items()
    node = g.nodes[nid]
    assert node.target == "aten.bernoulli_.float" and nbytes == 16 * 64 * 4
    # the second in-place writer (div_) finds the pages mapped already
    assert any(n.target == "aten.div_.Scalar" and n.id not in blank for n in g.nodes)


def test_profiled_cost_adds_the_faults_to_that_writer_alone(monkeypatch):
    g = _dropout_graph()
    # NOTE: ops timed alone never see the faults; timed in situ they do (nothing to add)
    cm = ProfiledCostModel(repeats=1, warmup=0, progress=False, in_situ=False)
    monkeypatch.setattr("fitgraph.cost.profiler.kept", lambda: False)  # glibc left adaptive
    cm.profile(g)
    per_byte = 1e-9
    cm.first_touch_seconds_per_byte = lambda: per_byte
    blank = untouched_writes(g)
    for n in g.nodes:
        measured = cm._entry(cm.key(g, n), n).seconds
        want = measured + blank.get(n.id, 0) * per_byte
        assert cm.node_cost(g, n).seconds == pytest.approx(want, rel=1e-12, abs=0)
    assert sum(blank.values()) > 0


def test_with_host_memory_kept_only_blocks_past_the_mmap_ceiling_are_charged(monkeypatch):
    g = _dropout_graph()
    cm = ProfiledCostModel(repeats=1, warmup=0, progress=False, in_situ=False)
    cm.profile(g)
    cm.first_touch_seconds_per_byte = lambda: 1e-9
    monkeypatch.setattr("fitgraph.cost.profiler.kept", lambda: True)
    for n in g.nodes:  # NOTE: a 4 KiB mask comes back warm from the heap: no faults to add
        assert cm.node_cost(g, n).seconds == cm._entry(cm.key(g, n), n).seconds
    assert untouched_writes(g, MMAP_CEILING_BYTES) == {}
    assert untouched_writes(g, 16 * 64 * 4) != {}


def test_first_touch_is_measured_once_and_cached(monkeypatch):
    g = _dropout_graph()
    first = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    first.profile(g)
    measured = first.first_touch_seconds_per_byte()
    assert measured >= 0.0
    calls = []
    monkeypatch.setattr("fitgraph.cost.profiler.measure_seconds_per_byte",
                        lambda: calls.append(1) or 1.0)
    again = ProfiledCostModel(repeats=1, warmup=0, progress=False)
    assert again.first_touch_seconds_per_byte() == measured and calls == []


def test_the_process_allocator_is_changed_only_where_asked():
    """``keep_host_memory`` changes glibc's malloc for the whole process: the cost model does it
    only with ``keep_host_memory=True`` (the command, benchmarks and tests ask for it)."""
    import platform
    import subprocess
    import sys

    code = ("from fitgraph.cost import ProfiledCostModel; "
            "from fitgraph.execute.host_memory import kept; "
            "ProfiledCostModel('cpu', progress=False{}); print(kept())")
    default = subprocess.run([sys.executable, "-c", code.format("")], capture_output=True,
                             text=True, timeout=300)
    asked = subprocess.run([sys.executable, "-c", code.format(", keep_host_memory=True")],
                           capture_output=True, text=True, timeout=300)
    assert default.stdout.split()[-1] == "False", default.stderr[-2000:]
    glibc = platform.libc_ver()[0] == "glibc"
    assert asked.stdout.split()[-1] == str(glibc), asked.stderr[-2000:]
