"""The multi-device plan as saved and as the CLI shows it (``fitgraph.dist.plan``,
``fitgraph plan-dist``): the JSON round trip and its required keys, every device in exactly one
stage, the CLI's text, JSON, --fix, --plot, --save, presets and refusals, and the A100
calibration re-derived.
"""

from __future__ import annotations

import json
import re

import pytest

from fitgraph.cli import main
from fitgraph.dist.calibration import (
    A100_FLOP_EFFICIENCY,
    calibrate_flop_efficiency,
    calibrated_device,
)
from fitgraph.dist.cluster import dgx_a100
from fitgraph.dist.config import Parallelism
from fitgraph.dist.megatron_table import TABLE1, GptShape
from fitgraph.dist.planner import FORMAT, VERSION, DistPlan, plan

SHAPE = GptShape(8, 1024, 16, seq=512)
GPT = ["plan-dist", "gpt", "--layers", "8", "--hidden", "1024", "--heads", "16", "--seq", "512",
       "--devices", "8", "--global-batch", "16"]
FIXED = {"tp": 2, "pp": 2, "dp": 2, "micro_batch": 1, "schedule": "1f1b"}


@pytest.fixture(scope="module")
def searched():
    return plan(SHAPE, dgx_a100(1), 16)


@pytest.fixture(scope="module")
def fixed():
    return plan(SHAPE, dgx_a100(1), 16, fix=FIXED)


def _check_required_keys(data: dict) -> None:
    """The keys the issue requires of a saved plan."""
    assert isinstance(data["plan_s"], float) and data["plan_s"] >= 0
    for key in ("step_s", "tflops_per_device", "peak_bytes_per_device"):
        assert data["predicted"][key] > 0
    par = data["parallelism"]
    for key in ("pp", "tp", "dp", "zero", "microbatch", "n_microbatches"):
        assert isinstance(par[key], int)
    assert isinstance(par["schedule"], str)
    assert par["pp"] == len(data["stages"])
    devices = par["pp"] * par["tp"] * par["dp"]
    assert data["cluster"]["devices"] == devices
    assert par["dp"] * par["microbatch"] * par["n_microbatches"] == data["global_batch"]
    for stage in data["stages"]:
        assert stage["blocks"] and all(isinstance(b, str) for b in stage["blocks"])
        assert stage["devices"] and all(isinstance(d, int) for d in stage["devices"])
        assert stage["peak_bytes"] > 0
        assert sum(stage["memory_plan"].values()) == len(stage["blocks"])
        assert stage["peak_bytes"] == pytest.approx(sum(stage["memory"].values()), rel=1e-12)
    assert data["predicted"]["peak_bytes_per_device"] == max(
        s["peak_bytes"] for s in data["stages"])
    # every device in exactly one stage
    ranks = sorted(d for s in data["stages"] for d in s["devices"])
    assert ranks == list(range(devices))
    # the model's blocks, each in exactly one stage, in order
    blocks = [b for s in data["stages"] for b in s["blocks"]]
    assert blocks[0] == "embedding" and blocks[-1] == "head" and len(blocks) == len(set(blocks))


def test_the_json_has_the_required_keys(searched, fixed):
    for p in (searched, fixed):
        data = json.loads(json.dumps(p.to_json()))
        assert (data["format"], data["version"]) == (FORMAT, VERSION)
        _check_required_keys(data)
    assert fixed.to_json()["parallelism"]["pp"] == 2


def test_json_round_trip(fixed):
    data = json.loads(json.dumps(fixed.to_json()))
    back = DistPlan.from_json(data)
    assert back.parallelism == fixed.parallelism
    assert back.stages == fixed.stages
    assert back.predicted == fixed.predicted
    assert (back.model, back.cluster, back.global_batch, back.seq, back.precision, back.fits,
            back.binding, back.plan_s) == (fixed.model, fixed.cluster, fixed.global_batch,
                                           fixed.seq, fixed.precision, fixed.fits,
                                           fixed.binding, fixed.plan_s)
    assert back.to_json() == data


def test_save_and_load(fixed, tmp_path):
    path = fixed.save(tmp_path / "plan.json")
    assert path.exists()
    loaded = DistPlan.load(path)
    assert loaded.parallelism == fixed.parallelism and loaded.stages == fixed.stages
    assert loaded.predicted == fixed.predicted
    assert loaded.to_json() == json.loads(path.read_text())


def test_a_foreign_or_newer_file_is_refused(fixed):
    data = fixed.to_json()
    with pytest.raises(ValueError, match=r"not a fitgraph multi-device plan \(format 'x'\)"):
        DistPlan.from_json({**data, "format": "x"})
    with pytest.raises(ValueError, match="not a fitgraph multi-device plan"):
        DistPlan.from_json({k: v for k, v in data.items() if k != "format"})
    with pytest.raises(ValueError, match=rf"plan version 2: this fitgraph reads version {VERSION}"):
        DistPlan.from_json({**data, "version": 2})


@pytest.mark.parametrize("fix", [{"pp": 1}, {"pp": 4}, {"pp": 8, "tp": 1},
                                 {"tp": 2, "pp": 2, "dp": 2, "micro_batch": 2,
                                  "schedule": "interleaved"}], ids=str)
def test_every_device_is_in_exactly_one_stage(fix):
    p = plan(SHAPE, dgx_a100(1), 16, fix=fix)
    _check_required_keys(p.to_json())
    par = p.parallelism
    for s in p.stages:
        # Megatron's layout: a stage's tp x dp devices are contiguous ranks
        assert s["devices"] == list(range(s["index"] * par.tp * par.dp,
                                          (s["index"] + 1) * par.tp * par.dp))


def test_a_pinned_configuration_is_that_configuration(fixed):
    par = fixed.parallelism
    assert par == Parallelism(tp=2, pp=2, dp=2, micro_batch=1, n_micro=8, schedule="1f1b")
    assert fixed.search == {}            # predicted, not searched


# -- the CLI ----------------------------------------------------------------------------------


def test_cli_text_report(capsys):
    assert main(GPT) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for head in ("parallelism", "step", "peak memory"):
        assert any(line.startswith(head) for line in lines), head
    assert re.search(r"^parallelism\s+tp \d+ x pp \d+ x dp \d+", out, re.M)
    assert re.search(r"^step\s+[\d.]+ s", out, re.M)
    assert re.search(r"^peak memory\s+[\d.]+ GiB per device", out, re.M)
    assert "8 x a100-80gb" in out


def test_cli_json(capsys):
    assert main([*GPT, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    _check_required_keys(data)
    assert data["seq"] == 512 and data["global_batch"] == 16 and data["fits"] is True
    assert data["search"]["candidates"] >= data["search"]["evaluated"] >= 1


def test_cli_fix_returns_that_configuration(capsys):
    assert main([*GPT, "--json", "--fix", "tp=2,pp=2,dp=2,microbatch=1,schedule=1f1b"]) == 0
    par = json.loads(capsys.readouterr().out)["parallelism"]
    assert (par["tp"], par["pp"], par["dp"], par["microbatch"], par["n_microbatches"],
            par["schedule"]) == (2, 2, 2, 1, 8, "1f1b")


def test_cli_text_names_each_stages_memory_plan(capsys):
    assert main([*GPT, "--json", "--fix", "tp=2,pp=2,dp=2,microbatch=1,schedule=1f1b"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert main([*GPT, "--fix", "tp=2,pp=2,dp=2,microbatch=1,schedule=1f1b"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines()
            if re.match(r"^\s+\d+\s+\d+x\d+\s+\S*(embedding|layer|head)", line)]
    assert len(rows) == len(stages) == 2
    for row, stage in zip(rows, stages):
        for name, count in stage["memory_plan"].items():
            assert f"{name} x{count}" in row, (row, stage["memory_plan"])


def test_cli_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "gantt.png"
    assert main([*GPT, "--fix", "tp=2,pp=2,dp=2,microbatch=1,schedule=1f1b",
                 "--plot", str(png)]) == 0
    capsys.readouterr()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_cli_save_writes_a_loadable_plan(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main([*GPT, "--json", "--save", str(path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    loaded = DistPlan.load(path)
    _check_required_keys(loaded.to_json())
    assert loaded.to_json()["parallelism"] == printed["parallelism"]
    assert loaded.predicted == printed["predicted"]


def test_cli_preset(capsys):
    assert main(["plan-dist", "gpt-1.7b", "--devices", "32", "--global-batch", "512",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    _check_required_keys(data)
    assert data["cluster"]["devices"] == 32 and data["cluster"]["nodes"] == 4
    assert data["seq"] == 2048 and data["model"] == "gpt-l24-h2304-a24"


def test_cli_unknown_model_names_the_presets():
    with pytest.raises(SystemExit) as info:
        main(["plan-dist", "no-such-model", "--devices", "8", "--global-batch", "16"])
    message = str(info.value)
    assert "no-such-model" in message
    for preset in ("gpt3-175b", "gpt-1.7b", "gpt-1t"):
        assert preset in message


def test_cli_gpt_needs_its_shape():
    with pytest.raises(SystemExit, match="--hidden, --heads"):
        main(["plan-dist", "gpt", "--layers", "8", "--devices", "8", "--global-batch", "16"])


def test_cli_infeasible_returns_2_and_names_the_binding_term(capsys):
    rc = main(["plan-dist", "gpt3-175b", "--devices", "8", "--global-batch", "8"])
    out = capsys.readouterr().out
    assert rc == 2
    assert "no configuration of gpt-l96-h12288-a96 fits 8 x a100-80gb" in out
    assert "weights, gradients and optimizer state" in out
    assert "64 devices" in out


def test_cli_bad_fix_key_lists_the_keys():
    with pytest.raises(SystemExit) as info:
        main([*GPT, "--fix", "tp=2,bogus=1"])
    message = str(info.value)
    assert "'bogus=1'" in message
    for key in ("tp", "pp", "dp", "microbatch", "schedule", "zero", "recompute"):
        assert re.search(rf"\b{key}\b", message), key


def test_cli_bad_fix_value_is_named():
    with pytest.raises(SystemExit, match=r"--fix tp=two: expected an integer"):
        main([*GPT, "--fix", "tp=two"])


# -- calibration -------------------------------------------------------------------------------


def test_calibration_rederives_the_stored_a100_efficiency():
    eff = calibrate_flop_efficiency()
    assert 0.05 < eff < 1
    assert round(eff, 2) == A100_FLOP_EFFICIENCY
    device, note = calibrated_device("a100-80gb")
    assert device.flop_efficiency == A100_FLOP_EFFICIENCY and "Table 1, row 1" in note
    # the calibration row is met at the unrounded fraction
    from fitgraph.dist.evaluate import evaluate
    from fitgraph.dist.model import GptModel

    row = TABLE1[0]
    base = dgx_a100(row.gpus // 8)
    cluster = type(base)(device.replace(flop_efficiency=eff), 8, base.nodes, base.intra,
                         base.inter)
    par = Parallelism(tp=1, pp=1, dp=32, micro_batch=1, n_micro=16, recompute="full",
                      overlap_grad_reduce=False)
    step = evaluate(GptModel(row.shape), cluster, par).step_s
    assert row.shape.flops_per_iteration(row.batch) / step / row.gpus / 1e12 == pytest.approx(
        row.tflops_per_gpu, rel=1e-3)


def test_stage_widths_round_trip_through_json(tmp_path):
    from fitgraph.cost.devices import get_device
    from fitgraph.dist.cluster import LINKS, Cluster
    from fitgraph.dist.config import Parallelism
    from fitgraph.dist.evaluate import evaluate
    from fitgraph.dist.megatron_table import GptShape
    from fitgraph.dist.memory import MIXED_ADAM
    from fitgraph.dist.model import GptModel
    from fitgraph.dist.planner import DistPlan, from_prediction

    model = GptModel(GptShape(8, 1024, 16, seq=512))
    cluster = Cluster(get_device("a100-80gb"), 4, 2, LINKS["nvlink3"], LINKS["hdr-ib"])
    par = Parallelism(tp=2, pp=2, dp=2, micro_batch=2, n_micro=8, widths=((4, 1), (1, 4)))
    p = from_prediction(evaluate(model, cluster, par), model, cluster, MIXED_ADAM, 0.0)
    back = DistPlan.load(p.save(tmp_path / "plan.json"))
    assert back.parallelism == par
    assert [(s["tp"], s["dp"]) for s in back.stages] == [(4, 1), (1, 4)]


def test_cli_model_as_an_option_plans_the_same(capsys):
    """``--model gpt`` (the issues' spelling) is the positional ``gpt``, wherever it stands."""
    fix = ["--json", "--fix", "tp=2,pp=2,dp=2,microbatch=1,schedule=1f1b"]
    assert main([*GPT, *fix]) == 0
    positional = json.loads(capsys.readouterr().out)
    assert main(["plan-dist", *GPT[2:], "--model", "gpt", *fix]) == 0
    option = json.loads(capsys.readouterr().out)
    for data in (positional, option):
        data.pop("plan_s")
    assert option == positional


@pytest.mark.parametrize("command", ["plan-dist", "hw-search"])
def test_cli_without_a_model_says_how_to_name_one(command):
    with pytest.raises(SystemExit, match="name a model .positional or --model."):
        main([command, "--devices", "8", "--global-batch", "16"])
