"""fitgraph.backend with the whole portfolio (solver="auto"): a region's plan on a graph that
operator fission rewrote runs as forward/backward modules written from the plan
(``compile_backend.emit``), with eager's results (allclose: parts sum in another order) and
the simulated peak."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fitgraph
from fitgraph.compile_backend.emit import EmitError, check_emittable, phased
from fitgraph.execute.meter import MemoryMeter
from fitgraph.graph.deps import dependencies
from fitgraph.graph.ir import GraphBuilder, Phase, Role, ValueRef
from fitgraph.measure import resident_bytes
from fitgraph.plan.instructions import Compute, Offload, Plan

SLACK_BYTES = 256


# NOTE: every test compiles new modules (``conftest.fresh_dynamo``)
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _ConvStack(nn.Module):
    """A speech front-end as wav2vec2's: strided 1-D convolutions and GELUs over a waveform,
    whose activations (and convolution backwards' workspaces) dwarf its weights."""

    def __init__(self, ch: int = 32) -> None:
        super().__init__()
        layers, cin = [], 1
        for k, s in ((10, 5), (3, 2), (3, 2), (3, 2)):
            layers += [nn.Conv1d(cin, ch, k, s), nn.GELU()]
            cin = ch
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x[:, None]).mean()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow  # NOTE: a long run; the law is held in the default tier too
def test_fission_plans_run_in_a_compiled_region_with_eager_results_and_the_simulated_peak():
    torch.manual_seed(0)
    model, x = _ConvStack(), torch.randn(2, 8000)
    twin = copy.deepcopy(model)
    twin(x).backward()
    be = fitgraph.backend(budget="smallest", solver="auto", time_budget=10)
    step = torch.compile(model, backend=be, dynamic=False)
    loss = step(x)
    loss.backward()
    assert torch.allclose(loss, twin(x))
    for a, b in zip(_grads(model), _grads(twin)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    r = be.last_report
    assert r.notes.get("modules") == "emitted", r.notes
    assert r.notes.get("splits"), "the least peak of a conv stack is made in parts"
    assert r.planned_peak_bytes < 0.6 * r.eager_peak_bytes, r
    for p in model.parameters():
        p.grad = None
    with MemoryMeter() as meter:
        step(x).backward()
    measured = resident_bytes(model, x) + meter.peak_bytes
    assert abs(measured - r.planned_peak_bytes) <= SLACK_BYTES, (measured, r.planned_peak_bytes)


def test_hotspot_keeps_torchs_extraction_and_bitwise_results():
    torch.manual_seed(0)
    model, x = _ConvStack(), torch.randn(2, 8000)
    twin = copy.deepcopy(model)
    twin(x).backward()
    be = fitgraph.backend(budget="smallest", time_budget=10)
    step = torch.compile(model, backend=be, dynamic=False)
    step(x).backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(twin)))
    assert "modules" not in be.last_report.notes


def test_a_rewriting_solver_needs_aot_eager():
    with pytest.raises(ValueError, match="aot_eager"):
        fitgraph.backend(budget=0.5, solver="auto", inner="inductor")


def _joint_like():
    """x -> relu (forward); the tangent's backward: threshold_backward(t, y)."""
    b = GraphBuilder()
    x = b.add_input("input:x", (64, 64), "float32", Role.INPUT)
    t = b.add_input("tangent:t", (64, 64), "float32", Role.INPUT)
    y = b.add_node("aten.relu.default", [x], [((64, 64), "float32")])[0]
    s = b.add_node("aten.sin.default", [x], [((64, 64), "float32")])[0]
    g = b.add_node("aten.threshold_backward.default", [t, y], [((64, 64), "float32")],
                   phase=Phase.BACKWARD, args=(ValueRef(t), ValueRef(y), 0.0))[0]
    return b.finish({"out:0": y, "out:1": s, "grad:0": g},
                    meta={"backward_after_forward": True})


def test_the_backward_of_a_compiled_region_waits_for_its_whole_forward():
    g = _joint_like()
    deps = dependencies(g)
    # NOTE: threshold_backward reads relu's output, not sin's; it still runs after sin
    assert deps[2] >= {0, 1}


def test_plans_the_modules_cannot_run_are_refused_or_put_in_phase_order():
    g = _joint_like()
    early = Plan((Compute(0), Compute(2), Compute(1)))
    assert [i.node for i in phased(g, early)] == [0, 1, 2]
    check_emittable(g, phased(g, early))
    with pytest.raises(EmitError, match="offload"):
        check_emittable(g, Plan((Compute(0), Offload(g.values[g.nodes[0].outputs[0]].storage),
                                 Compute(1), Compute(2))))


def test_dropout_draws_once_in_a_region_planned_with_fission():
    # NOTE: random nodes are pinned (graph.meta["pinned"]): drawn once, in eager's order, so
    # the masks are eager's under the same seed
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Dropout(0.1), nn.Linear(512, 64),
                          nn.Dropout(0.1))
    twin, x = copy.deepcopy(model), torch.randn(512, 64)
    torch.manual_seed(1)
    want = twin(x).square().mean()
    want.backward()
    be = fitgraph.backend(budget="smallest", solver="auto", time_budget=5)
    torch.manual_seed(1)
    got = torch.compile(model, backend=be, dynamic=False)(x).square().mean()
    got.backward()
    assert torch.allclose(got, want)
    for a, b in zip(_grads(model), _grads(twin)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    r = be.last_report
    assert r.notes.get("modules") == "emitted" and r.planned_peak_bytes < r.eager_peak_bytes
