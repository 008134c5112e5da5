"""ModelSlots: the model's parameters and buffers by name without walking the model each step —
and never a stale tensor after the model changed."""

from __future__ import annotations

import torch

from fitgraph.execute.slots import ModelSlots


def _model():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                               torch.nn.Sequential(torch.nn.Linear(4, 2)))


def _same(slots, model):
    params, buffers = slots.tensors()
    want_p, want_b = dict(model.named_parameters()), dict(model.named_buffers())
    assert set(params) == set(want_p) and set(buffers) == set(want_b)
    assert all(params[k] is want_p[k] for k in want_p)
    assert all(buffers[k] is want_b[k] for k in want_b)


def test_as_named_parameters_and_buffers():
    m = _model()
    _same(ModelSlots(m), m)


def test_a_replaced_parameter_buffer_or_submodule_is_seen():
    m = _model()
    slots = ModelSlots(m)
    slots.tensors()
    m[0].weight = torch.nn.Parameter(torch.randn(4, 3))
    _same(slots, m)
    m.to(torch.float64)      # NOTE: new buffer tensors (Module._apply), parameters in place
    _same(slots, m)
    m[2][0] = torch.nn.Linear(4, 2, dtype=torch.float64)
    _same(slots, m)
    del m[1].running_mean
    m[1].register_buffer("running_mean", torch.zeros(4, dtype=torch.float64))
    _same(slots, m)


def test_tied_parameters_are_listed_once():
    m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    m[1].weight = m[0].weight
    _same(ModelSlots(m), m)
