"""``cost_model=`` means the same to ``optimize``, ``fitgraph.backend`` and ``inspect_step``: one
function (``cost.choose_cost_model``) reads it. ``optimize(cost_model="measured")`` once raised
``unknown device 'measured'`` while the backend accepted it, and a ``DeviceSpec`` passed to
``optimize`` failed later in planning."""

from __future__ import annotations

import pytest
import torch

import fitgraph
from fitgraph.cost import ProfiledCostModel, RooflineCostModel, choose_cost_model, get_device


def _case():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    return model, torch.randn(16, 8), lambda m, x: m(x).square().mean()


@pytest.mark.parametrize("spec, kind, name", [
    ("measured", ProfiledCostModel, None),
    ("cpu-generic", RooflineCostModel, "cpu-generic (roofline)"),
    (get_device("h100"), RooflineCostModel, "h100 (roofline)"),
])
def test_optimize_and_backend_read_cost_model_alike(spec, kind, name):
    model, x, loss_fn = _case()
    step = fitgraph.optimize(model, x, loss_fn, latency_limit=1.5, time_budget=2,
                              cost_model=spec)
    assert isinstance(step.cost_model, kind)
    if name is not None:
        assert step.report().cost_model == name
    loss = step(x)
    assert torch.isfinite(loss)
    be = fitgraph.backend(latency_limit=1.5, time_budget=2, cost_model=spec)
    compiled = torch.compile(_case()[0], backend=be)
    compiled(x).square().mean().backward()
    assert isinstance(be.cost_model, kind)
    assert be.last_report.cost_model.startswith(step.report().cost_model.split(" ")[0])


def test_a_cost_model_object_is_used_as_given_and_a_wrong_spec_is_named():
    cm = RooflineCostModel(get_device("a100-80gb"))
    assert choose_cost_model(cm) is cm
    with pytest.raises(ValueError, match="unknown cost model 'banana'.*measured"):
        choose_cost_model("banana")
    with pytest.raises(TypeError, match="cost_model=3"):
        choose_cost_model(3)
