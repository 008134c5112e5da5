"""``fitgraph demo-train``: a real run, eager and fitgraph side by side, written as a PNG."""

from __future__ import annotations

import json

from fitgraph.cli import main
from fitgraph.demo_train import corpus_bytes


def test_the_corpus_ships_with_python():
    text = corpus_bytes()
    assert len(text) > 100_000 and b"assert" in text


def test_demo_train_writes_curves_that_agree_and_memory_within_the_plan(tmp_path, capsys):
    plot, results = tmp_path / "run.png", tmp_path / "run.json"
    assert main(["demo-train", "--steps", "12", "--batch", "4", "--seq", "128", "--layers", "2",
                 "--width", "64", "--meter-every", "4", "--time-budget", "5", "--solver",
                 "hotspot", "--plot", str(plot), "--results", str(results)]) == 0
    r = json.loads(results.read_text())
    assert len(r["loss"]["eager"]) == len(r["loss"]["fitgraph"]) == 12
    # NOTE: remat re-runs the same kernels and dropout masks are kept: the very same run
    assert r["loss"]["eager"] == r["loss"]["fitgraph"] and r["max_weight_diff"] == 0.0
    assert r["metered_steps"] == [4, 8] and r["never_above_plan"]
    # NOTE: law 2 over a run: each metered step's peak is the plan's simulated one, to the byte
    assert r["peak_bytes"]["fitgraph"] == [r["planned_peak_bytes"]] * 2
    assert max(r["peak_bytes"]["fitgraph"]) <= r["budget_bytes"] < min(r["peak_bytes"]["eager"])
    assert len(r["step_s"]["eager"]) == 10 and plot.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "final loss" in out and "equal to it, to the byte" in out
