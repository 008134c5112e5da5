"""A block's op-level memory plan at run time (``dist.runtime.op_recompute``; issue 28): the
dropped ops' outputs are not held from the forward to the backward — exactly the bytes the
planner frees — and the gradients are eager PyTorch's, for every point of a GPT-2 block's
curve; what cannot be re-made is kept, and ops that do not match the plan are said and re-made
whole."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import fitgraph
import fitgraph.zoo as zoo
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.dist.block_cost import price_block
from fitgraph.dist.cluster import LINKS
from fitgraph.dist.graph_model import GraphModel
from fitgraph.dist.runtime.op_recompute import recompute_ops
from fitgraph.execute.meter import MemoryMeter

MLP = [[["aten.addmm.default"], False], [["aten.relu.default"], True],
       [["aten.addmm.default"], False]]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _held_after_forward(model, run):
    gc.collect()
    with MemoryMeter() as m:
        loss = run(model)
    with MemoryMeter() as b:
        loss.backward()
    return m.end_bytes, b.peak_bytes + m.end_bytes


def test_dropping_an_op_frees_its_output_and_keeps_eager_gradients():
    x = torch.randn(16, 32, requires_grad=True)
    ref, net = _mlp(), _mlp()
    notes = []
    recompute_ops(net, MLP, {1}, "mlp", notes)

    def run(m):
        return m(x).square().sum()

    held_ref, peak_ref = _held_after_forward(ref, run)
    held, peak = _held_after_forward(net, run)
    assert notes == []
    assert held_ref - held == 16 * 64 * 4          # the relu's output, re-made in the backward
    assert peak == peak_ref                        # re-made at the block's backward: as if kept
    for a, b in zip(_grads(ref), _grads(net)):
        assert torch.equal(a, b)


def _block(model_name: str):
    case = zoo.build(model_name, "small", batch_size=2, seq_len=32)
    case.model.eval()
    graph = fitgraph.capture(case.model, case.batch, case.loss_fn)
    gm = GraphModel(graph, RooflineCostModel(get_device("cpu-generic")), batch_size=2, seq=32)
    name = gm._chain.names[2]           # the second repeated layer
    k = gm._chain.names.index(name)
    cost = price_block(gm.blocks(1, 2, False)[k], get_device("cpu-generic"),
                       LINKS["gloo-loopback"])
    return case, name, gm.op_signature(name), cost


# NOTE: GPT-2 (the zoo's), BERT (its attention one fused op, tagged random though at dropout
# 0 it draws nothing) and Hugging Face's Llama (constants the capture lifts, eager makes
# outside any op; a no-grad rotary embedding)
@pytest.mark.parametrize("model_name", ["gpt2", "bert-base", "hf-llama"])
def test_every_point_of_a_blocks_curve_frees_what_the_plan_frees(model_name):
    case, name, signature, cost = _block(model_name)
    drops = [o for o in cost.options if o.name.startswith("drop:")][:8]
    assert len(drops) >= 4

    def run(model):
        return case.loss(model, case.batch)

    ref = copy.deepcopy(case.model)
    held_none, _ = _held_after_forward(ref, run)
    kept_none = cost.options[0].kept_bytes
    for option in drops:
        model = copy.deepcopy(case.model)
        notes = []
        recompute_ops(dict(model.named_modules())[name], signature,
                      {int(o[1:]) for o in option.dropped}, name, notes)
        held, _ = _held_after_forward(model, run)
        assert notes == [], option.name
        assert held_none - held == kept_none - option.kept_bytes, option.name
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            if b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_ops_that_do_not_match_the_plan_are_said_and_the_block_re_made_whole():
    x = torch.randn(16, 32, requires_grad=True)
    ref, net = _mlp(), _mlp()
    wrong = [MLP[0], [["aten.gelu.default"], True], MLP[2]]
    notes = []
    with pytest.warns(UserWarning, match="aten.relu.default at run time is not the plan's op 1"):
        recompute_ops(net, wrong, {1}, "mlp", notes)
        net(x).sum().backward()
    assert len(notes) == 1 and "re-make the whole block" in notes[0]
    ref(x).sum().backward()
    net.zero_grad()
    net(x).sum().backward()                         # the second call: whole-block checkpoint
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.equal(2 * a.grad, 2 * b.grad)


def _dispatched(module, *args) -> list[str]:
    """The ATen ops a call of ``module`` runs that make new tensors (not views), in order."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    names = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs))
                   if isinstance(a, torch.Tensor)}
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if outs and (func._schema.is_mutable
                         or not all(t.untyped_storage().data_ptr() in ins for t in outs)):
                names.append(str(func))
            return out

    with torch.no_grad(), Ops():
        module(*args)
    return names


class _Noisy(torch.nn.Module):
    """A dropped op reads a random op's output, and a tensor changed in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = torch.nn.functional.dropout(self.a(x), 0.5, training=True)
        y = h.tanh()                 # dropped: re-made from the random op's output, kept
        z = self.b(x)
        z.mul_(2.0)                  # in place: what reads z reads the changed value
        return (y * z.sigmoid()).sum()


def test_random_and_in_place_inputs_of_dropped_ops_give_eager_gradients():
    x = torch.randn(8, 16)
    torch.manual_seed(0)
    ref = _Noisy()
    net = copy.deepcopy(ref)
    torch.manual_seed(1)
    ref(x).backward()
    names = _dispatched(net, x)
    signature = [[[n], n != "aten.addmm.default"] for n in names]
    dropped = {names.index("aten.tanh.default"), names.index("aten.sigmoid.default")}
    notes = []
    recompute_ops(net, signature, dropped, "noisy", notes)
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="bytes the plan does not"):
        net(x).backward()
    assert len(notes) == 1          # the random output and the changed tensor, held
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_a_split_backward_re_makes_once_and_serves_both_halves():
    """Zero-bubble schedules run the input gradients, then the weight gradients, over one
    graph kept (``retain_graph``): each half unpacks what it needs."""
    x = torch.randn(16, 32, requires_grad=True)
    ref, net = _mlp(), _mlp()
    recompute_ops(net, MLP, {1}, "mlp", [])
    for m in (ref, net):
        loss = m(x).square().sum()
        (gx,) = torch.autograd.grad(loss, [x], retain_graph=True)
        gw = torch.autograd.grad(loss, list(m.parameters()))
        m.got = (gx, gw)
    assert torch.equal(ref.got[0], net.got[0])
    for a, b in zip(ref.got[1], net.got[1]):
        assert torch.equal(a, b)


def test_a_drop_without_the_blocks_ops_is_re_made_whole_and_said():
    """A plan of a model by its shape records no ops; a unit that writes in place cannot be
    matched op by op: the block is checkpointed whole, and the note says why."""
    from fitgraph.dist.runtime.memory_plan import apply_memory_plan

    class Chunk(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Module()
            self.body.model = torch.nn.ModuleDict({"a": _mlp(), "b": _mlp()})

    chunk = Chunk()
    in_place = [[["aten.addmm.default", "aten.relu_.default"], True], MLP[2]]
    notes = apply_memory_plan(chunk, {"a": "drop:o1", "b": "drop:o0"}, {"b": in_place})
    assert notes == [
        "a: the plan re-makes some ops (drop:o1); the runtime re-makes the whole block (the "
        "plan does not record the block's ops: keeps less, spends more time)",
        "b: the plan re-makes some ops (drop:o0); the runtime re-makes the whole block (some "
        "of its ops write in place: keeps less, spends more time)"]
    x = torch.randn(4, 32, requires_grad=True)
    ref = _mlp()
    ref(x).sum().backward()
    chunk.body.model["a"](x).sum().backward()
    for a, b in zip(ref.parameters(), chunk.body.model["a"].parameters()):
        assert torch.equal(a.grad, b.grad)


class _Noise(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        return (h.tanh() * torch.rand_like(h)).sum()


def test_a_unit_the_plan_re_makes_that_drew_random_numbers_is_kept_and_said():
    x = torch.randn(8, 16)
    torch.manual_seed(0)
    ref = _Noise()
    net = copy.deepcopy(ref)
    names = _dispatched(net, x)
    signature = [[[n], True] for n in names]
    notes = []
    recompute_ops(net, signature, {names.index("aten.rand_like.default")}, "noise", notes)
    for m in (ref, net):
        torch.manual_seed(1)
        m(x).backward()
    assert notes == ["noise: aten.rand_like.default (a unit the plan re-makes) draws random "
                     "numbers: kept"]
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.equal(a.grad, b.grad)
