"""bench.magis_table: a row per constraint × solver (none dropped), MAGIS's columns, the
paper's ranges quoted with a verdict; one small model, a tiny time budget."""

from __future__ import annotations

import csv

from fitgraph.bench.magis_table import (
    CONSTRAINTS,
    SOLVERS,
    Constraint,
    capture_case,
    main,
    paper_range,
    verdict,
)
from fitgraph.report.magis_csv import MAGIS_COLUMNS


def test_table_has_every_constraint_and_solver(tmp_path, capsys):
    out_csv = tmp_path / "magis.csv"
    assert main(["--models", "unet", "--config", "small", "--time-budget", "0.3",
                 "--csv", str(out_csv)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| model | constraint | solver"))
    assert all(f" {c} |" in header for c in MAGIS_COLUMNS)
    rows = list(csv.DictReader(out_csv.open()))
    assert list(rows[0])[:len(MAGIS_COLUMNS)] == MAGIS_COLUMNS
    assert [(r["constraint"], r["solver"]) for r in rows] == [
        (c.label, s) for c in CONSTRAINTS for s in SOLVERS]
    for r in rows:
        assert r["status"] in ("ok", "infeasible", "error"), r
        assert r["opt-is-prof-result"] == "False" and r["ori-simul-memory"]
        if r["status"] == "error":
            continue
        # NOTE: infeasible rows carry the smallest peak reached, never an empty cell
        assert int(r["opt-simul-memory"]) > 0
        if r["memory limit ratio"]:
            assert r["status"] == "infeasible" or int(r["opt-simul-memory"]) <= int(r["memory limit"])
        else:
            assert r["status"] == "ok"
            assert float(r["opt-simul-latency"]) <= float(r["latency limit"]) * (1 + 1e-9)
    summary = [line for line in lines if line.startswith("| unet (small) |")]
    assert [line.split(" | ")[1] for line in summary] == [c.label for c in CONSTRAINTS]
    assert all("not in ANCHORS.md" in line or "%" in line for line in summary)
    assert "the paper's workload: U-Net b32 256²" in text


def test_paper_ranges_and_verdicts():
    lat10, lat05, mem8 = Constraint("latency", 1.10), Constraint("latency", 1.05), CONSTRAINTS[0]
    assert paper_range("resnet50", lat10).model == ("ResNet-50 80–85% (“of baselines”)", 0.8, 0.85)
    assert "not in ANCHORS.md" in paper_range("llama", lat10).text
    assert "not in ANCHORS.md" in paper_range("unet", lat05).text
    bert = paper_range("bert-base", lat10)
    assert verdict(lat10, bert, peak=0.55, latency=1.1) == (
        "inside the paper’s 15–60%; per model: inside the paper’s 50–70%")
    assert verdict(lat10, bert, peak=0.65, latency=1.1) == (
        "outside: 65% > the paper’s 15–60%; per model: inside the paper’s 50–70%")
    assert verdict(lat05, paper_range("gpt2", lat05), peak=0.2, latency=1.0).startswith("below")
    assert verdict(mem8, paper_range("bert-base", mem8), peak=0.8, latency=1.04).startswith("inside")
    assert verdict(mem8, paper_range("bert-base", mem8), peak=0.8, latency=1.2).startswith("outside")
    assert verdict(mem8, paper_range("bert-base", mem8), None, None).startswith("no fitgraph plan")


def test_capture_too_slow_falls_back_to_small():
    graph, config, _, note = capture_case("unet", "paper", limit_s=1e-4)
    assert config == "small" and "took over" in note and "small config used" in note
    assert len(graph.nodes) > 0
