"""The one shape of a graph rewrite (``transform.rewrite``) and the registry of those the
planners use: each says what it changed, its graph out passes ``verify_graph``, and a
transform marked ``exact`` keeps results bitwise (the others allclose) on models it rewrites."""

from __future__ import annotations

import copy

import pytest
import torch

import fitgraph
from fitgraph import zoo
from fitgraph.execute import execute
from fitgraph.transform.registry import FISSION_READS, TRANSFORMS, fission_reads
from fitgraph.transform.rewrite import TransformError, compose


@pytest.fixture(scope="module")
def gpt2():
    case = zoo.build("gpt2", "small", batch_size=2, seq_len=32)
    return case, fitgraph.capture(case.model, case.batch, case.loss_fn)


def _run(graph, case):
    model = copy.deepcopy(case.model)
    torch.manual_seed(0)
    loss = execute(graph, fitgraph.eager_plan(graph), model, case.batch)
    return loss, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("model", ["gpt2", "unet", "llama"])
def test_each_transform_keeps_its_guarantee(model):
    """GPT-2 (dropout masks, view chains), a UNet (group norms, concatenations), Llama (masks
    expanded over the batch, products summed): each rewrite that changes the graph is checked
    against the graph it was given, bitwise where ``exact``."""
    case = zoo.build(model, "small", batch_size=2, seq_len=32) if model != "unet" else \
        zoo.build(model, "small", batch_size=2, image_size=32)
    g = fitgraph.capture(case.model, case.batch, case.loss_fn)
    la, ga = _run(g, case)
    changed = []
    for name in sorted(n for n in TRANSFORMS if n != "optimizer_in_backward"):
        r = TRANSFORMS[name](g)
        assert r.applied == (name,)
        if not r.changed:
            continue
        changed.append(name)
        lb, gb = _run(r.graph, case)
        if TRANSFORMS[name].exact:
            assert torch.equal(la, lb), name
            assert all(torch.equal(a, b) for a, b in zip(ga, gb)), name
        else:
            torch.testing.assert_close(lb, la)
            for a, b in zip(ga, gb):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    assert len(changed) >= 4, changed


def test_the_fission_reads_are_the_composed_transforms_and_say_what_changed(gpt2):
    _, g = gpt2
    r = compose(g, [TRANSFORMS[n] for n in FISSION_READS])
    assert r.applied == FISSION_READS and r.changed
    assert any(".mask." in name for name in r.added)          # NOTE: masks as bits
    assert [n.name for n in fission_reads(g).nodes] == [n.name for n in r.graph.nodes]


def test_a_transform_that_does_not_apply_says_why():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(2, 4)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    g = fitgraph.capture(model, x, lambda m, b: m(b).sum(), opt, clip_grad_norm=1.0)
    with pytest.raises(TransformError, match="optimizer_in_backward does not apply: .*clip"):
        TRANSFORMS["optimizer_in_backward"](g)
