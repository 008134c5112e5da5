"""``python -m fitgraph.bench.fission_wins --budgets``: one row per model and budget."""

from __future__ import annotations

from fitgraph.bench import fission_wins


def test_budget_table_has_a_row_per_model_and_budget(capsys):
    assert fission_wins.main(["--models", "llama", "--config", "small", "--budgets", "0.5",
                              "--time-budget", "20"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| llama")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[:2] == ["llama (small)", "50%"]
    # NOTE: Llama's small config at half its peak: remat alone cannot fit it, fission can
    assert cells[2] == "infeasible" and float(cells[3]) < 1.2 and "_log_softmax" in cells[5]
