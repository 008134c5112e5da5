"""Law 2 with graph constants: the tensors a captured graph holds (Python numbers written into
tensors become ``const:`` inputs) exist before the step, in the measured peak as in the
simulated one."""

from __future__ import annotations

import torch
from test_fission import assert_simulator_tells_truth

import fitgraph
from fitgraph.measure import constant_bytes


class Tabled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        table = torch.zeros(16, 16, dtype=torch.long)
        table[0] = 3          # NOTE: Python numbers written in place: lifted constants
        table[1:, 0] = 5
        return self.lin(x) * (1 + table)


def _loss(m, x):
    return m(x).square().mean()


def test_graph_constants_count_as_resident_when_measured():
    model, x = Tabled(), torch.randn(8, 16, 16)
    g = fitgraph.capture(model, x, _loss)
    assert constant_bytes(g) > 0
    assert_simulator_tells_truth(g, model, x)
    step = fitgraph.optimize(model, x, _loss, budget="smallest", solver="hotspot",
                             time_budget=3)
    step(x)
    r = step.report()
    assert r.measured_peak_bytes == r.planned_peak_bytes
