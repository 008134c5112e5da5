"""`fitgraph optimize --optimizer-in-backward off|on|auto` reaches the plan; 'on' where it is
impossible is a clear error; ``fitgraph.OptimizerInBackwardError`` is public."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import fitgraph
from fitgraph import zoo
from fitgraph.cli import main

PAPER = ["optimize", "unet", "--config", "paper", "--latency-limit", "1.1", "--device-model",
         "rtx3090", "--time-budget", "2", "--optimizer", "sgd", "--json"]


def _run(argv, capsys) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_flag_reaches_the_plan(capsys):
    on = _run(PAPER + ["--optimizer-in-backward", "on"], capsys)
    off = _run(PAPER, capsys)
    params = len(list(zoo.build("unet", "paper", device="meta").model.parameters()))
    assert on["optimizer_in_backward"] == {"requested": "on", "status": "on",
                                           "parameters_updated_in_backward": params}
    assert off["optimizer_in_backward"] == {"requested": "off", "status": "off",
                                            "parameters_updated_in_backward": 0}
    # NOTE: gradients freed at their update: the in-backward step's eager peak is no higher
    assert on["eager"]["simulated_peak_bytes"] <= off["eager"]["simulated_peak_bytes"]
    assert main(PAPER[:-1] + ["--optimizer-in-backward", "on"]) == 0
    assert "optimizer-in-backward: on (" in capsys.readouterr().out


def test_on_without_an_update_is_a_clear_error_and_auto_says_off(capsys):
    argv = PAPER[:PAPER.index("--optimizer")] + ["--optimizer", "none", "--json"]
    assert main(argv + ["--optimizer-in-backward", "on"]) == 2
    err = capsys.readouterr().err
    assert "--optimizer-in-backward on needs an optimizer update" in err
    assert "--optimizer-in-backward auto" in err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = _run(argv + ["--optimizer-in-backward", "auto"], capsys)
    assert auto["optimizer_in_backward"]["status"].startswith("off: the step has no optimizer")


def test_error_is_exported_and_names_clipping():
    assert "OptimizerInBackwardError" in fitgraph.__all__
    assert issubclass(fitgraph.OptimizerInBackwardError, ValueError)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(fitgraph.OptimizerInBackwardError, match="clipping"):
        fitgraph.optimize(model, torch.randn(4, 8), lambda m, b: m(b).square().mean(), opt,
                          budget=1.0, clip_grad_norm=1.0, optimizer_in_backward=True,
                          cost_model="rtx3090")
