"""The sweep (issue 25): its registry builds models that train in eager, and its harness turns
every outcome of a model — a result, an error, a crash of the process — into a row."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from fitgraph.bench import sweep
from fitgraph.bench.sweep_measure import _settle, compare
from fitgraph.bench.sweep_models import MODELS, TEST_MODELS, build, names

# NOTE: one model per family, so a broken family shows in the default suite; all of them: slow
ONE_PER_FAMILY = ["gpt2", "mixtral", "bert", "t5", "whisper", "resnet", "vit", "segformer",
                  "mamba", "nn-lstm", "nn-transformer-encoder"]


def _finite_loss(name: str) -> None:
    case = build(name)
    loss = case.loss()
    loss.backward()
    assert loss.ndim == 0 and math.isfinite(loss.item()), name
    assert any(p.grad is not None for p in case.model.parameters()), name


def test_registry_has_the_issue_s_breadth():
    assert len(names()) >= 30 and not set(names()) & set(TEST_MODELS)
    families = {"decoder", "moe", "encoder", "encoder-decoder", "speech", "vision-cnn",
                "vision-transformer", "segmentation", "state-space", "torch.nn"}
    assert set(ONE_PER_FAMILY) <= set(MODELS)
    pytest.importorskip("transformers")
    assert {build(n).family for n in ONE_PER_FAMILY} == families


@pytest.mark.hf
@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_a_model_of_each_family_trains_in_eager(name):
    pytest.importorskip("transformers")
    _finite_loss(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", names())
def test_every_model_trains_in_eager(name):
    pytest.importorskip("transformers")
    _finite_loss(name)


def test_builds_are_deterministic():
    a, b = build("test-tiny-mlp"), build("test-tiny-mlp")
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert torch.equal(a.batch, b.batch)


def _twins(bias_grad=None):
    """Two equal Linear layers after one backward (the bias gradient set to ``bias_grad``, a
    rounding-noise value, where given) and a loss."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(torch.ones(2, 4)).sum().backward()
        if bias_grad is not None:
            m.bias.grad = torch.full((4,), bias_grad)
    return a, b, torch.tensor(1.0)


def test_compare_tells_bitwise_close_and_wrong_apart():
    a, b, loss = _twins()
    assert compare(loss, loss.clone(), a, b) == ("bitwise", "")
    b.weight.grad += 1e-6   # NOTE: a few ulps of 2.0
    assert compare(loss, loss.clone(), a, b)[0] == "allclose"
    b.weight.grad += 1.0
    verdict, detail = compare(loss, loss.clone(), a, b)
    assert verdict == "MISMATCH" and "grad weight" in detail


def test_compare_reads_a_zero_gradient_as_rounding_noise():
    """A gradient that is zero in exact arithmetic (a key's bias under softmax) differs
    entirely when summed in another order, by nothing beside the model's gradients."""
    a, b, loss = _twins(bias_grad=1e-9)
    b.bias.grad = -a.bias.grad
    assert compare(loss, loss.clone(), a, b)[0] == "allclose"
    b.bias.grad = torch.full((4,), 1e-3)   # NOTE: above the noise of a 2.0 gradient
    assert compare(loss, loss.clone(), a, b)[0] == "MISMATCH"


def test_compare_lets_a_noise_gradient_move_its_parameter_by_a_step():
    """AdamW moves a parameter by about lr whatever its gradient's size: where the gradient is
    rounding noise, so is the update; a real gradient's parameter must still agree."""
    a, b, loss = _twins(bias_grad=1e-9)
    with torch.no_grad():
        b.bias += 2e-4        # NOTE: two steps of lr 1e-4, the other way
    assert compare(loss, loss.clone(), a, b)[0] == "allclose"
    with torch.no_grad():
        b.weight += 2e-4      # NOTE: a real gradient's parameter
    verdict, detail = compare(loss, loss.clone(), a, b)
    assert verdict == "MISMATCH" and "param weight" in detail


def test_a_step_by_regions_is_settled_as_a_training_loop_runs_it():
    """Each call of ``_settle`` starts with the gradients set to None, as every other system
    of the sweep is measured: a step by regions accumulates into ``.grad`` as eager does, and
    measured after a call that left them, its peak held two steps' gradients."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())

    class Step:
        optimizer, calls, seen = opt, 0, []

        @property
        def settled(self):
            return self.calls >= 3

        def __call__(self, batch):
            self.seen.append([p.grad is None for p in model.parameters()])
            self.calls += 1
            model(batch).sum().backward()
            opt.step()

    step = Step()
    step(torch.randn(2, 4))   # NOTE: the first call leaves .grad, as a step by regions does
    _settle(step, torch.randn(2, 4))
    assert step.calls == 3 and step.seen[1:] == [[True, True], [True, True]]


def test_checks_name_each_failed_criterion():
    row = {"model": "gpt2", "family": "decoder", "status": "ok", "overhead_110": 0.05,
           "lower_bound": 100, "smallest_peak": 200, "ckpt_peak": 150, "at_ckpt_vs_ckpt": 0.9}
    assert sweep.checks(row) == "smallest 2.00x lower bound; smallest above checkpointing's peak"
    assert sweep.checks(dict(row, family="vision-cnn", smallest_peak=120)) == ""
    assert sweep.checks(dict(row, status="capture error")) == ""
    over = dict(row, family="vision-cnn", smallest_peak=120, peak_at_ckpt=151)
    assert sweep.checks(over) == "at checkpointing's peak, peaked 1.007x it"
    assert sweep.checks(dict(over, peak_at_ckpt=150)) == ""


@pytest.mark.slow  # NOTE: a long run; the law is held in the default tier too
def test_the_harness_writes_a_row_per_model_even_when_one_crashes(tmp_path):
    out = tmp_path / "out"
    report = tmp_path / "section.md"
    rc = sweep.main(["--models", "test-tiny-mlp,test-segfault", "--rounds", "1", "--out",
                     str(out), "--report", str(report), "--time-budget", "5", "--timeout", "300"])
    assert rc == 0
    rows = {r["model"]: r for r in csv.DictReader(open(out / "sweep.csv"))}
    ok = rows["test-tiny-mlp"]
    assert ok["status"] == "ok", ok["error"]
    assert ok["result"] in ("bitwise", "allclose") and float(ok["peak_110"]) > 0
    assert ok["ckpt_kind"] == "per-block" and float(ok["smallest_peak"]) > 0
    crashed = rows["test-segfault"]
    assert crashed["status"] == "crashed: signal 11 (SIGSEGV)" and crashed["stage"] == "eager"
    text = report.read_text()
    assert "test-segfault" in text and "crashed: signal 11" in text and "Command:" in text
    assert (out / "sweep.md").read_text().count("\n| test-") == 2


def test_a_model_that_kills_its_process_is_a_row_of_the_report(tmp_path):
    """The default tier's share of the test above: a crash is a row, the run goes on."""
    out = tmp_path / "out"
    rc = sweep.main(["--models", "test-segfault", "--rounds", "1", "--out", str(out),
                     "--report", str(tmp_path / "section.md"), "--timeout", "120"])
    assert rc == 0
    (row,) = csv.DictReader(open(out / "sweep.csv"))
    assert row["status"] == "crashed: signal 11 (SIGSEGV)" and row["stage"] == "eager"
    assert "crashed: signal 11" in (tmp_path / "section.md").read_text()


@pytest.mark.slow
@pytest.mark.hf
def test_full_sweep_runs(tmp_path):
    pytest.importorskip("transformers")
    assert sweep.main(["--rounds", "1", "--out", str(tmp_path), "--timeout", "600"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert [r["model"] for r in rows] == names()
    assert all(r["status"] for r in rows)


def test_each_model_measures_its_op_costs_in_the_sweep_s_own_cache(tmp_path, monkeypatch):
    """Entries in the user's cost cache measured while the machine was busy stay there:
    Pegasus's were 1.45x its ops' times in place, and its 1.10 plan ran +19%. A sweep's models
    measure theirs in the sweep's own cache, unless the caller names one."""
    import subprocess

    from fitgraph.bench import sweep
    from fitgraph.cost.cache import CACHE_ENV

    seen = []

    def run(cmd, env, **kw):
        seen.append(env.get(CACHE_ENV))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(sweep.subprocess, "run", run)
    monkeypatch.delenv(CACHE_ENV, raising=False)
    sweep.run_model("gpt2", rounds=1, timeout=10, time_budget=1, logdir=tmp_path / "logs")
    monkeypatch.setenv(CACHE_ENV, "/elsewhere")
    sweep.run_model("gpt2", rounds=1, timeout=10, time_budget=1, logdir=tmp_path / "logs")
    assert seen == [str(tmp_path / "cost-cache"), "/elsewhere"]
