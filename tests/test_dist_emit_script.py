"""``fitgraph plan-dist ZOO_MODEL --emit-script FILE``: the plan and a torchrun script that
runs it, end to end — two gloo processes train, rank 0 prints the loss and every rank's
measured step and peak beside the plan's (the whole path a user follows)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fitgraph.cli import main
from fitgraph.dist.planner import DistPlan


def test_emitted_script_runs_the_plan_under_torchrun(tmp_path, capsys):
    script = tmp_path / "train_gpt2.py"
    code = main(["plan-dist", "gpt2", "--device", "cpu-generic", "--devices", "2",
                 "--global-batch", "4", "--batch", "2", "--fix", "pp=2,tp=1,dp=1,microbatch=1,"
                 "schedule=1f1b", "--emit-script", str(script)])
    assert code == 0
    out = capsys.readouterr().out
    assert "torchrun --nproc-per-node 2" in out
    plan = DistPlan.load(script.with_suffix(".plan.json"))
    assert plan.parallelism.pp == 2 and plan.cluster["intra"]["name"] == "gloo-loopback"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # NOTE: the time limit turns a hang into a failure
    run = subprocess.run([str(torchrun), "--nproc-per-node", "2", str(script), "--steps", "3"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 2: loss" in run.stdout
    table = run.stdout[run.stdout.index("rank stage"):].splitlines()
    assert len([line for line in table[1:] if line.split()[0].isdigit()]) == 2


def test_an_optimizer_is_priced_as_it_keeps_its_state_and_built_by_the_script(tmp_path,
                                                                               capsys):
    """``--optimizer muon``: planned with Muon's state for the linear weights beside AdamW's
    for the rest (``precision_of``, tested apart); whole matrices (tp 1, ZeRO <= 1); the
    script makes the same optimizer. A model by its shape has no parameters to price."""
    import pytest
    import torch

    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon")
    plans = {}
    for opt in ("adamw", "muon"):
        script = tmp_path / f"train_{opt}.py"
        assert main(["plan-dist", "gpt2", "--device", "cpu-generic", "--devices", "4",
                     "--global-batch", "8", "--batch", "2", "--optimizer", opt,
                     "--emit-script", str(script)]) == 0
        plans[opt] = DistPlan.load(script.with_suffix(".plan.json"))
        assert f"make_optimizer({opt!r}, case.model)" in script.read_text()
    capsys.readouterr()
    adamw, muon = plans["adamw"], plans["muon"]
    assert (adamw.precision, muon.precision) == ("float32-adam", "float32-muon+adam")
    assert muon.parallelism.tp == 1 and muon.parallelism.zero <= 1
    with pytest.raises(SystemExit, match="prices a zoo model's parameters"):
        main(["plan-dist", "gpt", "--layers", "2", "--hidden", "64", "--heads", "2",
              "--devices", "2", "--global-batch", "4", "--optimizer", "sgd"])
