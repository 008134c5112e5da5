"""The runtime's parts: a batch split between replicas, micro-batches' loss
weights found in the traced step, the optimizer rebuilt per rank, the launch checked against
the plan (``fitgraph.dist.runtime``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fitgraph.dist.config import Parallelism
from fitgraph.dist.runtime.batches import FlatBatch
from fitgraph.dist.runtime.layout import PlanMismatch, RankLayout
from fitgraph.dist.runtime.local_optimizer import local_optimizer
from fitgraph.dist.runtime.stage_split import StepModule, chunk_metas, split_step


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.head = torch.nn.Linear(8, 11)

    def forward(self, ids):
        return self.head(self.body(self.emb(ids)))


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (4, 5), generator=g)
    labels = torch.where(torch.rand(4, 5, generator=g) < 0.5, ids, torch.full_like(ids, -100))
    return {"ids": ids, "labels": labels}


def _split(loss_fn, starts=("body",)):
    torch.manual_seed(0)
    model = Tiny()
    batch = _batch()
    flat = FlatBatch.of(batch)
    return model, batch, split_step(StepModule(model, loss_fn, flat),
                                    tuple(t[:2] for t in flat.tensors), list(starts))


def test_batch_split_between_replicas_keeps_shared_leaves_whole():
    flat = FlatBatch.of({"x": torch.arange(8).reshape(8, 1), "mask": torch.ones(3, 3),
                         "scale": 0.5})
    parts = flat.replica_part(flat.tensors, 1, 2, 8)
    assert parts[0].flatten().tolist() == [4, 5, 6, 7]
    assert parts[1].shape == (3, 3)
    rebuilt = flat.rebuild(parts)
    assert rebuilt["scale"] == 0.5 and rebuilt["x"].shape == (4, 1)
    with pytest.raises(ValueError, match="equal data-parallel parts"):
        flat.replica_part(flat.tensors, 0, 3, 8)


def test_chunks_chained_give_the_steps_loss():
    def loss_fn(m, b):
        return F.cross_entropy(m(b["ids"]).flatten(0, 1), b["labels"].flatten())

    model, batch, split = _split(loss_fn)
    micro = tuple(t[:2] for t in FlatBatch.of(batch).tensors)
    values = micro
    for ch in split.chunks:
        values = ch(*values)
        values = values if isinstance(values, tuple) else (values,)
    expected = loss_fn(model, {k: v[:2] for k, v in batch.items()})
    torch.testing.assert_close(values[0], expected)
    # the labels travel with the activations to the chunk that reads them
    metas = chunk_metas(split.chunks, micro)
    assert sorted(str(t.dtype) for t in metas[1][0]) == ["torch.float32", "torch.int64"]


def test_token_mean_cross_entropy_weighs_micro_batches_by_counted_tokens():
    def loss_fn(m, b):
        return F.cross_entropy(m(b["ids"]).flatten(0, 1), b["labels"].flatten(),
                               ignore_index=-100)

    _, batch, split = _split(loss_fn)
    assert split.weights is not None
    tensors = FlatBatch.of(batch).tensors
    counts = [int(split.weights.of([t[i:i + 1] for t in tensors])) for i in range(4)]
    assert counts == [(batch["labels"][i] != -100).sum().item() for i in range(4)]


def test_sum_loss_and_class_weighted_loss_weigh_micro_batches_alike():
    def summed(m, b):
        return F.cross_entropy(m(b["ids"]).flatten(0, 1), b["labels"].flatten(),
                               reduction="sum")

    assert _split(summed)[2].weights is None
    w = torch.rand(11)

    def weighted(m, b):
        return F.cross_entropy(m(b["ids"]).flatten(0, 1), b["labels"].flatten(), weight=w)

    split = _split(weighted)[2]
    assert split.weights is None and "class-weighted" in split.weights_note


def test_tied_parameter_is_shared_between_chunks():
    class TiedLM(Tiny):
        def forward(self, ids):
            return F.linear(self.body(self.emb(ids)), self.emb.weight)

    torch.manual_seed(0)
    model = TiedLM()
    flat = FlatBatch.of(_batch())
    split = split_step(StepModule(model, lambda m, b: F.cross_entropy(
        m(b["ids"]).flatten(0, 1), b["ids"].flatten()), flat),
        tuple(t[:2] for t in flat.tensors), ["body"])
    assert split.shared == ["emb.weight"]


def test_a_cut_that_is_not_a_module_is_refused():
    with pytest.raises(ValueError, match="not a module"):
        _split(lambda m, b: m(b["ids"]).mean(), starts=["layers.3"])


def test_optimizer_rebuilt_with_each_groups_options():
    model = Tiny()
    opt = torch.optim.AdamW([{"params": model.emb.parameters(), "lr": 0.1},
                             {"params": list(model.body.parameters())
                              + list(model.head.parameters()), "weight_decay": 0.5}], lr=0.01)
    local = local_optimizer(opt, model, [("head.weight", model.head.weight),
                                         ("emb.weight", model.emb.weight)])
    assert [(g["lr"], g["weight_decay"]) for g in local.param_groups] == [(0.1, 0.01),
                                                                         (0.01, 0.5)]
    made = local_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.3), model,
                           [("head.bias", model.head.bias)])
    assert made.param_groups[0]["lr"] == 0.3
    model(torch.zeros(1, 1, dtype=torch.long)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="before the first step"):
        local_optimizer(opt, model, [("head.bias", model.head.bias)])


def test_launch_of_the_wrong_size_is_refused_with_the_command_to_run():
    par = Parallelism(tp=1, pp=2, dp=2, micro_batch=1, n_micro=2)
    with pytest.raises(PlanMismatch, match="--nproc-per-node 4"):
        RankLayout.of(par, 0, 2)
    lay = RankLayout.of(par, 3, 4)
    assert (lay.stage, lay.replica, lay.shard) == (1, 1, 0)


def test_a_cut_after_a_module_for_a_chain_end_that_is_no_module():
    from fitgraph.dist.runtime.stage_split import END

    def loss_fn(m, b):
        return F.cross_entropy(m(b["ids"]).flatten(0, 1), b["labels"].flatten())

    model, batch, split = _split(loss_fn, starts=["body" + END])
    assert split.chunks[0].model_names() == ["emb.weight", "body.0.weight", "body.0.bias"]
    assert split.chunks[1].model_names() == ["head.weight", "head.bias"]


def _collectives_metered(rank: int, world: int, wrapped: bool):
    import contextlib

    import torch.distributed as dist

    from fitgraph.dist.runtime.collective_frees import frees_on_this_thread
    from fitgraph.execute.meter import MemoryMeter

    torch.set_num_threads(1)
    with MemoryMeter() as meter:
        with frees_on_this_thread() if wrapped else contextlib.nullcontext() as held:
            for _ in range(20):
                shard = torch.ones(25_000)
                whole = torch.empty(50_000)
                work = dist.all_gather_single(whole, shard, async_op=True)
                work.wait()
                part = torch.empty(25_000)
                dist.reduce_scatter_single(part, whole)
                dist.all_reduce(part)
                del work, shard, whole, part
            if held is not None:
                held.release(wait_s=1.0)
    return meter.end_bytes


def test_collectives_buffers_are_seen_freed_while_metering():
    """Gloo may free a collective's buffers on its worker threads, unseen by the meter (without
    the wrapper 1-3 MB of the loop's 8 MB stay "held" at its end); under
    ``frees_on_this_thread`` what the loop allocated is seen freed again — all of it, or in a
    rare run (1 in ~10 here) one 100 kB buffer of its 80 collectives, a free the wrapper does
    not yet keep on the rank's thread."""
    from fitgraph.dist.runtime import run_processes

    ends = run_processes(_collectives_metered, 2, True, timeout_s=120)
    assert all(0 <= e <= 100_000 for e in ends), ends


def test_batch_norm_in_training_mode_over_micro_batches_is_said():
    from fitgraph.dist.runtime.parallelize import _batch_norm_note

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    par = Parallelism(tp=1, pp=2, dp=1, micro_batch=2, n_micro=4)
    note = _batch_norm_note(model, par)
    assert "1 normalize over each micro-batch of 2 samples" in note and "of 8" in note
    assert _batch_norm_note(model.eval(), par) == ""
    assert _batch_norm_note(model.train(), Parallelism(tp=1, pp=1, dp=1, micro_batch=8,
                                                       n_micro=1)) == ""


class _Region(torch.nn.Module):
    """A module computing part of its output in a no-grad or autocast region."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        if self.kind == "no_grad":
            with torch.no_grad():
                scale = self.w.norm()       # NOTE: from a parameter: no gradient through it
            return x @ self.w * scale
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.kind == "autocast"):
            return (x @ self.w).float()


class _Wrapped(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.inner = _Region(kind)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.inner(self.a(x)))


@pytest.mark.parametrize("kind", ["no_grad", "autocast_off"])
def test_no_grad_and_disabled_autocast_regions_are_cut_with_eager_gradients(kind):
    torch.manual_seed(0)
    model = _Wrapped(kind)
    batch = {"x": torch.randn(4, 8)}

    def loss_fn(m, b):
        return m(b["x"]).pow(2).mean()

    flat = FlatBatch.of(batch)
    split = split_step(StepModule(model, loss_fn, flat), tuple(flat.tensors), ["inner", "b"])
    values = tuple(flat.tensors)
    for ch in split.chunks:
        out = ch(*values)
        values = out if isinstance(out, tuple) else (out,)
    values[0].backward()
    got = {ch.model_name(n): p.grad for ch in split.chunks for n, p in ch.named_parameters()}
    loss_fn(model, batch).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, msg=n)


def test_an_autocast_region_the_splitter_cannot_place_is_refused_clearly():
    model = _Wrapped("autocast")
    batch = {"x": torch.randn(4, 8)}
    flat = FlatBatch.of(batch)
    with pytest.raises(ValueError, match="pp=1"):
        split_step(StepModule(model, lambda m, b: m(b["x"]).sum(), flat), tuple(flat.tensors),
                   ["inner"])


def _sequence_parts(rank: int, world: int):
    """Each sequence-parallel layer's forward and gradient on 2 gloo ranks, against the
    whole tensor's in one process (``tp_layers``)."""
    import torch.distributed as dist

    from fitgraph.dist.runtime.tp_layers import GradSum, SeqGather, SeqScatter, _GatheredLinear

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(2, 6, 4, generator=g, dtype=torch.float64)
    w = torch.randn(4, 4, generator=g, dtype=torch.float64)
    mine = whole.chunk(world, 1)[rank]
    out = {}
    x = whole.clone().requires_grad_()
    part = SeqScatter(1, group)(x)
    (part * (rank + 1)).sum().backward()       # each rank's part weighed by its rank
    out["scatter"] = (torch.equal(part, mine), x.grad)
    y = mine.clone().requires_grad_()
    full = SeqGather(1, group)(y)
    (full * full).sum().backward()
    out["gather"] = (torch.equal(full, whole), y.grad)
    b = torch.ones(4, dtype=torch.float64, requires_grad=True)
    (GradSum(group)(b) * mine).sum().backward()
    out["gradsum"] = b.grad
    z = mine.clone().requires_grad_()
    wz = w.chunk(world, 0)[rank].clone().requires_grad_()   # this rank's output features
    lin = _GatheredLinear.apply(z, wz, None, 1, group)
    (lin * lin).sum().backward()
    out["linear"] = (lin, z.grad, wz.grad)
    return out


def test_sequence_parallel_layers_give_the_whole_tensors_results():
    from fitgraph.dist.runtime import run_processes

    g = torch.Generator().manual_seed(0)
    whole = torch.randn(2, 6, 4, generator=g, dtype=torch.float64)
    w = torch.randn(4, 4, generator=g, dtype=torch.float64)
    ranks = run_processes(_sequence_parts, 2, timeout_s=120)
    weights = torch.cat([torch.full((2, 3, 4), r + 1.0, dtype=torch.float64) for r in range(2)], 1)
    for r, out in enumerate(ranks):
        same, grad = out["scatter"]
        # the part is this rank's; the whole tensor's gradient gathers every part's
        assert same and torch.equal(grad, weights)
        same, grad = out["gather"]
        assert same and torch.allclose(grad, 2 * whole.chunk(2, 1)[r])
        # a whole tensor read by each rank's part: the gradient summed over the parts
        assert torch.allclose(out["gradsum"], whole.sum((0, 1)))
        lin, gz, gw = out["linear"]
        x = whole.clone().requires_grad_()
        wx = w.clone().requires_grad_()
        ref = x @ wx.t()
        (ref * ref).sum().backward()
        # the whole sequence's output, this rank's features; the input's gradient summed
        # over the ranks' features, this rank's part of the sequence; the weight's, its rows
        assert torch.allclose(lin, ref.chunk(2, -1)[r])
        assert torch.allclose(gz, x.grad.chunk(2, 1)[r])
        assert torch.allclose(gw, wx.grad.chunk(2, 0)[r])
