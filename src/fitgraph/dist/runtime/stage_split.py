"""A plan's pipeline chunks cut from the user's whole training step (model and loss).

The step — ``loss_fn(model, batch)`` on the batch's tensors — is traced once
(``torch.distributed.pipelining.pipeline``, i.e. ``torch.export``) and cut where each chunk after
the first begins (its first block, a module path such as ``h.2``). Each chunk becomes a
``ChunkModule`` that takes every value crossing the cut before it and returns every value
crossing the cut after it: the batch's labels read by the last chunk, an attention mask read
by all of them, or an activation skipping a chunk travel forward with the activations (the
schedules pass one chunk's outputs to the next only). The last chunk returns the loss.

A parameter used by several chunks (a tied embedding and head) is a copy in each
(``SplitStep.shared``); their gradients are summed between the chunks' ranks after the
backward (``dist.runtime.step``).

Example (one process, no pipeline: a split is a local thing):
    >>> import torch
    >>> from fitgraph.dist.runtime.batches import FlatBatch
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> flat = FlatBatch.of((torch.randn(2, 4), torch.randn(2, 2)))
    >>> step = StepModule(net, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), flat)
    >>> split = split_step(step, tuple(flat.tensors), ["1"])
    >>> len(split.chunks), split.chunks[0].model_names()[:1]
    (2, ['0.weight'])
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch

from ...capture.calling import compute_loss
from .batches import FlatBatch
from .loss_weights import LossWeights, find_loss_weights

__all__ = ["ChunkModule", "SplitStep", "StepModule", "chunk_metas", "split_step"]

MODEL = "model"      # the user's model's attribute in StepModule: its parameters' FQN prefix
END = ":end"         # a cut after a module (``"h.3:end"``), not before it


class StepModule(torch.nn.Module):
    """``loss_fn(model, batch)`` as a module of the batch's tensor leaves."""

    def __init__(self, model: torch.nn.Module, loss_fn, flat: FlatBatch) -> None:
        super().__init__()
        setattr(self, MODEL, model)
        self.loss_fn = loss_fn
        self.flat = flat

    def forward(self, *tensors):
        return compute_loss(getattr(self, MODEL), self.flat.rebuild(tensors), self.loss_fn)


class ChunkModule(torch.nn.Module):
    """One chunk of the traced step: the values crossing the cut before it in, those crossing
    the cut after it out (the loss, for the last chunk)."""

    def __init__(self, body: torch.fx.GraphModule, index: int, ins: list[str], outs: list[str],
                 call: tuple[list[str], list[str], bool]) -> None:
        super().__init__()
        self.body = body
        self.index = index
        self._ins, self._outs, self._call = ins, outs, call
        self.aliases: dict[str, str] = {}   # a tied parameter's other names -> its first

    def forward(self, *values):
        env = dict(zip(self._ins, values))
        args, results, whole = self._call
        out = self.body(*(env[a] for a in args))
        if whole:  # NOTE: the chunk's result is read as it is, not item by item
            env[results[0]] = out
        else:
            for name, value in zip(results, out):
                if name:
                    env[name] = value
        # NOTE: what crosses to another rank is sent as one buffer: a view (a slice of a
        # mask) is made contiguous, the receiving buffer being so
        got = tuple(v.contiguous() if isinstance(v, torch.Tensor) else v
                    for v in (env[n] for n in self._outs))
        return got[0] if len(got) == 1 else got

    def model_names(self) -> list[str]:
        """This chunk's parameters by their names in the user's model."""
        return [self.model_name(n) for n, _ in self.named_parameters()]

    def model_name(self, chunk_param: str) -> str:
        """The user's model's name of this chunk's parameter ``chunk_param``: for a tied one
        (``lm_head.weight`` is ``transformer.wte.weight``), the name ``named_parameters()``
        gives it."""
        name = model_name(chunk_param)
        return self.aliases.get(name, name)


def model_name(chunk_param: str) -> str:
    """``body.model.h.1.ln_1.weight`` → ``h.1.ln_1.weight``; a module the model calls more
    than once (ALBERT's one layer at every depth) is ``layer@2`` at its third call in the
    exported chunks (``torch.export.unflatten``'s names): its parameters are ``layer``'s."""
    prefix = f"body.{MODEL}."
    if not chunk_param.startswith(prefix):
        raise ValueError(f"{chunk_param}: not a parameter of the user's model")
    return call_free(chunk_param[len(prefix):])


_CALL = re.compile(r"@\d+(?=\.|$)")


def call_free(path: str) -> str:
    """``path`` without the call numbers ``torch.export.unflatten`` gives a module's later
    calls.

    Example:
        >>> call_free("encoder.layer@2.attention@2.query.weight")
        'encoder.layer.attention.query.weight'
    """
    return _CALL.sub("", path)


@dataclass
class SplitStep:
    chunks: list[ChunkModule]
    shared: list[str]            # model parameter names held by more than one chunk
    weights: LossWeights | None = None   # each micro-batch's weight in the whole loss
    weights_note: str = ""               # why micro-batches weigh alike, where that matters


def split_step(step: StepModule, micro_args: tuple, starts: list[str]) -> SplitStep:
    """``step`` traced on one micro-batch (``micro_args``) and cut before each module path in
    ``starts`` (paths in the user's model, at the module's first call or the one its
    ``@n`` names; ``path + END``: after it)."""
    modules = dict(getattr(step, MODEL).named_modules())
    for path in starts:
        path = call_free(path.removesuffix(END))
        if path not in modules:
            raise ValueError(f"the plan cuts the model before {path!r}, which is not a module "
                             f"of {type(getattr(step, MODEL)).__name__}: a plan made for "
                             f"another model?")
    with _cut_at_calls(modules, starts):
        pipe = _pipeline(step, micro_args)
    if pipe.num_stages != len(starts) + 1:
        raise ValueError(f"tracing the step cut it into {pipe.num_stages} chunks, not "
                         f"{len(starts) + 1}: a cut point ({starts}) is not on the path from "
                         f"the batch to the loss")
    top = pipe.split_gm.graph
    calls = [n for n in top.nodes if n.op == "call_module"]
    position = {}                # value name -> the chunk that makes it (-1: the batch)
    for n in top.nodes:
        if n.op == "placeholder":
            position[n.name] = -1
    for i, c in enumerate(calls):
        position[c.name] = i
        for u in c.users:
            if u.op == "call_function":  # a getitem of the chunk's outputs
                position[u.name] = i
    last = len(calls)
    uses: dict[str, list[int]] = {k: [] for k in position}
    for i, c in enumerate(calls):
        for a in c.args:
            if not isinstance(a, torch.fx.Node):
                raise ValueError(f"chunk {i} reads a constant {a!r} of the traced step")
            uses[a.name].append(i)
    output = next(n for n in top.nodes if n.op == "output")
    (result,) = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    uses[result.name].append(last)
    order = list(position)
    placeholders = [k for k in order if position[k] == -1]

    def crossing(i: int) -> list[str]:  # values made before chunk i and read at or after it
        if i == 0:
            return placeholders
        return [k for k in order if position[k] < i and any(u >= i for u in uses[k])]

    # NOTE: the traced modules run their generated code, not torch.fx.Interpreter node by node
    # (Python per op: a step of GPT-2 small was twice the measured ops' time)
    for module in pipe.split_gm.modules():
        if hasattr(module, "_run_with_interpreter"):
            _unshadow_self(module)
            module._run_with_interpreter = False
    # NOTE: a parameter tied by assignment (Hugging Face's lm_head.weight = wte.weight) is
    # reached under each name by the chunk that uses it: named by its first name everywhere
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for n, p in getattr(step, MODEL).named_parameters(remove_duplicate=False):
        aliases[n] = first.setdefault(id(p), n)
    aliases = {k: v for k, v in aliases.items() if k != v}
    chunks = []
    for i, c in enumerate(calls):
        args = [a.name for a in c.args]
        getitems = {u.args[1]: u.name for u in c.users if u.op == "call_function"}
        if getitems:
            results = [getitems.get(j, "") for j in range(max(getitems) + 1)]
        else:
            results = [c.name]
        outs = crossing(i + 1) if i + 1 < last else [result.name]
        chunks.append(ChunkModule(pipe.get_stage_module(i), i, crossing(i), outs,
                                  (args, results, not getitems)))
        chunks[-1].aliases = aliases
    held: dict[str, int] = {}
    for ch in chunks:
        for name in set(ch.model_names()):
            held[name] = held.get(name, 0) + 1
    body = chunks[-1].body
    inner = [n.name for n in body.graph.nodes if n.op == "placeholder"]
    root_leaf = {name: placeholders.index(a.name) for name, a in zip(inner, calls[-1].args)
                 if a.name in placeholders}
    weights, note = find_loss_weights(body, root_leaf)
    return SplitStep(chunks, sorted(n for n, k in held.items() if k > 1), weights, note)


@contextlib.contextmanager
def _cut_at_calls(modules: dict, paths: list[str]):
    """``pipe_split()`` before (after, for ``path + END``) one call of each module in
    ``paths`` while the step is traced: its first, or the one named as
    ``torch.export.unflatten`` names a module's later calls (``layer@2``: the third; ALBERT
    calls one layer at every depth) — where torch's ``SplitPoint``s, by module, would cut at
    every call."""
    from torch.distributed.pipelining import pipe_split

    cuts: dict[str, dict[int, bool]] = {}   # module path -> call number -> after it
    for p in paths:
        path = p.removesuffix(END)
        base, _, number = path.rpartition("@") if "@" in path else (path, "", "0")
        if "@" in base or not number.isdigit():
            raise ValueError(f"the plan cuts the model at {path!r}: a call of a module inside "
                             f"a module called more than once, which the runtime cannot cut "
                             f"at; plan without a pipeline (pp=1)")
        cuts.setdefault(base, {})[int(number)] = p.endswith(END)
    saved = {}
    for base, at in cuts.items():
        module = modules[base]
        forward, calls = module.forward, [0]

        def counted(*args, _forward=forward, _at=at, _calls=calls, **kwargs):
            n = _calls[0]
            _calls[0] += 1
            if _at.get(n) is False:
                pipe_split()
            out = _forward(*args, **kwargs)
            if _at.get(n):
                pipe_split()
            return out

        saved[base] = (module, "forward" in vars(module), forward)
        module.forward = counted
    try:
        yield
    finally:
        for module, own, forward in saved.values():
            if own:
                module.forward = forward
            else:
                del module.forward


def _pipeline(step: StepModule, micro_args: tuple):
    """``torch.distributed.pipelining.pipeline`` of ``step``, its trace's no-grad regions
    inlined first (``grad_regions``), each rebuilt module checked to be called with its
    inputs."""
    from torch.distributed.pipelining import _IR, pipeline

    from .grad_regions import inline_grad_regions

    traced = _IR.Pipe._trace_with_export

    def trace(mod, args, kwargs=None):
        ep = traced(mod, args, kwargs)
        inline_grad_regions(ep)
        return ep

    _IR.Pipe._trace_with_export = staticmethod(trace)
    try:
        pipe = pipeline(step, micro_args)   # NOTE: cut where the trace met pipe_split()
    except Exception as e:
        raise ValueError(
            f"torch.distributed.pipelining could not trace and cut the step ({type(e).__name__}"
            f": {e}). A region under torch.autocast or torch.enable_grad inside a module, or "
            f"another higher-order op, is beyond torch 2.13's splitter: plan without a pipeline "
            f"(pp=1), or move that code out of the module") from e
    finally:
        _IR.Pipe._trace_with_export = staticmethod(traced)
    for name, module in pipe.split_gm.named_modules():
        for node in module.graph.nodes if hasattr(module, "graph") else ():
            sub = module.get_submodule(node.target) if node.op == "call_module" else None
            if not hasattr(sub, "graph"):
                continue
            wanted = sum(1 for n in sub.graph.nodes if n.op == "placeholder")
            given = len(node.args) + len(node.kwargs)
            if given < wanted:
                path = f"{name}.{node.target}".split(f".{MODEL}.", 1)[-1]
                raise ValueError(
                    f"tracing the step for pipelining lost the inputs of module {path!r} "
                    f"({wanted} wanted, {given} given): torch.distributed.pipelining cannot "
                    f"place what it runs (a region under torch.enable_grad or torch.autocast, "
                    f"or another higher-order op, inside it). Plan without a pipeline (pp=1), "
                    f"or run that code outside the module")
    return pipe


def _unshadow_self(module: torch.nn.Module) -> None:
    """A value named ``self`` in a traced module's graph renamed, its code made again."""
    # NOTE: a submodule named ``self`` (BERT's attention keeps its own in ``self.self``) makes
    # a value of that name, which the generated code assigns to ``self``, shadowing the module
    # for the calls after it
    clash = [n for n in module.graph.nodes if n.name == "self"]
    for n in clash:
        n._rename("self_out")
    if clash:
        module.finalize()


def chunk_metas(chunks: list[ChunkModule], micro_args: tuple) -> list[tuple[tuple, tuple]]:
    """Each chunk's example inputs and outputs on one micro-batch, as fake tensors (shapes,
    dtypes, whether they need gradients), for the pipeline stages' static metadata.

    NOTE: without them a stage infers its inputs by running its chunk on uninitialised
    tensors, and a chunk that reads the labels (a cross-entropy) then indexes out of range."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        values = tuple(mode.from_tensor(t) for t in micro_args)
        out = []
        with torch.enable_grad():
            for ch in chunks:
                result = ch(*values)
                result = result if isinstance(result, tuple) else (result,)
                out.append((values, result))
                values = result
    return out
