"""Capture + eager plan on every layer kind the issue names: bitwise equal to eager PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import check_same_as_eager

from fitgraph import Phase, Role


class Conv1dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.up = nn.ConvTranspose1d(8, 4, 2, stride=2)
        self.gn = nn.GroupNorm(2, 4)
        self.pool = nn.AvgPool1d(2)

    def forward(self, x):
        return self.pool(F.silu(self.gn(self.up(F.relu(self.conv(x))))))


class Conv2dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.ups = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.near = nn.Upsample(scale_factor=0.5, mode="nearest")
        self.head = nn.Conv2d(8, 5, 1)
        self.gap = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        h = self.pool(F.relu(self.bn(self.conv(x))))
        h = self.near(self.ups(self.up(h)))
        return self.head(h), self.gap(h).flatten(1)


class TinyTransformer(nn.Module):
    """Embedding, LayerNorm, RMSNorm, SDPA and hand-written causal attention, dropout, GELU,
    weight tying."""

    def __init__(self, vocab=50, d=16, heads=2, t=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.rms = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.qkv2 = nn.Linear(d, 3 * d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # NOTE: weight tying
        self.heads = heads
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)),
                             persistent=False)

    def _split(self, x):
        b, t, _ = x.shape
        return [z.view(b, t, self.heads, -1).transpose(1, 2) for z in x.chunk(3, dim=-1)]

    def forward(self, ids):
        x = self.drop(self.emb(ids))
        q, k, v = self._split(self.qkv(self.ln(x)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)
        x = x + a.transpose(1, 2).reshape(x.shape)
        q, k, v = self._split(self.qkv2(self.rms(x)))
        s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        t = ids.shape[1]
        s = s.masked_fill(~self.mask[:t, :t], float("-inf"))
        a = self.drop(F.softmax(s, dim=-1)) @ v
        x = x + a.transpose(1, 2).reshape(x.shape)
        x = x + self.drop(self.mlp(x))
        return self.head(x)


def lm_loss(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x, labels):
        logits = self.lin(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


class TupleIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(2, 4)

    def forward(self, x, z):
        return (self.a(x) * self.b(z)).square().mean()


SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-2, nesterov=False)  # noqa: E731
ADAM = lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=1e-2, amsgrad=True)  # noqa: E731
ADAMW = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731


def test_conv1d_groupnorm_transposed_pooling():
    torch.manual_seed(0)
    check_same_as_eager(Conv1dNet(), torch.randn(3, 4, 16),
                        lambda m, x: m(x).square().mean(), SGD, steps=2)


def test_conv2d_batchnorm_upsample_two_losses():
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 16, 16), torch.randn(4, 5, 16, 16)
    labels = torch.randint(0, 8, (4,))

    def loss_fn(m, b):
        out, pooled = m(b[0])
        return F.mse_loss(out, b[1]) + F.cross_entropy(pooled, b[2])

    g = check_same_as_eager(Conv2dNet(), (x, y, labels), loss_fn, ADAM, steps=2)
    assert any(n.target == "aten.native_batch_norm.default" and n.mutates for n in g.nodes)


@pytest.mark.parametrize("make_opt", [None, SGD, ADAMW], ids=["no-opt", "sgd", "adamw"])
def test_transformer_attention_dropout_tying(make_opt):
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (4, 8))
    g = check_same_as_eager(TinyTransformer(), ids, lm_loss, make_opt, steps=2)
    assert any(n.random for n in g.nodes), "dropout must be marked random"
    tied = [n for n in g.input_names if n.startswith("param:") and "weight" in n
            and ("emb" in n or "head" in n)]
    assert tied == ["param:emb.weight"], "tied weights are one parameter"


def test_dict_output_with_loss_and_tuple_batch():
    torch.manual_seed(0)
    check_same_as_eager(DictOut(), {"x": torch.randn(5, 6), "labels": torch.randint(0, 3, (5,))})
    check_same_as_eager(TupleIn(), (torch.randn(5, 6), torch.randn(5, 2)))


def test_grad_accumulates_like_eager():
    torch.manual_seed(0)
    check_same_as_eager(TupleIn(), (torch.randn(5, 6), torch.randn(5, 2)), steps=3)


def test_metadata_roles_phases_modules():
    torch.manual_seed(0)
    model = TinyTransformer()
    import fitgraph

    g = fitgraph.capture(model, torch.randint(0, 50, (2, 8)), lm_loss,
                         torch.optim.Adam(model.parameters()))
    phases = [n.phase for n in g.nodes]
    # phases come in eager order: forward, loss, backward, optimizer
    order = [Phase.FORWARD, Phase.LOSS, Phase.BACKWARD, Phase.OPTIMIZER]
    assert [order.index(p) for p in phases] == sorted(order.index(p) for p in phases)
    mods = {n.module for n in g.nodes if n.phase is Phase.FORWARD}
    assert {"emb", "ln", "rms", "qkv", "mlp.0", "mlp.2", "head"} <= mods
    bwd_mods = {n.module for n in g.nodes if n.phase is Phase.BACKWARD}
    assert {"qkv", "mlp.0", "ln"} <= bwd_mods, "backward ops carry their module path"
    roles = {g.storages[g.values[v].storage].role for v in g.inputs}
    assert roles == {Role.PARAMETER, Role.BUFFER, Role.INPUT}
    assert g.storages[g.values[g.outputs["loss"]].storage].role is Role.OUTPUT
    assert all(g.storages[g.values[v].storage].role is Role.GRADIENT
               for k, v in g.outputs.items() if k.startswith("grad:"))
    for v in g.values:
        assert v.dtype and len(v.shape) == len(v.stride)
    # views share storage with their base
    t_nodes = [n for n in g.nodes if n.target == "aten.t.default"]
    assert t_nodes and all(g.values[n.outputs[0]].storage == g.values[n.inputs[0]].storage
                           for n in t_nodes)


def test_second_capture_after_state_exists_differs_and_mismatch_is_caught():
    import fitgraph
    from fitgraph.execute import execute
    from fitgraph.execute.optimizer_ops import OptimizerStateMismatch

    torch.manual_seed(0)
    model = TupleIn()
    opt = torch.optim.Adam(model.parameters())
    batch = (torch.randn(5, 6), torch.randn(5, 2))
    g1 = fitgraph.capture(model, batch, None, opt)
    execute(g1, fitgraph.eager_plan(g1), model, batch, opt)
    opt.zero_grad(set_to_none=True)
    with pytest.raises(OptimizerStateMismatch, match="capture the step again"):
        execute(g1, fitgraph.eager_plan(g1), model, batch, opt)
    g2 = fitgraph.capture(model, batch, None, opt)
    assert any(k.startswith("state:") for k in g2.input_names)


class TransposedUse(nn.Module):
    """w used permuted: autograd's gradient for w arrives as a permuted (non-contiguous) view,
    which AccumulateGrad copies to w's layout; channels_last conv weights keep theirs."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.w = nn.Parameter(torch.randn(2, 3, 4))

    def forward(self, x):
        h = self.conv(x).mean((2, 3))                       # (2, 4)
        return (h[:, :, None, None] * self.w.permute(2, 0, 1)).square().mean()


def test_gradient_layout_follows_parameter_like_autograd():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    a, b = TransposedUse(), TransposedUse()
    b.load_state_dict(a.state_dict())
    a(x).backward()
    import fitgraph
    from fitgraph.execute import execute

    g = fitgraph.capture(b, x)
    assert any(n.target == "aten.empty_strided.default" for n in g.nodes)
    execute(g, fitgraph.eager_plan(g), b, x)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert pa.grad.stride() == pb.grad.stride(), n
        assert torch.equal(pa.grad, pb.grad), n


class _Attention(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.qkv, self.dropout = nn.Linear(16, 48), dropout

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout)


@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_fused_attention_draws_only_with_dropout(dropout):
    # NOTE: torch tags the fused attention ops as seeded (for their dropout); without it they
    # draw nothing, and marked random they could not be re-made in the backward as copies
    torch.manual_seed(0)
    g = check_same_as_eager(_Attention(dropout), torch.randn(2, 8, 16),
                            lambda m, x: m(x).square().mean())
    fused = [n for n in g.nodes if "scaled_dot_product" in n.target and n.phase is Phase.FORWARD]
    if dropout:   # NOTE: on the CPU, attention with dropout runs unfused, its mask drawn
        assert any(n.random for n in g.nodes)
    else:
        assert fused and not any(n.random for n in g.nodes)
