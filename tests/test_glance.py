"""The at-a-glance numbers: wins, the short table and planning times, from rows."""

from __future__ import annotations

from fitgraph.bench.glance import in_short, planning_times, wins
from fitgraph.bench.harness import BenchRow


def _rows():
    return [BenchRow("m", "eager", None, 100, 1.0),
            BenchRow("m", "checkpoint", None, 60, 1.4),
            BenchRow("m", "compile_aot_eager", 0.5, 70, 1.2, prepare_s=9.0),
            BenchRow("m", "checkmate", 0.5, 55, 1.3, solve_s=30.0),
            BenchRow("m", "dtr", 0.5, 50, 1.5, solve_s=0.05),
            BenchRow("m", "fitgraph", None, 60, 1.2, matched="checkpoint", solve_s=2.0),
            BenchRow("m", "fitgraph", None, 70, 1.25, matched="compile_aot_eager 0.5",
                     solve_s=2.0),
            BenchRow("m", "fitgraph", None, 55, 1.1, matched="checkmate 0.5", solve_s=2.5),
            BenchRow("m", "fitgraph", None, None, None, matched="dtr 0.5",
                     error="BudgetInfeasible: budget 50 B"),
            BenchRow("m", "fitgraph", 0.5, 50, 1.3, solve_s=3.0)]


def test_wins_count_planned_peers_only():
    # NOTE: wins at checkpoint and checkmate, loses at compile; did not plan at dtr's peak
    assert wins(_rows()) == (2, 3)


def test_in_short_row_reads_the_rows():
    row = in_short(_rows()).splitlines()[2]
    assert row == "| m | 0.60×, +40% | 0.60×, +20% | 0.70×, +20% | 0.70×, +25% | 0.50×, +30% |"


def test_planning_times_pair_each_planner_with_fitgraph_at_its_peak():
    got = {p["planner"]: p for p in planning_times(_rows())}
    assert got["checkmate"]["ratio"] == 2.5 / 30.0
    assert got["dtr"]["fitgraph_s"] is None and got["dtr"]["ratio"] is None
