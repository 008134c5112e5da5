"""What a planned step depends on besides the batch, kept as eager keeps it (issue 25): the
modules' modes, the parameters that train, the caller's autocast, the Python values the step
reads; the parameters' own hooks; wrappers around the model; the host's random generators."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from helpers import assert_bitwise_equal_models, eager_step

import fitgraph
from fitgraph import api


def _small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))


def _ce(m, b):
    return nn.functional.cross_entropy(m(b[0]), b[1])


SMALL_BATCH = (torch.randn(16, 32), torch.randint(0, 8, (16,)))


def _planned_twins(make=_small, loss=_ce, wrap=lambda m: m):
    """Two models made alike, AdamW each, the second's step planned: (a, b, oa, ob, step)."""
    a, b = make(), make()
    oa, ob = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b))
    step = fitgraph.optimize(wrap(b), SMALL_BATCH, loss, ob, latency_limit=1.3, time_budget=2,
                             measure_latency=False)
    return a, b, oa, ob, step


def _both_step(a, oa, ob, step, i, loss=_ce):
    """Step ``i`` of eager (``a``) and of the planned ``step``: (eager's loss, the step's)."""
    for o in (oa, ob):
        o.zero_grad(set_to_none=True)
    return eager_step(a, SMALL_BATCH, loss, oa, seed=i), step(SMALL_BATCH)


def test_a_layer_frozen_and_unfrozen_between_steps_trains_as_in_eager():
    """Fine-tuning that freezes a layer for some steps: the plan made with it trainable kept
    updating it (silently unlike eager); now the step plans again for the parameters that
    train."""
    a, b, oa, ob, step = _planned_twins()
    for i, frozen in enumerate((False, True, True, False)):
        for m in (a, b):
            m[0].requires_grad_(not frozen)
        la, lb = _both_step(a, oa, ob, step, i)
        assert torch.equal(la, lb), f"step {i} (frozen={frozen})"
        assert_bitwise_equal_models(a, b, oa, ob)
    assert len(step._plans) == 2


def test_a_step_called_inside_autocast_runs_as_eager_does_there():
    """``with torch.autocast(...): loss = step(batch)``: the plan made outside it failed
    ("attempting to assign a gradient with dtype BFloat16..."); now the step is captured in
    the caller's autocast and its graph runs with its own casts."""
    a, b, oa, ob, step = _planned_twins()
    for i in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            la, lb = _both_step(a, oa, ob, step, i)
        assert torch.equal(la, lb), f"step {i}"
        assert_bitwise_equal_models(a, b, oa, ob)
    assert any(n.target == "aten._to_copy.default" for n in step.graph.nodes)


# -- Python values the step reads ---------------------------------------------------------------
KL_WEIGHT = 0.0


def _annealed_loss(m, b):
    out = m(b[0])
    return nn.functional.cross_entropy(out, b[1]) + KL_WEIGHT * out.square().mean()


class _Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.temperature = nn.Linear(32, 8), 1.0

    def forward(self, x):
        return self.lin(x) / self.temperature


def test_a_loss_weight_annealed_between_steps_is_read_at_every_step():
    """A global loss weight changed between steps (KL annealing) was a constant of the plan
    (silently other losses from the second step); now the step plans again, and says why."""
    global KL_WEIGHT
    a, b, oa, ob, step = _planned_twins(loss=_annealed_loss)
    try:
        for i, weight in enumerate((0.0, 0.5, 0.5, 0.0)):
            KL_WEIGHT = weight
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                la, lb = _both_step(a, oa, ob, step, i, _annealed_loss)
            assert torch.equal(la, lb), f"step {i} (weight {weight})"
            said = [str(w.message) for w in seen if "KL_WEIGHT" in str(w.message)]
            assert bool(said) == (i == 1), said   # NOTE: only where a new value is planned
        assert_bitwise_equal_models(a, b, oa, ob)
    finally:
        KL_WEIGHT = 0.0
    assert len(step._plans) == 2


def test_a_module_attribute_changed_between_steps_is_read_at_every_step():
    a, b, oa, ob, step = _planned_twins(_Tempered)
    for i in range(3):
        a.temperature = b.temperature = 1.0 + i
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            la, lb = _both_step(a, oa, ob, step, i)
        assert torch.equal(la, lb), f"step {i}"
    assert_bitwise_equal_models(a, b, oa, ob)


def test_a_value_the_forward_changes_itself_is_named_not_planned_again():
    class Counting(_Tempered):
        def forward(self, x):
            self.calls = getattr(self, "calls", 0) + 1
            return super().forward(x)

    m = Counting()
    m.calls = 0
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match="forward changes Counting.calls"):
        step = fitgraph.optimize(m, SMALL_BATCH, _ce, opt, latency_limit=1.3, time_budget=2,
                                 measure_latency=False)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        step(SMALL_BATCH)
    assert len(step._plans) == 1


# -- hooks and wrappers -------------------------------------------------------------------------
def test_a_parameters_gradient_hook_is_part_of_the_step():
    """``weight.register_hook(lambda g: g * 0.5)`` was ignored (``autograd.grad`` runs no leaf
    hook), silently training otherwise than eager; it is traced into the step now."""
    def hooked():
        m = _small()
        m[0].weight.register_hook(lambda g: g * 0.5)
        m[2].bias.register_hook(lambda g: g.clamp(-0.01, 0.01))
        return m

    a, b, oa, ob, step = _planned_twins(hooked)
    for i in range(3):
        la, lb = _both_step(a, oa, ob, step, i)
        assert torch.equal(la, lb)
        assert_bitwise_equal_models(a, b, oa, ob)


def test_a_post_accumulate_grad_hook_is_a_clear_error():
    m = _small()
    m[2].weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(fitgraph.CaptureError, match="2.weight has a post-accumulate-grad hook"):
        fitgraph.optimize(m, SMALL_BATCH, _ce, torch.optim.AdamW(m.parameters()),
                          latency_limit=1.3, time_budget=2, graph_breaks="error")


def test_a_model_wrapped_by_torch_compile_is_planned_whole_and_says_so():
    with pytest.warns(UserWarning, match="wrapped by torch.compile"):
        a, b, oa, ob, step = _planned_twins(wrap=torch.compile)
    assert isinstance(step, api.TrainStep) and step.model is b
    for i in range(2):
        la, lb = _both_step(a, oa, ob, step, i)
        assert torch.equal(la, lb)
    assert_bitwise_equal_models(a, b, oa, ob)


def test_a_data_parallel_wrapper_is_planned_as_its_module():
    with pytest.warns(UserWarning, match="wrapped by nn.DataParallel"):
        a, b, oa, ob, step = _planned_twins(wrap=nn.DataParallel)
    la, lb = _both_step(a, oa, ob, step, 0)
    assert torch.equal(la, lb)
    assert_bitwise_equal_models(a, b, oa, ob)


def test_a_distributed_data_parallel_model_is_a_clear_error():
    """DDP averages gradients across processes by autograd hooks a planned step does not run:
    it failed with "fx node _record_function_enter_new is used as a tensor"."""
    import datetime
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        m = nn.parallel.DistributedDataParallel(_small())
        with pytest.raises(fitgraph.CaptureError, match="wrapped by DistributedDataParallel"):
            fitgraph.optimize(m, SMALL_BATCH, _ce, torch.optim.AdamW(m.parameters()),
                              latency_limit=1.3, time_budget=2)
    finally:
        dist.destroy_process_group()


def test_a_step_that_draws_from_pythons_random_is_a_clear_error():
    """``if random.random() < 0.5: flip`` in the loss was traced with one draw, repeated at
    every step by the plan (silently unlike eager); it is a CaptureError now, and capture
    leaves Python's generator where it was."""
    import random

    def augmented(m, b):
        x = b[0].flip(-1) if random.random() < 0.5 else b[0]
        return _ce(m, (x, b[1]))

    m = _small()
    random.seed(3)
    before = random.getstate()
    with pytest.raises(fitgraph.CaptureError, match="draws from Python's random module"):
        fitgraph.optimize(m, SMALL_BATCH, augmented, torch.optim.AdamW(m.parameters()),
                          latency_limit=1.3, time_budget=2)
    assert random.getstate() == before


def test_a_step_that_seeds_torch_is_a_clear_error():
    """``torch.manual_seed`` in the loss (the same dropout masks every step, in eager) ran once
    at capture: the plan drew new masks each step, silently."""
    def seeded(m, b):
        torch.manual_seed(0)
        return _ce(m, (nn.functional.dropout(b[0], 0.5), b[1]))

    m = _small()
    before = torch.get_rng_state()
    with pytest.raises(fitgraph.CaptureError, match="seeds torch's random generator"):
        fitgraph.optimize(m, SMALL_BATCH, seeded, torch.optim.AdamW(m.parameters()),
                          latency_limit=1.3, time_budget=2)
    assert torch.equal(torch.get_rng_state(), before)
