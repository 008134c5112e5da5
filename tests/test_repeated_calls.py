"""A block called more than once (ALBERT's one shared layer run four times, a weight-tied
loop): each call is a block of its own. Before, every call had the same module path, so the
planners saw one block spanning all calls: checkpointing it dropped every call's insides and
re-made them all at once in the backward, keeping nothing off the peak."""

from __future__ import annotations

import copy

import torch

import fitgraph
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.graph.ir import Phase
from fitgraph.solvers import Problem, solve
from fitgraph.solvers.remat.blocks import block_drop_sets, blocks_of
from tests.helpers import assert_bitwise_equal_models, eager_step


class _Layer(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _Group(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(d)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Shared(torch.nn.Module):
    """ALBERT's shape: one group of one layer, run ``calls`` times."""

    def __init__(self, d: int = 32, calls: int = 4):
        super().__init__()
        self.calls = calls
        self.groups = torch.nn.ModuleList([_Group(d)])
        self.head = torch.nn.Linear(d, 8)

    def forward(self, x):
        for _ in range(self.calls):
            x = self.groups[0](x)
        return self.head(x)


def _loss(m, b):
    return torch.nn.functional.cross_entropy(m(b["x"]), b["y"])


def _case():
    torch.manual_seed(0)
    batch = {"x": torch.randn(64, 32), "y": torch.randint(0, 8, (64,))}
    return _Shared(), batch


def test_blocks_of_a_repeated_call():
    assert blocks_of("groups.0@2.layers.0.up") == ["groups.0@2", "groups.0@2.layers.0"]
    assert blocks_of("groups.0.layers.0.up") == ["groups.0", "groups.0.layers.0"]


def test_each_call_of_a_shared_block_is_its_own_block():
    model, batch = _case()
    g = fitgraph.capture(model, batch, _loss)
    forward = {n.module for n in g.nodes if n.phase is Phase.FORWARD}
    assert {"groups.0.layers.0.up", "groups.0@1.layers.0.up", "groups.0@3.layers.0.down"} <= forward
    # NOTE: the backward of a call is labelled with that call too (rotor's stages read it)
    backward = {n.module for n in g.nodes if n.phase is Phase.BACKWARD}
    assert "groups.0@3.layers.0.down" in backward and "groups.0.layers.0.up" in backward
    assert list(block_drop_sets(g)) == ["groups.0", "groups.0@1", "groups.0@2", "groups.0@3"]


def test_checkpointing_each_call_lowers_the_peak_and_keeps_eagers_results():
    model, batch = _case()
    g = fitgraph.capture(model, batch, _loss)
    cm = RooflineCostModel(get_device("cpu-generic"))
    eager = solve(Problem(g, cm, latency_limit=1e9), "eager").sim
    blocks = solve(Problem(g, cm, latency_limit=1e9), "checkpoint_blocks").sim
    # NOTE: one block over all four calls re-made them all at once: no lower than eager's
    # peak; a block per call keeps one call's insides at a time (0.32x of eager's
    # activations here)
    kept = blocks.breakdown["activations"] / eager.breakdown["activations"]
    assert kept < 0.5, (eager.breakdown, blocks.breakdown)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    oa, ob = torch.optim.AdamW(a.parameters()), torch.optim.AdamW(b.parameters())
    step = fitgraph.optimize(b, batch, _loss, ob, solver="checkpoint_blocks",
                             latency_limit=100.0, cost_model="cpu-generic", exact=True)
    assert step.report().solver == "checkpoint_blocks"
    for seed in range(2):
        la = eager_step(a, batch, _loss, oa, seed=seed)
        torch.manual_seed(seed)
        assert torch.equal(la, step(batch))
        assert_bitwise_equal_models(a, b, oa, ob)
        oa.zero_grad(set_to_none=True)
        ob.zero_grad(set_to_none=True)


def test_torch_compile_route_labels_each_call_too():
    """The compile backend reads Dynamo's ``nn_module_stack``, whose keys mark the k-th call
    of a module ``@k``: its graphs have a block per call as well."""
    from fitgraph.capture.joint import module_path
    from fitgraph.solvers.remat.blocks import block_of

    model, batch = _case()
    paths: set[str] = set()

    def backend(gm, example_inputs):
        paths.update(module_path(n) for n in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, dynamic=False)(batch["x"])
    torch._dynamo.reset()
    assert {block_of(p) for p in paths} - {None} == {
        "groups.0", "groups.0@1", "groups.0@2", "groups.0@3"}, sorted(paths)
    assert "head" in paths
