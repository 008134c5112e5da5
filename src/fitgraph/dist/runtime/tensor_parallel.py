"""Megatron tensor parallelism of a traced chunk, as the plan's styles say.

The plan names each split weight ``colwise`` (split along its output features) or
``rowwise`` (along its input features), found from the captured graph
(``dist.graph_tp``). Here the chunk's traced modules are rewritten for one shard: a column-
parallel linear keeps its rows of the weight (of each part, where one matmul makes several
projections, Q, K and V, that the model splits apart), its input gradient all-reduced
(Megatron's ``f``); the slice of its output is followed op by op — reshapes into heads,
transposes, attention over heads, elementwise ops — with each op's shape arguments made the
slice's; a row-parallel linear multiplies its slice of the weight's columns and all-reduces
the partial sums before adding its bias (``g``). Anything else that would read a slice — a
norm over the features, an op without a rule here — is refused, naming the op.

With sequence parallelism (``sp``), a row-parallel linear reduce-scatters its sums along the
sequence and what follows it runs on this shard's part of it up to the next column-parallel
linear, which gathers its input: the rules for parts are ``sequence_parallel``'s.

Example (inside a launch; ``parallelize`` calls it):
    >>> shard_chunk(chunk, {"mlp.up.weight": "colwise", ...}, tp_mesh)   # doctest: +SKIP
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from .fx_layouts import ELEMENTWISE as _SAME
from .fx_layouts import SeqSplit, Sharded, TensorParallelError
from .fx_layouts import flat as _flat
from .fx_layouts import ndim as _ndim
from .sequence_parallel import SequenceParallelRules
from .slice_rules import SliceRules
from .stage_split import call_free
from .tp_layers import ColumnLinear, RowLinear

__all__ = ["SeqSplit", "Sharded", "TensorParallelError", "TpParam", "shard_chunk", "untake"]

aten = torch.ops.aten


@dataclass(frozen=True)
class TpParam:
    """How a parameter was split: along ``dim``, each of ``parts`` parts."""

    dim: int
    parts: int


def shard_chunk(chunk: torch.nn.Module, styles: dict[str, str], tp: int, shard: int,
                group, sp: bool = False) -> dict[str, TpParam]:
    """Rewrite ``chunk`` (a ``stage_split.ChunkModule``) for shard ``shard`` of ``tp``;
    ``styles``: model parameter name -> "colwise"/"rowwise"; ``sp``: sequence parallel
    (module doc). Returns how each of its split parameters was split (by model name)."""
    from .stage_split import MODEL

    rw = _Rewrite(styles, tp, shard, group, prefix=f"{MODEL}.", sp=sp)
    body = chunk.body
    ins = [n for n in body.graph.nodes if n.op == "placeholder"]
    outs = rw.run(body, "", [None] * len(ins))
    chunk.tp_partial_grads = rw.partial_names(chunk)
    _tie_uncalled_copies(chunk, rw.shards)
    if any(o is not None for o in outs):
        raise TensorParallelError("a slice of a column-parallel output leaves its pipeline "
                                  "chunk: plan with tp=1 or cut the stages elsewhere")
    missing = sorted(set(styles) & set(chunk.model_names()) - set(rw.split))
    if missing:
        raise TensorParallelError(f"the plan splits {missing[:3]}, which this chunk's trace "
                                  f"does not use as a linear layer's weight")
    return rw.split


def _tie_uncalled_copies(chunk: torch.nn.Module, shard: dict[str, torch.nn.Parameter]) -> None:
    """Where the chunk holds a split layer's weight under another name too, whole (a module
    called more than once leaves uncalled copies in ``torch.export.unflatten``'s tree), that
    name holds the shard: one parameter per model name, and no whole copy kept."""
    for path, module in chunk.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            try:
                mine = shard.get(chunk.model_name(f"{path}.{name}"))
            except ValueError:
                continue      # NOTE: not a parameter of the user's model
            if mine is not None and mine is not p:
                setattr(module, name, mine)


class _Rewrite(SequenceParallelRules, SliceRules):
    def __init__(self, styles, tp, shard, group, prefix, sp: bool = False) -> None:
        self.styles, self.tp, self.shard, self.group, self.prefix = (styles, tp, shard, group,
                                                                     prefix)
        self.sp = sp
        self.split: dict[str, TpParam] = {}
        self.done: dict[int, tuple] = {}
        self.inserted: dict[int, int] = {}   # NOTE: id(module) -> modules put into its graph
        # NOTE: parameters read by parts (their gradients partial): id -> (parameter, reads)
        self.partial: dict[int, list] = {}
        self.gathered: dict[tuple, torch.fx.Node] = {}   # NOTE: (id(module), part) -> whole
        self.modules: list = []
        # NOTE: model name -> its shard: a module the model calls more than once (ALBERT's
        # one layer at every depth) shares its shards' parameters at every call, so that
        # their gradients sum over the calls as the whole weight's do
        self.shards: dict[str, torch.nn.Parameter] = {}

    # ------------------------------------------------------------------ modules
    def run(self, gm: torch.nn.Module, path: str, layouts: list) -> list:
        """Follow ``layouts`` (of ``gm``'s inputs) through ``gm``'s graph; the outputs'."""
        key = id(gm)
        if key in self.done:
            if self.done[key][0] != tuple(layouts):
                raise TensorParallelError(f"module {path or '<chunk>'} is called with inputs "
                                          f"split differently")
            return self.done[key][1]
        lay: dict = {}
        it = iter(layouts)
        changed = False
        self.modules.append(gm)
        for node in list(gm.graph.nodes):
            if node.op == "placeholder":
                lay[node] = next(it, None)
            elif node.op == "get_attr":
                lay[node] = None
            elif node.op == "call_module":
                lay[node] = self._module(gm, path, node, lay)
            elif node.op == "call_function":
                lay[node], edited = self._function(gm, node, lay)
                changed |= edited
            elif node.op == "output":
                if not path:   # NOTE: what leaves the chunk is whole
                    self._gather_inputs(gm, node, lay)
                res = node.args[0]
                outs = [lay.get(r) if isinstance(r, torch.fx.Node) else None
                        for r in (res if isinstance(res, (tuple, list)) else (res,))]
        changed |= key in self.inserted
        if changed and hasattr(gm, "finalize"):
            gm.finalize()
        elif changed and isinstance(gm, torch.fx.GraphModule):
            gm.recompile()
        self.done[key] = (tuple(layouts), outs)
        return outs

    def _module(self, gm, path, node, lay):
        sub = gm.get_submodule(node.target)
        full = f"{path}.{node.target}" if path else node.target
        ins = [lay.get(a) if isinstance(a, torch.fx.Node) else None for a in node.args]
        linear = _linear_of(sub)
        if linear is not None:
            return self._linear(gm, node, sub, full, linear, lay)
        if not hasattr(sub, "graph"):
            self._gather_inputs(gm, node, lay)
            ins = [lay.get(a) if isinstance(a, torch.fx.Node) else None for a in node.args]
            if any(i is not None for i in ins):
                raise TensorParallelError(f"{full} ({type(sub).__name__}) reads a slice and "
                                          f"has no traced graph to follow")
            return None
        outs = self.run(sub, full, ins)
        single = _single_output(sub)
        return outs[0] if single else tuple(outs)

    def _linear(self, gm, node, sub, full, linear, lay):
        wname = self._model_name(f"{full}.{linear['weight']}")
        bname = (self._model_name(f"{full}.{linear['bias']}") if linear["bias"] else None)
        style = self.styles.get(wname)
        if style != "colwise":
            self._gather_inputs(gm, node, lay)   # NOTE: only a column-parallel one gathers itself
        ins = [lay.get(a) if isinstance(a, torch.fx.Node) else None for a in node.args]
        (x,) = ins[:1] or (None,)
        if style is None:
            if x is not None:
                raise TensorParallelError(f"{full} (a linear layer the plan keeps whole) reads "
                                          f"a slice")
            return None
        weight = sub.get_parameter(linear["weight"]).detach()
        bias = sub.get_parameter(linear["bias"]).detach() if linear["bias"] else None
        # NOTE: the weight's dims of the output and input features: (out, in) for a linear,
        # (in, out) for a layer computing x @ weight (Hugging Face's Conv1D)
        out_dim, in_dim = (1, 0) if linear["transposed"] else (0, 1)
        if style == "colwise":
            if x is not None and not isinstance(x, SeqSplit):
                raise TensorParallelError(f"{full} is column-parallel but its input is a slice")
            parts = _parts_of(node, weight.shape[out_dim])
            w = _take(weight, out_dim, parts, self.tp, self.shard)
            b = None if bias is None else _take(bias, 0, parts, self.tp, self.shard)
            new = ColumnLinear(w, b, self.group, linear["transposed"],
                               seq_dim=x.dim if isinstance(x, SeqSplit) else None)
            self.split[wname] = TpParam(out_dim, parts)
            if bname:
                self.split[bname] = TpParam(0, parts)
            out = Sharded(_ndim(node) - 1, parts)
        else:
            if x != Sharded(_ndim(node.args[0]) - 1, 1):
                raise TensorParallelError(f"{full} is row-parallel but its input is not split "
                                          f"along its features ({x})")
            seq = self._seq_dim(node) if self.sp else None
            new = RowLinear(_take(weight, in_dim, 1, self.tp, self.shard), bias, self.group,
                            linear["transposed"], seq_dim=seq)
            self.split[wname] = TpParam(in_dim, 1)
            out = None if seq is None else SeqSplit(seq)
        if wname in self.shards:   # NOTE: another call of one layer: its shards' parameters
            new.weight, new.bias = self.shards[wname], self.shards.get(bname)
        if isinstance(new, RowLinear) and new.bias is not None:
            self.partial.setdefault(id(new.bias), [new.bias, 0])   # NOTE: shard 0 adds it
        self.shards[wname] = new.weight
        if bname:
            self.shards[bname] = new.bias
        _replace_module(gm, node.target, new)
        return out

    def _model_name(self, path: str) -> str:
        return call_free(path[len(self.prefix):] if path.startswith(self.prefix) else path)

    # ------------------------------------------------------------------ ops
    def _function(self, gm, node, lay) -> tuple[object, bool]:
        if node.target is operator.getitem:
            src = lay.get(node.args[0])
            return (src[node.args[1]] if isinstance(src, tuple) else src), False
        if any(isinstance(lay.get(a), SeqSplit) for a in node.all_input_nodes):
            out = self._seq_op(gm, node, lay)
            if out is not None:
                return out, True
            self._gather_inputs(gm, node, lay)
        args = [lay.get(a) if isinstance(a, torch.fx.Node) else None
                for a in _flat(node.args) + _flat(list(node.kwargs.values()))]
        split = [a for a in args if a is not None]
        if not split:
            return None, False
        t = node.target
        if t in _SAME:
            return self._same(gm, node, lay), False
        if t is aten._assert_tensor_metadata.default:
            return self._metadata_check(node), True
        if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            return self._reshape(node, lay)
        if t in (aten.transpose.int, aten.swapaxes.default):
            return self._transpose(node, lay), False
        if t is aten.permute.default:
            s = lay[node.args[0]]
            dims = [d % _ndim(node) for d in node.args[1]]
            return Sharded(dims.index(s.dim), s.parts), False
        if t in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            return self._split(node, lay)
        if t in (aten.matmul.default, aten.bmm.default):
            return self._matmul(node, lay), False
        if t in (aten.scaled_dot_product_attention.default,):
            return self._attention(gm, node, lay), True
        if t in (aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
                 aten._log_softmax.default):
            s = lay[node.args[0]]
            if node.args[1] % _ndim(node) == s.dim:
                raise TensorParallelError(f"{node.name}: a softmax over the split dim")
            return s, False
        if t in (aten.slice.Tensor, aten.select.int, aten.unsqueeze.default,
                 aten.squeeze.dim):
            return self._indexing(node, lay), False
        if t in (aten.cat.default, aten.stack.default):
            return self._cat(node, lay), False
        if t is aten.flatten.using_ints:
            return self._flatten(node, lay), False
        if t is aten.expand.default:
            return self._expand(node, lay), True
        raise TensorParallelError(f"tensor parallelism cannot follow a slice through "
                                  f"{node.name} ({t}): plan with tp=1")


def _linear_of(module) -> dict | None:
    """A traced module that is one linear layer on its own parameters: ``linear(x, weight[,
    bias])``, or ``x @ weight (+ bias)`` with the weight stored (in, out) and ``x`` flattened to
    rows and back around it (Hugging Face's ``Conv1D``: ``"transposed"``)."""
    graph = getattr(module, "graph", None)
    if graph is None:
        if isinstance(module, torch.nn.Linear):
            return {"weight": "weight", "bias": "bias" if module.bias is not None else None,
                    "transposed": False}
        return None
    # NOTE: nothing but the linear: a module that calls others and ends in a linear (a
    # model whose head is a linear on the embedding) is not one
    if any(n.op not in ("placeholder", "get_attr", "call_function", "output")
           for n in graph.nodes):
        return None
    calls = [n for n in graph.nodes if n.op == "call_function"]
    if len(calls) == 1 and calls[0].target is aten.linear.default:
        (call,) = calls
        args = list(call.args) + [None] * (3 - len(call.args))
        weight, bias = args[1], args[2]
        transposed = False
    else:
        mms = [n for n in calls if n.target in (aten.addmm.default, aten.mm.default)]
        if len(mms) != 1 or any(n.target not in _ROWS for n in calls if n is not mms[0]):
            return None
        (call,) = mms
        if call.kwargs:             # NOTE: addmm's beta/alpha scale the sum: not a linear
            return None
        bias, weight = ((call.args[0], call.args[2]) if call.target is aten.addmm.default
                        else (None, call.args[1]))
        transposed = True
    if not (isinstance(weight, torch.fx.Node) and weight.op == "get_attr"):
        return None
    return {"weight": weight.target,
            "bias": bias.target if isinstance(bias, torch.fx.Node) and bias.op == "get_attr"
            else None,
            "transposed": transposed}


# the ops a Conv1D-style layer flattens its input to rows with, and its output back
_ROWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
         aten.sym_size.int, operator.getitem, operator.mul}


def _single_output(module) -> bool:
    out = next(n for n in module.graph.nodes if n.op == "output")
    return not isinstance(out.args[0], (tuple, list))


def _parts_of(node, out_features: int) -> int:
    """How many projections one column-parallel matmul makes: the parts its output is split
    into along the features (Q, K, V; a fused gate and up projection's ``chunk``), else one."""
    for u in node.users:
        if u.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            nd = _ndim(node)
            dim = (u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)) % nd
            sizes = [v.shape[dim] for v in u.meta["val"]]
            if dim == nd - 1 and len(set(sizes)) == 1 and sum(sizes) == out_features:
                return len(sizes)
    return 1


def _take(t: torch.Tensor, dim: int, parts: int, tp: int, shard: int) -> torch.Tensor:
    """Shard ``shard`` of ``t`` along ``dim``: of each of its ``parts`` parts, the
    ``shard``-th of ``tp`` slices, the parts' slices put together."""
    pieces = t.chunk(parts, dim)
    mine = [p.chunk(tp, dim)[shard] for p in pieces]
    return torch.cat(mine, dim).contiguous().clone()


def untake(shards: list[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """The whole tensor from every shard's ``_take`` (in shard order)."""
    split = [s.chunk(parts, dim) for s in shards]
    return torch.cat([torch.cat([sp[p] for sp in split], dim) for p in range(parts)], dim)


def _replace_module(gm, target: str, new: torch.nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    owner = gm.get_submodule(parent) if parent else gm
    setattr(owner, name, new)
