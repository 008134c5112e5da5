"""The backend by name: ``torch.compile(model, backend="fitgraph", options={...})``, found
through torch's entry point, with every ``fitgraph.backend`` option reachable."""

from __future__ import annotations

import copy
import json
from importlib.metadata import entry_points

import pytest
import torch
from test_compile_backend import _assert_same, _batch, _step, mlp, mlp_loss

import fitgraph
from fitgraph.compile_backend.by_name import ENV_OPTIONS, named_backend

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_the_name_is_registered_through_torchs_entry_point():
    names = [ep.name for ep in entry_points(group="torch_dynamo_backends")]
    assert "fitgraph" in names
    assert "fitgraph" in torch._dynamo.list_backends(exclude_tags=())


def test_by_name_plans_within_the_budget_with_eager_gradients():
    model, batch = mlp(), _batch()
    twin = copy.deepcopy(model)
    options = {"budget": "80%", "time_budget": 10, "solver": "hotspot"}
    compiled = torch.compile(twin, backend="fitgraph", options=options, dynamic=False)
    for seed in range(2):
        la = _step(model, list(model.parameters()), batch, mlp_loss, seed)
        lb = _step(compiled, list(twin.parameters()), batch, mlp_loss, seed)
        assert torch.equal(la, lb)
        _assert_same(model, twin)
    be = named_backend(options)
    assert isinstance(be, fitgraph.FitgraphBackend) and len(be.reports) == 1
    r = be.last_report
    assert r.planned_peak_bytes <= r.budget_bytes == int(0.8 * r.eager_peak_bytes)
    assert r.recomputed_nodes > 0


def test_every_backend_option_is_reachable_and_unknown_ones_are_named():
    options = {"latency_limit": 1.3, "solver": "auto", "time_budget": 7.0, "inner": "aot_eager",
               "dynamic_shapes": "unplanned", "cost_model": "a100-80gb"}
    be = named_backend(options)
    assert (be.latency_limit, be.solver, be.time_budget, be.inner, be.dynamic_shapes,
            be.cost_model) == (1.3, "auto", 7.0, "aot_eager", "unplanned", "a100-80gb")
    assert named_backend(options) is be, "one backend per options dict"
    with pytest.raises(TypeError, match="unknown fitgraph backend option.*'budjet'"):
        named_backend({"budjet": 0.5})
    model = torch.nn.Linear(8, 8)
    compiled = torch.compile(model, backend="fitgraph", mode="max-autotune")
    with pytest.raises(Exception, match="modes are inductor's"):
        compiled(torch.randn(4, 8)).sum().backward()


def test_the_environment_gives_options_where_a_tool_passes_none(monkeypatch):
    monkeypatch.setenv(ENV_OPTIONS, json.dumps({"budget": 0.8, "time_budget": 10}))
    model, batch = mlp(depth=4), _batch()
    compiled = torch.compile(copy.deepcopy(model), backend="fitgraph", dynamic=False)
    mlp_loss(compiled, batch).backward()
    r = named_backend().last_report
    assert r.budget_bytes == int(0.8 * r.eager_peak_bytes) >= r.planned_peak_bytes
    monkeypatch.setenv(ENV_OPTIONS, "{budget: 1}")
    with pytest.raises(ValueError, match="not JSON"):
        named_backend()
