"""``capture.fold_tables``: a table the step builds in place from nothing and reads again in
the backward (BEiT's relative position index) is a constant of the graph, as eager's cache
holds it: one graph whether or not the trace saw the cache."""

from __future__ import annotations

import copy

import torch
from test_fission import assert_simulator_tells_truth

import fitgraph
from fitgraph.capture.fold_tables import FOLDED_PREFIX
from fitgraph.execute import execute


def relative_index(w: int) -> torch.Tensor:
    """BEiT's relative position index for a ``w x w`` window and a class token, built as
    Hugging Face builds it: coordinates shifted in place, written into slices of zeros."""
    coords = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(w), indexing="ij"))
    flat = torch.flatten(coords, 1)
    rel = (flat[:, :, None] - flat[:, None, :]).permute(1, 2, 0).contiguous()
    rel[:, :, 0] += w - 1
    rel[:, :, 1] += w - 1
    rel[:, :, 0] *= 2 * w - 1
    n = (2 * w - 1) ** 2 + 3
    index = torch.zeros((w * w + 1,) * 2, dtype=rel.dtype)
    index[1:, 1:] = rel.sum(-1)
    index[0, 0:] = n - 3
    index[0:, 0] = n - 2
    index[0, 0] = n - 1
    return index


class BiasedBlocks(torch.nn.Module):
    """Blocks whose scores add a relative position bias gathered by the index; ``cached``:
    the index built once and kept (eager's cache), else built in every forward."""

    def __init__(self, cached: bool, w: int = 4, dim: int = 16, blocks: int = 3,
                 per_block: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w, self.cached = w, relative_index(w) if cached else None
        self.per_block = per_block     # NOTE: each block builds its own (BEiT's layers do)
        n = (2 * w - 1) ** 2 + 3
        self.tables = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n) * 0.1)
                                             for _ in range(blocks))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(blocks))

    def forward(self, x):
        index = self.cached
        if index is None and not self.per_block:
            index = relative_index(self.w)
        t = x.shape[1]
        for table, proj in zip(self.tables, self.proj):
            if self.per_block:
                index = relative_index(self.w)
            bias = table[index.view(-1)].view(t, t)
            x = x + ((x @ x.transpose(1, 2)) * 0.1 + bias).softmax(-1) @ proj(x)
        return x


def _loss(m, x):
    return m(x).square().mean()


X = torch.randn(2, 17, 16, generator=torch.Generator().manual_seed(1))


def test_a_table_built_in_place_each_step_is_the_constant_a_cache_would_hold():
    built = BiasedBlocks(cached=False)
    g = fitgraph.capture(built, X, _loss)
    folded = [n for n in g.input_names if n.startswith(f"const:{FOLDED_PREFIX}")]
    assert len(folded) == 1
    assert not any(n.mutates for n in g.nodes if n.phase.value == "forward")
    assert not any(n.target == "aten.zeros.default" for n in g.nodes)
    key = folded[0].removeprefix("const:")
    assert torch.equal(g.meta["constants"][key].long(), relative_index(4))
    # NOTE: the graph of the model that caches its index: the same nodes
    cached = fitgraph.capture(BiasedBlocks(cached=True), X, _loss)
    assert [n.target for n in g.nodes] == [n.target for n in cached.nodes]
    # NOTE: bitwise eager's, twice (the constant is not written by a step); law 2
    a, b = copy.deepcopy(built), copy.deepcopy(built)
    for _ in range(2):
        want = _loss(a, X)
        want.backward()
        got = execute(g, fitgraph.eager_plan(g), b, X)
        assert torch.equal(got, want.detach())
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
        a.zero_grad(set_to_none=True)
        b.zero_grad(set_to_none=True)
    assert_simulator_tells_truth(g, built, X)
    # NOTE: built alike by every block: one constant, as one cache entry
    g = fitgraph.capture(BiasedBlocks(cached=False, per_block=True), X, _loss)
    assert len([n for n in g.input_names if n.startswith(f"const:{FOLDED_PREFIX}")]) == 1
    assert [n.target for n in g.nodes] == [n.target for n in cached.nodes]


def test_a_table_read_by_the_forward_alone_or_built_from_the_batch_stays_in_the_graph():
    def forward_only(m, x):
        t = torch.zeros(16, 16)
        t[1:] = 1.0
        return (m(x) + t.sum()).square().mean()   # NOTE: its gradient does not read t

    def from_batch(m, x):
        t = torch.zeros(16, 16)
        t[1:] = x[1:]         # NOTE: data: not a constant
        return (m(x) * t).square().mean()

    model, x = torch.nn.Linear(16, 16), torch.randn(16, 16)
    for loss_fn in (forward_only, from_batch):
        g = fitgraph.capture(model, x, loss_fn)
        assert not any(n.startswith(f"const:{FOLDED_PREFIX}") for n in g.input_names)
        assert any(n.target == "aten.zeros.default" for n in g.nodes)


def test_a_folded_index_table_is_held_as_int32_where_only_indices_read_it():
    """Read as indices alone (the gather and its gradient's scatter), the table is int32: half
    the bytes, resident for the whole step, with bitwise eager's results; read otherwise too
    (arithmetic), it stays int64."""
    built = BiasedBlocks(cached=False)
    g = fitgraph.capture(built, X, _loss)
    vid = next(v for v, n in zip(g.inputs, g.input_names) if n.startswith(f"const:{FOLDED_PREFIX}"))
    table = g.values[vid]
    assert table.dtype == "int32"
    assert g.storages[table.storage].nbytes == relative_index(4).numel() * 4
    assert all(v.dtype == "int32" for v in g.values if v.storage == table.storage)
    a, b = copy.deepcopy(built), copy.deepcopy(built)
    want = _loss(a, X)
    want.backward()
    got = execute(g, fitgraph.eager_plan(g), b, X)
    assert torch.equal(got, want.detach())
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    assert_simulator_tells_truth(g, built, X)

    def also_added(m, x):
        index = relative_index(4)
        bias = m.tables[0][index.view(-1)].view(17, 17)
        return (m(x) + bias.sum() + index.sum()).square().mean() + (bias * index).sum()

    g = fitgraph.capture(built, X, also_added)
    folded = [v for v, n in zip(g.inputs, g.input_names) if n.startswith(f"const:{FOLDED_PREFIX}")]
    assert folded and all(g.values[v].dtype == "int64" for v in folded)
