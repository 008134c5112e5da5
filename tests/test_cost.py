"""Cost models: device registry, roofline, measured profiler and its SQLite cache."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import fitgraph
from fitgraph.cost import (
    DEVICES,
    CostCache,
    DeviceSpec,
    NodeCost,
    ProfiledCostModel,
    RooflineCostModel,
    cost_model_for,
    get_device,
)
from fitgraph.cost.cache import CacheEntry
from fitgraph.cost.profiler import NotProfiledError
from fitgraph.graph.analysis import new_storages
from fitgraph.graph.ir import GraphBuilder, Role

COST_DIR = Path(fitgraph.__file__).parent / "cost"
VIEW_TARGETS = {"aten.t.default", "aten.view.default", "aten.expand.default",
                "aten.detach.default", "aten.permute.default", "aten.slice.Tensor",
                "aten.select.int", "aten.unsqueeze.default", "aten._unsafe_view.default",
                "aten.alias.default", "aten.as_strided.default"}
ELEMENTWISE = {"aten.relu.default", "aten.threshold_backward.default", "aten.mul.Tensor",
               "aten.add.Tensor"}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FITGRAPH_CACHE_DIR", str(tmp_path / "cache"))


def _ce(m, b):
    return torch.nn.functional.cross_entropy(m(b[0]), b[1])


def _mlp_graph():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(64, 10))
    batch = (torch.randn(16, 32), torch.randint(0, 10, (16,)))
    return fitgraph.capture(model, batch, _ce, torch.optim.Adam(model.parameters()))


def _conv_graph():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(64, 10))
    batch = (torch.randn(8, 64, 56, 56), torch.randint(0, 10, (8,)))
    return fitgraph.capture(model, batch, _ce, torch.optim.SGD(model.parameters(), lr=0.1,
                                                                momentum=0.9))


# -- devices ------------------------------------------------------------------------------------
def test_torch_free_modules():
    for name in ("base.py", "devices.py", "roofline.py", "cache.py"):
        tree = ast.parse((COST_DIR / name).read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module or ""]
            assert not any(m.split(".")[0] == "torch" for m in mods), name


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_registered_devices_are_sane(name):
    d = get_device(name.upper())
    assert d is DEVICES[name] and d.name == name
    assert 4 * 2**30 <= d.memory_bytes <= 256 * 2**30
    assert 1e10 <= d.peak("float32") <= 1e15
    for dt in ("float16", "bfloat16"):
        assert d.peak(dt) >= d.peak("float32")
    assert d.peak("int64") == d.peak("float32")  # unknown dtype: the fp32 peak
    assert 1e9 <= d.mem_bandwidth <= 1e13 and 1e9 <= d.host_bandwidth <= d.mem_bandwidth
    assert 0 < d.kernel_overhead_s < 1e-4 and d.description


def test_gpu_numbers_match_datasheets():
    assert get_device("a100-80gb").peak("bfloat16") == 312e12
    assert get_device("h100").peak("float16") == pytest.approx(989.5e12)
    assert get_device("rtx3090").mem_bandwidth == 936e9
    assert get_device("A100-40GB").memory_bytes == 40 * 2**30


def test_unknown_device_lists_names():
    with pytest.raises(ValueError, match="h100") as e:
        get_device("tpu-v9")
    assert "cpu-generic" in str(e.value)
    with pytest.raises(ValueError, match="measured"):
        cost_model_for("tpu-v9")


def test_device_spec_validates_and_replaces():
    with pytest.raises(ValueError, match="float32"):
        DeviceSpec("x", 2**30, {"float16": 1e12}, 1e9, 1e9, 1e-6)
    half = get_device("h100").replace(flop_efficiency=0.5)
    assert half.peak("bfloat16") == pytest.approx(get_device("h100").peak("bfloat16") / 2)


# -- roofline -----------------------------------------------------------------------------------
def _mm_graph(sizes):
    b = GraphBuilder()
    ids = []
    for n in sizes:
        x = b.add_input(f"x{n}", (n, n), "float32", Role.INPUT)
        ids.append(b.add_node("aten.mm.default", [x, x], [((n, n), "float32")],
                              flops=2.0 * n**3)[0])
    g = b.finish({"loss": ids[-1]})
    for node, n in zip(g.nodes, sizes):
        node.bytes_moved = 3 * n * n * 4
    return g


def test_roofline_matmul_scales_with_flops():
    dev = get_device("a100-80gb")
    g = _mm_graph([2048, 4096, 8192])
    cm = RooflineCostModel(dev)
    t = [cm.node_cost(g, n).seconds - dev.kernel_overhead_s for n in g.nodes]
    assert t[1] / t[0] == pytest.approx(8) and t[2] / t[1] == pytest.approx(8)
    assert t[2] == pytest.approx(2 * 8192**3 / 19.5e12)
    tf32 = RooflineCostModel(dev, allow_tf32=True).node_cost(g, g.nodes[2]).seconds
    assert tf32 < t[2] / 7
    assert all(cm.node_cost(g, n).workspace_bytes == 0 for n in g.nodes)


def test_roofline_memory_bound_and_copies():
    dev = get_device("h100")
    b = GraphBuilder()
    x = b.add_input("x", (1 << 20,), "float32", Role.INPUT)
    y = b.add_node("aten.relu.default", [x], [((1 << 20,), "float32")])[0]
    g = b.finish({"loss": y})
    g.nodes[0].bytes_moved = 8 << 20
    cm = RooflineCostModel(dev)
    assert cm.node_cost(g, g.nodes[0]).seconds == pytest.approx(
        dev.kernel_overhead_s + (8 << 20) / dev.mem_bandwidth)
    assert cm.copy_seconds(63 * 10**9) == pytest.approx(1.0)
    assert cm.name == "h100 (roofline)"


def test_roofline_views_are_free_on_a_captured_graph():
    g = _mlp_graph()
    cm = RooflineCostModel(get_device("rtx3090"))
    costs = {n.id: cm.node_cost(g, n) for n in g.nodes}
    views = [n for n in g.nodes if n.target in VIEW_TARGETS]
    assert views
    assert all(costs[n.id] == NodeCost(0.0, 0) for n in views)
    for n in g.nodes:
        assert math.isfinite(costs[n.id].seconds) and costs[n.id].seconds >= 0
        if n.target not in VIEW_TARGETS:
            assert costs[n.id].seconds > 0, n.target
    mm = [n for n in g.nodes if n.target == "aten.addmm.default"]
    assert costs[mm[0].id].seconds > get_device("rtx3090").kernel_overhead_s


def test_cost_model_for():
    assert isinstance(cost_model_for("H100"), RooflineCostModel)
    m = cost_model_for("measured")
    assert isinstance(m, ProfiledCostModel) and m.device.type in ("cpu", "cuda")
    assert isinstance(cost_model_for("measured:cpu"), ProfiledCostModel)


# -- profiler -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    cache = tmp_path_factory.mktemp("costs")
    graphs = {"mlp": _mlp_graph(), "conv": _conv_graph()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FITGRAPH_CACHE_DIR", str(cache))
        cm = ProfiledCostModel(repeats=2, warmup=1, progress=False)
        rng = torch.get_rng_state()
        counts = {k: cm.profile(g) for k, g in graphs.items()}
        rng_unchanged = torch.equal(rng, torch.get_rng_state())
    return cm, graphs, counts, rng_unchanged, cache


def test_profile_costs_every_node(profiled):
    cm, graphs, counts, _, _ = profiled
    for g in graphs.values():
        for n in g.nodes:
            c = cm.node_cost(g, n)
            assert c.seconds > 0 and c.workspace_bytes >= 0, n.name
    assert counts["mlp"] > 0 and counts["conv"] > 0
    # NOTE: nodes with equal signatures (detach, t, the adam updates of same-shape params) share
    assert counts["mlp"] < len(graphs["mlp"].nodes)


def test_second_profile_is_a_cache_hit(profiled):
    cm, graphs, _, _, cache = profiled
    assert cm.profile(graphs["mlp"]) == 0
    fresh = ProfiledCostModel(cache=cache, progress=False)  # NOTE: persisted, new process-alike
    assert all(fresh.profile(g) == 0 for g in graphs.values())
    g = graphs["conv"]
    assert [fresh.node_cost(g, n) for n in g.nodes] == [cm.node_cost(g, n) for n in g.nodes]


def test_profiling_keeps_the_rng_stream(profiled):
    _, graphs, _, rng_unchanged, _ = profiled
    assert rng_unchanged
    assert any(n.random for n in graphs["mlp"].nodes)  # dropout's bernoulli ran


def test_conv_workspace_and_elementwise_outputs(profiled):
    cm, graphs, _, _, _ = profiled
    g = graphs["conv"]
    conv = next(n for n in g.nodes if n.target == "aten.convolution.default")
    assert cm.node_cost(g, conv).workspace_bytes > 0
    fresh = new_storages(g)
    seen = set()
    for gg in graphs.values():
        for n in gg.nodes:
            if n.target in ELEMENTWISE:
                m = cm.measurement(gg, n)
                assert m.workspace_bytes == 0, n.name
                assert m.end_bytes == m.fresh_bytes > 0, n.name
                seen.add(n.target)
    assert {"aten.relu.default", "aten.threshold_backward.default"} <= seen
    m = cm.measurement(g, conv)
    assert m.fresh_bytes == sum(g.storages[s].nbytes for s in fresh[conv.id]) == 8 * 64 * 56 * 56 * 4
    assert not m.alias_mismatch


def test_views_cost_little_and_allocate_nothing(profiled):
    cm, graphs, _, _, _ = profiled
    g = graphs["mlp"]
    for n in g.nodes:
        if n.target in VIEW_TARGETS:
            m = cm.measurement(g, n)
            assert m.end_bytes == m.fresh_bytes == 0 and m.workspace_bytes == 0
            assert m.seconds < 1e-3


def test_optimizer_nodes_profile(profiled):
    cm, graphs, _, _, _ = profiled
    for g in graphs.values():
        opt = [n for n in g.nodes if n.target.startswith("fitgraph.optimizer.")]
        assert opt
        for n in opt:
            m = cm.measurement(g, n)
            assert m.seconds > 0 and not m.alias_mismatch, n.name
    assert cm.alias_mismatches(graphs["mlp"]) == []


def test_unprofiled_node_names_itself(tmp_path):
    cm = ProfiledCostModel(cache=tmp_path, progress=False)
    g = _mlp_graph()
    with pytest.raises(NotProfiledError, match=r"\.profile\(graph\)") as e:
        cm.node_cost(g, g.nodes[0])
    assert g.nodes[0].name in str(e.value) and isinstance(e.value, KeyError)


def test_key_holds_threads_and_ignores_value_ids(tmp_path):
    cm = ProfiledCostModel(cache=tmp_path, progress=False)
    g = _mlp_graph()
    dets = [n for n in g.nodes if n.target == "aten.t.default"]
    key = cm.key(g, dets[0])
    n0 = torch.get_num_threads()
    try:
        torch.set_num_threads(n0 + 1)
        assert cm.key(g, dets[0]) != key
        assert f"{n0 + 1} threads" in cm.name
    finally:
        torch.set_num_threads(n0)
    assert cm.key(g, dets[0]) == key
    # NOTE: the same op on the same layout keys equal, whatever the value ids
    def layout(n):
        return [(v.shape, v.stride, v.storage_offset, v.dtype)
                for v in (g.values[i] for i in n.inputs)]

    for a in dets:
        for b in dets:
            assert (cm.key(g, a) == cm.key(g, b)) == (layout(a) == layout(b))
    assert len({cm.key(g, n) for n in dets}) < len(dets)
    assert cm.name.startswith("cpu (measured, torch ")


def test_copy_seconds_measured_once(profiled):
    cm, _, _, _, cache = profiled
    small, big = cm.copy_seconds(1 << 10), cm.copy_seconds(1 << 30)
    assert 0 < small < big < 100 and cm.copy_seconds(0) == 0
    other = ProfiledCostModel(cache=cache, progress=False)
    assert other.copy_seconds(1 << 30) == big  # NOTE: from the cache, not re-measured


def test_cache_is_shared_between_instances(tmp_path):
    a, b = CostCache(tmp_path), CostCache(tmp_path / "costs.sqlite")
    assert a.path == b.path
    a.put("k1", CacheEntry(0.5, 7, 9), device="cpu", torch_version="x", target="aten.relu")
    assert b.get("k1") == CacheEntry(0.5, 7, 9) and b.get("nope") is None
    b.put("k1", CacheEntry(0.25, 0, 9), device="cpu", torch_version="x")
    assert a.get_many(["k1", "k2"]) == {"k1": CacheEntry(0.25, 0, 9)} and len(a) == 1
    a.clear()
    assert len(b) == 0


def test_alias_mismatch_is_recorded(tmp_path):
    # NOTE: an IR that wrongly says relu's output is a view of its input: the real op allocates
    b = GraphBuilder()
    x = b.add_input("x", (256,), "float32", Role.INPUT)
    y = b.add_node("aten.relu.default", [x], [((256,), "float32")], alias_of={0: x})[0]
    z = b.add_node("aten.neg.default", [y], [((256,), "float32")])[0]
    g = b.finish({"loss": z})
    cm = ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0, progress=False)
    assert cm.profile(g) == 2
    bad = cm.alias_mismatches(g)
    assert [(n.target, m.end_bytes, m.fresh_bytes) for n, m in bad] == [
        ("aten.relu.default", 1024, 0)]
    assert cm.node_cost(g, g.nodes[0]).workspace_bytes == 1024
    assert cm.measurement(g, g.nodes[1]).workspace_bytes == 0


def test_refresh_measures_again_and_overwrites(tmp_path):
    import torch

    import fitgraph
    from fitgraph.cost import ProfiledCostModel

    m = torch.nn.Linear(8, 8)
    g = fitgraph.capture(m, torch.randn(4, 8), lambda m, b: m(b).sum())
    assert ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0, progress=False).profile(g) > 0
    assert ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0, progress=False).profile(g) == 0
    fresh = ProfiledCostModel(cache=tmp_path, repeats=1, warmup=0, progress=False, refresh=True)
    n = fresh.profile(g)
    assert n > 0 and fresh.profile(g) == 0
