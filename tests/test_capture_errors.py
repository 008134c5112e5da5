"""Each bad input gets a CaptureError (or ValueError at execute) naming the module/op and the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fitgraph
from fitgraph import CaptureError
from fitgraph.execute import execute


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), BranchOnValue())

    def forward(self, x):
        return self.inner(x).sum()


class BranchOnValue(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python control flow
            return x * 2
        return x


class UsesItem(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        scale = self.lin(x).max().item()
        return (self.lin(x) * scale).sum()


class BoolMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h[h > 0].sum()


class StrOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return {"logits": self.lin(x)}


@torch.library.custom_op("fitgraph_test::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class UsesOpaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return opaque(self.lin(x)).sum()


X = torch.randn(3, 4)


def test_data_dependent_branch_names_module():
    with pytest.raises(CaptureError, match="data-dependent") as e:
        fitgraph.capture(Branchy(), X)
    assert e.value.module == "inner.1"
    assert "torch.where" in str(e.value)


def test_item_names_module_and_op():
    with pytest.raises(CaptureError, match="data-dependent") as e:
        fitgraph.capture(UsesItem(), X)
    assert e.value.module == ""
    assert ".item()" in str(e.value)


def test_boolean_mask_indexing():
    with pytest.raises(CaptureError, match="data-dependent|output shape") as e:
        fitgraph.capture(BoolMask(), X)
    assert e.value.op is not None


def test_non_tensor_output_without_loss_fn():
    with pytest.raises(CaptureError, match="no loss tensor.*loss_fn"):
        fitgraph.capture(StrOut(), X)


def test_op_without_fake_kernel():
    with pytest.raises(CaptureError, match="fitgraph_test.opaque.*register_fake") as e:
        fitgraph.capture(UsesOpaque(), X)
    assert "opaque" in e.value.op


def test_non_scalar_loss():
    with pytest.raises(CaptureError, match="must be a scalar"):
        fitgraph.capture(nn.Linear(4, 2), X, lambda m, b: m(b))


def test_no_trainable_parameters():
    m = nn.Linear(4, 1).requires_grad_(False)
    with pytest.raises(CaptureError, match="requires_grad"):
        fitgraph.capture(m, X, lambda m, b: m(b).sum())


def test_loss_under_no_grad():
    def loss_fn(m, b):
        with torch.no_grad():
            return m(b).sum()

    with pytest.raises(CaptureError, match="does not depend on any trainable"):
        fitgraph.capture(nn.Linear(4, 1), X, loss_fn)


def test_unsupported_optimizer_and_flags():
    m = nn.Linear(4, 1)
    with pytest.raises(CaptureError, match="LBFGS is not supported"):
        fitgraph.capture(m, X, lambda m, b: m(b).sum(), torch.optim.LBFGS(m.parameters()))
    with pytest.raises(CaptureError, match="differentiable=False"):
        fitgraph.capture(m, X, lambda m, b: m(b).sum(),
                         torch.optim.RMSprop(m.parameters(), differentiable=True))
    with pytest.raises(CaptureError, match="differentiable=False"):
        fitgraph.capture(m, X, lambda m, b: m(b).sum(),
                         torch.optim.Adam(m.parameters(), differentiable=True))


def test_optimizer_with_foreign_parameter():
    m = nn.Linear(4, 1)
    other = nn.Parameter(torch.zeros(3))
    with pytest.raises(CaptureError, match="not a parameter of the model"):
        fitgraph.capture(m, X, lambda m, b: m(b).sum(), torch.optim.SGD([*m.parameters(), other], lr=0.1))


def test_non_tensor_batch_leaf():
    with pytest.raises(CaptureError, match="batch leaf 1 is a str"):
        fitgraph.capture(nn.Linear(4, 1), (X, "hello"), lambda m, b: m(b[0]).sum())
    m = nn.Linear(4, 1)
    with pytest.raises(CaptureError, match="batch leaf 1 is a int"):   # NOTE: it was an
        fitgraph.optimize(m, (X, 3), lambda m, b: m(b[0]).sum() * b[1],  # AttributeError
                          torch.optim.AdamW(m.parameters()), latency_limit=1.3, time_budget=1)


def test_execute_rejects_other_shapes_and_structures():
    m = nn.Linear(4, 1)
    loss_fn = lambda m, b: m(b[0]).sum()  # noqa: E731
    g = fitgraph.capture(m, (X,), loss_fn)
    with pytest.raises(ValueError, match="captured with .*capture again"):
        execute(g, fitgraph.eager_plan(g), m, (torch.randn(5, 4),))
    with pytest.raises(ValueError, match="structure"):
        execute(g, fitgraph.eager_plan(g), m, [X, X])


def test_optimizer_requires_zeroed_grads():
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = fitgraph.capture(m, X, lambda m, b: m(b).sum(), opt)
    m(X).sum().backward()
    with pytest.raises(ValueError, match="zero_grad"):
        execute(g, fitgraph.eager_plan(g), m, X, opt)


def test_loss_fn_returning_non_tensor():
    with pytest.raises(CaptureError, match="not a tensor"):
        fitgraph.capture(nn.Linear(4, 1), X, lambda m, b: 1.0)


def test_mse_and_ce_losses_capture():
    m = nn.Linear(4, 3)
    g = fitgraph.capture(m, X, lambda m, b: F.mse_loss(m(b), torch.zeros(3, 3)))
    assert any(n.target.startswith("aten.mse_loss") for n in g.nodes)


class Head(nn.Module):
    """``self.head``'s forward runs ``fn(h)`` on its linear layer's output: the module the
    errors below must name."""

    def __init__(self, fn):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.lin(x))


class Wrap(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.head = Head(fn)

    def forward(self, x):
        return self.head(x)


READS = {  # NOTE: each reads a tensor's value into Python
    "item": lambda h: (h * h.max().item()).sum(),
    "tolist": lambda h: (h * h.detach().tolist()[0][0]).sum(),
    "float": lambda h: (h * float(h.max())).sum(),
}


@pytest.mark.parametrize("name", READS)
def test_value_reads_name_module_op_line_and_fix(name):
    with pytest.raises(CaptureError, match="data-dependent") as e:
        fitgraph.capture(Wrap(READS[name]), X)
    assert e.value.module == "head"
    assert e.value.op.startswith("aten._local_scalar_dense") and ".tolist()" in e.value.op
    assert "test_capture_errors.py" in str(e.value)  # NOTE: the line that read the value
    assert "torch.where" in str(e.value) and "outside the step" in str(e.value)


SHAPES = {  # NOTE: each makes a shape from the data
    "nonzero": (lambda h: h[torch.nonzero(h > 0, as_tuple=True)].sum(), "aten.nonzero.default"),
    "where_one_arg": (lambda h: h[torch.where(h > 0)].sum(), "aten.nonzero.default"),
    "boolean_mask": (lambda h: h[h > 0].sum(), "aten.nonzero.default"),
    "masked_select": (lambda h: torch.masked_select(h, h > 0).sum(),
                      "aten.masked_select.default"),
    "unique": (lambda h: torch.unique(h.argmax(-1)).float().sum() + h.sum(),
               "aten._unique2.default"),
}


@pytest.mark.parametrize("name", SHAPES)
def test_data_dependent_shapes_name_module_op_and_fix(name):
    fn, op = SHAPES[name]
    with pytest.raises(CaptureError, match="data-dependent output shape") as e:
        fitgraph.capture(Wrap(fn), X)
    assert (e.value.module, e.value.op) == ("head", op)
    assert "torch.where(mask, x, 0)" in str(e.value)


def test_numpy_names_module_and_fix():
    with pytest.raises(CaptureError, match="NumPy.*torch ops") as e:
        fitgraph.capture(Wrap(lambda h: (h * float(h.detach().numpy().mean())).sum()), X)
    assert (e.value.module, e.value.op) == ("head", ".numpy()")


def test_numpy_in_loss_fn():
    def loss_fn(m, b):
        out = m(b)
        return out.sum() * torch.from_numpy(out.detach().numpy()).mean()

    with pytest.raises(CaptureError, match="NumPy") as e:
        fitgraph.capture(nn.Linear(4, 4), X, loss_fn)
    assert (e.value.module, e.value.op) == ("", ".numpy()")


SPARSE = {
    "sparse_coo_tensor": (lambda h: torch.sparse.mm(torch.sparse_coo_tensor(
        torch.tensor([[0, 1], [1, 2]]), torch.tensor([1.0, 2.0]), (3, 3)), h).sum(),
        "aten._sparse_coo_tensor_with_dims_and_tensors.default"),
    "to_sparse": (lambda h: torch.sparse.sum(h.to_sparse()), "aten._to_sparse.default"),
}


@pytest.mark.parametrize("name", SPARSE)
def test_sparse_tensors_name_module_op_and_fix(name):
    fn, op = SPARSE[name]
    with pytest.raises(CaptureError, match="sparse_coo tensor.*dense") as e:
        fitgraph.capture(Wrap(fn), X)
    assert (e.value.module, e.value.op) == ("head", op)


def test_sparse_embedding_gradient_says_sparse_false():
    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4, sparse=True)

        def forward(self, i):
            return self.emb(i).sum()

    with pytest.raises(CaptureError, match=r"sparse=False") as e:
        fitgraph.capture(Emb(), torch.tensor([1, 2, 3]))
    assert e.value.module == "emb"


def test_parameter_conversion_in_forward():
    class Converts(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            self.lin = self.lin.to(torch.float32)  # NOTE: as Switch Transformers' router does
            return self.lin(x).sum()

    with pytest.raises(CaptureError, match="converts its own parameters.*before") as e:
        fitgraph.capture(Converts(), X)
    assert (e.value.module, e.value.op) == ("", "Module.to() in forward")
