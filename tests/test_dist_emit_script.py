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
