"""The `fitgraph` command: inspect on a small and a paper configuration, JSON and plot."""

from __future__ import annotations

import json

import pytest

from fitgraph.cli import main


def test_inspect_small_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "m.png"
    assert main(["inspect", "unet", "--json", "--plot", str(plot), "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["simulate_only"] is False
    assert out["simulated_peak_bytes"] == out["measured_peak_bytes"]
    assert abs(out["measured_peak_bytes"] - out["eager_peak_bytes"]) <= 0.05 * out["eager_peak_bytes"]
    assert out["time_prediction_ratio"] > 0
    assert {"weights", "activations"} <= set(out["breakdown"])
    assert out["top_tensors"] and out["top_tensors"][0]["module"] is not None
    assert plot.stat().st_size > 10_000


def test_inspect_paper_is_simulated_only(capsys):
    assert main(["inspect", "bert-base", "--config", "paper", "--device-model", "a100-80gb"]) == 0
    text = capsys.readouterr().out
    assert "simulate-only" in text and "meta device" in text
    assert "a100" in text.lower()


def test_inspect_text_table(capsys):
    assert main(["inspect", "vit-b16", "--optimizer", "sgd", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    for word in ("peak memory", "step time", "simulated / measured", "peak breakdown",
                 "largest tensors"):
        assert word in text


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["inspect", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["models"]])
def test_models_lists_zoo(argv, capsys):
    assert main(argv) == 0
    assert "gpt2" in capsys.readouterr().out


def test_optimize_json_csv_plot(tmp_path, capsys):
    import csv

    from fitgraph.report.magis_csv import MAGIS_COLUMNS

    out_csv, plot = tmp_path / "r.csv", tmp_path / "p.png"
    assert main(["optimize", "unet", "--budget", "0.9", "--repeats", "1", "--json",
                 "--csv", str(out_csv), "--plot", str(plot), "--time-budget", "10"]) == 0
    said = capsys.readouterr()
    assert "fitgraph: planning" not in said.err, "--json: no progress"
    out = json.loads(said.out)
    f, e = out["fitgraph"], out["eager"]
    assert f["measured_peak_bytes"] == f["simulated_peak_bytes"] <= out["budget_bytes"]
    assert e["measured_peak_bytes"] > out["budget_bytes"]
    rows = list(csv.DictReader(out_csv.open()))
    assert list(rows[0])[:len(MAGIS_COLUMNS)] == MAGIS_COLUMNS
    assert rows[0]["opt-is-prof-result"] == "True"
    assert plot.stat().st_size > 10_000


def test_optimize_infeasible_is_a_clear_error(capsys):
    # NOTE: an impossible budget makes auto's split_backward search up to SPLIT_BACKWARD_MIN_S
    # (U-Net at 10%: 210 s); ResNet-50's rounds end within seconds
    assert main(["optimize", "resnet50", "--budget", "1MB", "--time-budget", "5"]) == 2
    err = capsys.readouterr().err
    assert "smallest peak it reaches" in err
    assert "fitgraph: planning the step" in err and "fitgraph:     hotspot: " in err


@pytest.mark.slow  # NOTE: a long run; the law is held in the default tier too
def test_optimize_paper_simulated(capsys):
    assert main(["optimize", "bert-base", "--config", "paper", "--latency-limit", "1.1",
                 "--device-model", "a100-80gb", "--time-budget", "10"]) == 0
    assert "simulate-only" in capsys.readouterr().out
