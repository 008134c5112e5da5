"""The side-by-side harness: every system runs, compile variants are compiled fresh, errors kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from fitgraph.bench.harness import bench_model, checkpointed, verdicts
from fitgraph.cli import main


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.act = nn.Linear(256, 256), nn.GELU()

    def forward(self, x):
        return self.act(self.lin(x))


@dataclass
class Case:
    name: str
    model: nn.Module
    batch: object
    loss_fn: object
    block_types: tuple


def _case():
    torch.manual_seed(0)
    return Case("mlp", nn.Sequential(*[Block() for _ in range(6)]), torch.randn(512, 256),
                lambda m, b: m(b).square().mean(), (Block,))


def test_bench_rows_for_every_system_and_fresh_compiles():
    rows = bench_model(_case(), [1.0, 0.75, 0.05], repeats=2, progress=lambda s: None)
    systems = [(r.system, r.budget) for r in rows if not r.matched]
    assert systems == [("eager", None), ("checkpoint_blocks", None), ("fitgraph", 1.0),
                       ("fitgraph", 0.75), ("fitgraph", 0.05), ("compile_aot_eager", 1.0),
                       ("compile_aot_eager", 0.75), ("compile_aot_eager", 0.05)]
    matched = {r.matched: r for r in rows if r.matched}
    assert sorted(matched) == ["checkpoint_blocks", "compile_aot_eager 0.05",
                               "compile_aot_eager 0.75", "compile_aot_eager 1"]
    by = {(r.system, r.budget): r for r in rows if not r.matched}
    for label, r in matched.items():  # fitgraph asked for the peer's measured peak keeps it
        name, _, budget = label.partition(" ")
        peer = by[(name, float(budget) if budget else None)]
        assert r.system == "fitgraph" and (r.error or r.peak_bytes <= peer.peak_bytes)
    lines = verdicts(rows)
    assert len(lines) == 4 and all(("wins" in s) or ("loses" in s) or ("did not plan" in s)
                                   for s in lines)
    eager = by[("eager", None)]
    assert by[("checkpoint_blocks", None)].peak_bytes < eager.peak_bytes
    assert by[("fitgraph", 0.75)].peak_bytes <= 0.75 * eager.peak_bytes
    # fresh compiles: budget 0.75 saves memory against 1.0 (a reused graph would not)
    assert by[("compile_aot_eager", 0.75)].peak_bytes < by[("compile_aot_eager", 1.0)].peak_bytes
    assert by[("fitgraph", 0.05)].error.startswith("BudgetInfeasible")
    assert all(r.step_s is not None for r in rows if not r.error)


def test_checkpointed_wraps_blocks_and_keeps_results():
    case = _case()
    wrapped = checkpointed(case.model, case.block_types)
    assert sum(type(m).__name__ == "_Checkpointed" for m in wrapped.modules()) == 6
    torch.testing.assert_close(wrapped(case.batch), case.model(case.batch), rtol=0, atol=0)


def test_bench_cli_writes_csv_and_plot(tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["bench", "--models", "unet", "--budgets", "0.8", "--repeats", "1",
                 "--no-compile", "--out", str(out), "--time-budget", "10"]) == 0
    text = capsys.readouterr().out
    assert "| unet | fitgraph | 0.8 |" in text
    assert (out / "bench.csv").stat().st_size > 0 and (out / "unet.png").stat().st_size > 5000
