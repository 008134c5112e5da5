"""Convert a traced fx GraphModule into fitgraph's torch-free Graph IR.

Storage identity comes from the FakeTensors' storages (views and in-place results share one);
``getitem`` nodes on multi-output ops become plain output values; mutated arguments come from
the op schema's alias annotations; random ops from the ``nondeterministic_seeded`` tag; FLOPs
from torch's own flop formulas (for the roofline cost model).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import flop_registry

from ..graph.ir import GraphBuilder, Node, Phase, Role, ValueRef
from .errors import CaptureError
from .grouped_mm import grouped_mm_flops
from .tracer import TracedStep

__all__ = ["ConvertState", "check_dense", "dtype_name", "fx_to_builder"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _device_name(t: torch.Tensor) -> str:
    return str(t.device)


def check_dense(t: torch.Tensor, module: str, op: str) -> None:
    """Raise CaptureError for a sparse (or other non-strided) tensor: fitgraph plans storages
    of known bytes, and a sparse tensor's bytes depend on its values (its nnz)."""
    if t.layout is torch.strided:
        return
    raise CaptureError(
        f"{op} makes a {str(t.layout).removeprefix('torch.')} tensor of shape {tuple(t.shape)}; "
        "fitgraph captures dense tensors only (a sparse tensor's memory depends on its values). "
        "Use dense ones: nn.Embedding(..., sparse=False) / nn.EmbeddingBag(..., sparse=False) "
        "(their sparse=True makes sparse gradients), and dense ops or .to_dense() instead of "
        "torch.sparse_coo_tensor / .to_sparse() / torch.sparse.*", module=module, op=op)


class ConvertState:
    """Maps fx nodes and fake storages to IR values and storages during conversion."""

    def __init__(self) -> None:
        self.b = GraphBuilder()
        self.storage_ids: dict[StorageWeakRef, int] = {}
        self.fx_value: dict[torch.fx.Node, int] = {}          # fx node -> value id
        self.fx_multi: dict[torch.fx.Node, list[int | None]] = {}  # multi-output op -> outputs
        self.keepalive: list[torch.Tensor] = []  # NOTE: weakrefs need their storages kept alive
        self.constants: dict[str, torch.Tensor] = {}
        # NOTE: node name -> why torch's FLOP formula failed on it (the graph's meta keeps it:
        # a roofline costs such a node by its bytes alone, and ``auto``'s notes say so)
        self.flop_errors: dict[str, str] = {}

    def value_for(self, t: torch.Tensor, name: str, role: Role, phase: Phase, module: str,
                  producer: int | None, as_input: bool, traced: Any = None) -> int:
        """The IR value of tensor ``t``; ``traced``, the tracer's (fake) twin of a real
        ``t``, shares its storage: the traced ops that view it alias it."""
        self.keepalive.append(t)
        ref = StorageWeakRef(t.untyped_storage())
        st = self.storage_ids.get(ref)
        if st is None:
            st = self.b.new_storage(t.untyped_storage().nbytes(), _device_name(t), role, name)
            self.storage_ids[ref] = st
        if isinstance(traced, torch.Tensor) and traced is not t:
            self.keepalive.append(traced)
            self.storage_ids.setdefault(StorageWeakRef(traced.untyped_storage()), st)
        kwargs = dict(storage=st, stride=t.stride(), offset=t.storage_offset())
        if as_input:
            return self.b.add_input(name, t.shape, dtype_name(t.dtype), role, **kwargs)
        return self.b.new_value(name, t.shape, dtype_name(t.dtype), role=role, phase=phase,
                                module=module, producer=producer, **kwargs)

    def map_arg(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            if a not in self.fx_value:
                raise CaptureError(f"fx node {a.name} is used as a tensor but produced none",
                                   op=str(a.target))
            return ValueRef(self.fx_value[a])
        if isinstance(a, (list, tuple)):
            return type(a)(self.map_arg(x) for x in a)
        if isinstance(a, dict):
            return {k: self.map_arg(v) for k, v in a.items()}
        return a


# NOTE: ops that write their arguments in place without saying so in their schema (torch
# quirk): batch norm updates running_mean/running_var (args 3 and 4) when training.
_UNANNOTATED_MUTATIONS = {
    "aten.native_batch_norm.default": (3, 4),
    "aten.cudnn_batch_norm.default": (3, 4),
    "aten.miopen_batch_norm.default": (3, 4),
}


def _mutated_args(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[Any]:
    out = [args[i] for i in _UNANNOTATED_MUTATIONS.get(_op_name(op), ()) if i < len(args)]
    for i, sarg in enumerate(op._schema.arguments):
        if sarg.alias_info is not None and sarg.alias_info.is_write:
            if i < len(args):
                out.append(args[i])
            elif sarg.name in kwargs:
                out.append(kwargs[sarg.name])
    return out


# NOTE: ops torch's flop_registry has no formula for
_EXTRA_FLOPS = {torch.ops.aten._grouped_mm: grouped_mm_flops}


def _flops(op: torch._ops.OpOverload, node: torch.fx.Node, errors: dict[str, str]) -> float:
    fn = flop_registry.get(op.overloadpacket) or _EXTRA_FLOPS.get(op.overloadpacket)
    if fn is None:
        return 0.0
    args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
    try:
        return float(fn(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception as e:  # NOTE: a formula that rejects odd arguments loses the FLOP estimate
        errors[node.name] = f"{_op_name(op)}: {type(e).__name__}: {e}"[:200]
        return 0.0


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _fake_twin(traced: TracedStep, t: torch.Tensor) -> torch.Tensor | None:
    """The fake tensor the traced ops read for real constant ``t``: a view of it must alias
    the constant, not become a fresh activation (BEiT's relative-position index, viewed in
    every layer, once was one, and the remat evaluator and simulator disagreed on it)."""
    mode = traced.fake_mode
    if mode is None or isinstance(t, FakeTensor):
        return None
    try:
        return mode.from_tensor(t)   # NOTE: memoised: the same twin the tracer made
    except Exception:  # NOTE: no twin only loses the aliasing, as before
        return None


def _escaped(name: str, module: str) -> CaptureError:
    """The step reads a tensor an earlier trace made: state an object made on first use while a
    step was captured before, which holds that trace's placeholder (no data) ever since."""
    return CaptureError(
        f"the step reads a tensor ({name}) that an earlier capture made, a placeholder without "
        "data: state an object made on first use while a step was traced, kept beyond it. "
        "Make that object again and use it once before planning (fitgraph makes a "
        "torch.amp.GradScaler's first scale itself)", module=module, op=f"get_attr {name}")


def fx_to_builder(traced: TracedStep, input_names: list[tuple[str, Role]]) -> tuple[ConvertState, dict[str, int], list[str]]:
    """Convert ``traced.gm``; return the state, the outputs map and names of params with no grad."""
    cs = ConvertState()
    gm = traced.gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(input_names):
        raise CaptureError(f"traced graph has {len(placeholders)} inputs, expected "
                           f"{len(input_names)}")
    for ph, (name, role) in zip(placeholders, input_names):
        check_dense(ph.meta["val"], "", name)
        cs.fx_value[ph] = cs.value_for(ph.meta["val"], name, role, Phase.INPUT, "", None, True)
    constants: dict[str, torch.Tensor] = {}
    outputs: dict[str, int] = {}
    no_grad: list[str] = []
    for index, node in enumerate(gm.graph.nodes):
        phase, module = traced.tracker.at(index)
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            t = getattr(gm, node.target)
            if isinstance(t, FakeTensor):
                raise _escaped(node.target, module)
            constants[node.target] = t
            cs.fx_value[node] = cs.value_for(t, f"const:{node.target}", Role.CONSTANT,
                                             Phase.INPUT, "", None, True,
                                             traced=_fake_twin(traced, t))
            continue
        if node.op == "output":
            loss, *grads = node.args[0]  # NOTE: make_fx flattens (loss, [grads])
            outputs["loss"] = cs.fx_value[loss]
            for pname, g in zip(traced.param_names, grads):
                if g is None:
                    no_grad.append(pname)
                else:
                    outputs[f"grad:{pname}"] = cs.fx_value[g]
            continue
        if node.target is operator.getitem:
            src, idx = node.args
            vid = cs.fx_multi[src][idx]
            if vid is not None:
                cs.fx_value[node] = vid
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            raise CaptureError(f"traced a call to {node.target!r}, which is not an ATen op; "
                               "fitgraph executes ATen graphs only", module=module,
                               op=str(node.target))
        _convert_op(cs, node, phase, module)
    cs.constants = constants
    return cs, outputs, no_grad


def _convert_op(cs: ConvertState, node: torch.fx.Node, phase: Phase, module: str) -> None:
    op: torch._ops.OpOverload = node.target
    val = node.meta.get("val")
    nid = len(cs.b.nodes)
    name = node.name
    role = Role.ACTIVATION if phase in (Phase.FORWARD, Phase.LOSS) else Role.TEMPORARY
    args = cs.map_arg(node.args)
    kwargs = cs.map_arg(node.kwargs)
    inputs = [cs.fx_value[n] for n in node.all_input_nodes]
    # NOTE: a list argument written in place (``Tensor(a!)[]``: ``_foreach_mul_``, as CUDA's
    # default gradient clipping runs it) mutates each of its tensors
    mutates = [cs.fx_value[a] for arg in _mutated_args(op, node.args, node.kwargs)
               for a in (arg if isinstance(arg, (list, tuple)) else [arg])
               if isinstance(a, torch.fx.Node)]
    is_tuple = isinstance(val, (tuple, list))
    vals = list(val) if is_tuple else [val]
    out_ids: list[int | None] = []
    for i, v in enumerate(vals):
        if isinstance(v, torch.Tensor):
            check_dense(v, module, _op_name(op))
            out_ids.append(cs.value_for(v, name if not is_tuple else f"{name}.{i}", role, phase,
                                        module, nid, False))
        else:
            out_ids.append(None)
    ins = tuple(dict.fromkeys(inputs))
    in_bytes = sum(_nbytes(n.meta.get("val")) for n in node.all_input_nodes)
    out_bytes = sum(_nbytes(v) for v in vals)
    cs.b.nodes.append(Node(
        id=nid, name=name, target=_op_name(op), args=tuple(args), kwargs=dict(kwargs),
        inputs=ins, outputs=tuple(out_ids), mutates=tuple(dict.fromkeys(mutates)), phase=phase,
        module=module, random=_draws(op, node),
        flops=_flops(op, node, cs.flop_errors), bytes_moved=in_bytes + out_bytes, out_is_tuple=is_tuple))
    if is_tuple:
        cs.fx_multi[node] = out_ids
    elif out_ids[0] is not None:
        cs.fx_value[node] = out_ids[0]


def _draws(op: torch._ops.OpOverload, node: torch.fx.Node) -> bool:
    """Whether the op draws random numbers: tagged as seeded, unless its dropout probability
    (an attention's ``dropout_p``) is 0.

    NOTE: torch tags every fused attention as seeded, for its dropout. Without dropout it
    draws nothing, and marked random it could not be re-made in the backward (the copies
    would draw again): ALBERT's attention was kept whole from its forward to its backward."""
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            p = node.kwargs.get(arg.name, node.args[i] if i < len(node.args) else
                                arg.default_value)
            return not (isinstance(p, (int, float)) and p == 0)
    return True


def _op_name(op: torch._ops.OpOverload) -> str:
    ns = op.namespace
    return f"{ns}.{op._schema.name.split('::')[-1]}.{op._overloadname}"
