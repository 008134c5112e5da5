"""The executor: walks a Plan on real tensors and leaves the model exactly as eager would.

It is the simulator's twin (DESIGN law 4): both dispatch on ``instr.op`` over the same Plan.
Values live in ``env`` (a list indexed by value id); ``Free`` drops every value of a storage, so
the allocator releases it at the same instruction the simulator does. Offload / Prefetch / Wait
go to a ``HostStore`` (``fitgraph.execute.offload``).

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> model = torch.nn.Linear(4, 1)
    >>> batch = torch.randn(2, 4)
    >>> loss_fn = lambda m, b: m(b).square().mean()
    >>> g = fitgraph.capture(model, batch, loss_fn)
    >>> loss = execute(g, fitgraph.eager_plan(g), model, batch)
    >>> model.weight.grad.shape
    torch.Size([1, 4])
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..graph.ir import Graph, Node
from ..graph.recompute_rules import recompute_without_writes
from ..plan.instructions import Compute, Free, Offload, Plan, Prefetch, Recompute, Wait
from .codegen import compile_plan
from .input_specs import InputSpec, input_specs
from .offload import HostStore
from .ops import ArgBinder, resolve_target
from .optimizer_ops import run_optimizer_node, run_step_post_hooks, run_step_pre_hooks
from .slots import ModelSlots

__all__ = ["Executor", "bind_inputs", "check_bound", "execute"]


def bind_inputs(graph: Graph, model: torch.nn.Module, batch: Any,
                optimizer: torch.optim.Optimizer | None = None,
                params: dict[str, torch.Tensor] | None = None,
                buffers: dict[str, torch.Tensor] | None = None,
                specs: list[InputSpec] | None = None) -> list[torch.Tensor]:
    """The real tensors for ``graph.inputs``, in order; errors say what does not match.
    ``params`` / ``buffers``: the model's by name, ``specs``: ``input_specs(graph)``, where the
    caller has them already (an executor does)."""
    leaves, spec = tree_flatten(batch)
    want = graph.meta.get("batch_spec")
    if want is not None and spec != want:
        raise ValueError(f"the batch's structure {spec} differs from the captured one {want}; "
                         "capture the step with this batch structure")
    if specs is None:
        specs = input_specs(graph)
    if params is None:
        params = dict(model.named_parameters())
    if buffers is None:
        buffers = _buffers(graph, model)
    state_of: dict[str, dict] = {}
    out = []
    for s in specs:
        kind = s.kind
        if kind == "param":
            t = params[s.key]
        elif kind == "state":
            state = state_of.get(s.key)
            if state is None:
                state = state_of[s.key] = ({} if optimizer is None
                                           else optimizer.state.get(params[s.key], {}))
            if s.state_key not in state:
                raise ValueError(f"graph input {s.name} needs optimizer state that is missing; "
                                 "pass the optimizer the step was captured with")
            t = state[s.state_key]
        elif kind == "batch":
            t = leaves[s.key]
        elif kind == "buffer":
            t = buffers[s.key] if s.key in buffers else params[s.key]
        elif kind == "const":
            t = graph.meta["constants"][s.key]
        else:
            raise ValueError(f"unknown graph input kind {s.name!r}")
        out.append(t)
    check_bound(specs, out)
    return out


def check_bound(specs: list[InputSpec], inputs: list[torch.Tensor]) -> None:
    """Raise where a bound input's shape or dtype is not the captured one (``bind_inputs``)."""
    for s, t in zip(specs, inputs):
        if t.shape != s.shape or t.dtype != s.dtype:
            raise ValueError(f"input {s.name} has shape {tuple(t.shape)} {t.dtype}, the graph was "
                             f"captured with {tuple(s.shape)} {s.dtype}: capture again for this "
                             "shape (fitgraph plans are per shape)")


def _buffers(graph: Graph, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # NOTE: most steps read no buffer but BatchNorm's; a traversal of the model costs ~150 us
    if not any(n.startswith("buffer:") for n in graph.input_names):
        return {}
    return dict(model.named_buffers())


class Executor:
    """Runs one Plan over one Graph for a model (and optimizer). Reusable across steps."""

    def __init__(self, graph: Graph, plan: Plan, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.graph, self.plan, self.model, self.optimizer = graph, plan, model, optimizer
        self.binders = [ArgBinder(n) for n in graph.nodes]
        self.fns = [self._callable(n) for n in graph.nodes]
        members: dict[int, list[int]] = {}
        for v in graph.values:
            members.setdefault(v.storage, []).append(v.id)
        self.storage_members = members
        # NOTE: unbound methods: bound ones would make a cycle (self -> steps -> self), and an
        # executor dropped would hold its host buffers until the garbage collector runs, maybe
        # inside a later measured step (whose meter would then see their frees)
        self.steps = [getattr(type(self), "run_" + ins.op) for ins in plan]
        self.env: list = []
        # NOTE: random nodes recomputed later replay the RNG state they first drew from (law 1)
        self.replayed = {ins.node for ins in plan if isinstance(ins, Recompute)
                         and graph.nodes[ins.node].random}
        self.rng_saved: dict[int, torch.Generator] = {}
        # NOTE: recomputes that skip their in-place side effects (BatchNorm's running stats)
        recomputed = sorted({ins.node for ins in plan if isinstance(ins, Recompute)})
        self.skip_writes = {nid: skip for nid in recomputed
                            if (skip := recompute_without_writes(graph, nid))}
        self.host = HostStore(graph, plan, members)
        # NOTE: parameters whose optimizer state ``init_missing_state`` made for this step
        self.fresh_state: frozenset[str] = frozenset()
        self.params: dict[str, torch.Tensor] = {}   # NOTE: the model's, during a step
        self.slots = ModelSlots(model) if model is not None else None
        self.input_specs = input_specs(graph)
        self.hooks_ran = False
        # NOTE: the plan as straight-line Python (execute/codegen.py): a few microseconds of
        # interpreter loop per instruction add up to percents of a step of small ops
        self._run, self.source = compile_plan(self)

    def _callable(self, node: Node):
        if node.target.startswith("fitgraph.optimizer."):
            return None
        return resolve_target(node.target)

    # -- instructions -------------------------------------------------------------------------
    def run_compute(self, ins: Compute | Recompute) -> None:
        if ins.node in self.replayed and isinstance(ins, Compute):
            self.rng_saved[ins.node] = self._generator(ins.node).clone_state()
        node = self.graph.nodes[ins.node]
        env = self.env
        fn = self.fns[ins.node]
        args, kwargs = self.binders[ins.node](env)
        if isinstance(ins, Recompute) and ins.node in self.skip_writes:
            args = list(args)
            for i in self.skip_writes[ins.node]:
                args[i] = None
        if fn is None:
            if not self.hooks_ran and self.optimizer is not None:
                # NOTE: optimizer.step()'s pre-hooks, before the first update as eager runs them
                self.hooks_ran = True
                self._attach_grads()
                run_step_pre_hooks(self.optimizer)
            result = run_optimizer_node(node, args[0], args[1], list(args[2]), self.optimizer,
                                        fresh=node.kwargs["param"] in self.fresh_state)
        else:
            result = fn(*args, **kwargs)
        del args, kwargs  # NOTE: drop argument references now, or inputs outlive their Free
        outs = node.outputs
        if node.out_is_tuple:
            for vid, r in zip(outs, result):
                if vid is not None:
                    env[vid] = r
        elif outs and outs[0] is not None:
            env[outs[0]] = result
        del result

    def run_update(self, node: Node, param: torch.Tensor, grad: torch.Tensor,
                   state: list[torch.Tensor]) -> None:
        """An optimizer update (``run_compute``'s semantics), arguments already bound: the
        compiled plan calls it with ``env``'s tensors (``execute/codegen.py``)."""
        if not self.hooks_ran and self.optimizer is not None:
            self.hooks_ran = True
            self._attach_grads()
            run_step_pre_hooks(self.optimizer)
        result = run_optimizer_node(node, param, grad, state, self.optimizer,
                                    fresh=node.kwargs["param"] in self.fresh_state)
        outs = node.outputs
        if node.out_is_tuple:
            env = self.env
            for vid, r in zip(outs, result):
                if vid is not None:
                    env[vid] = r
        elif outs and outs[0] is not None:
            self.env[outs[0]] = result

    def run_recompute(self, ins: Recompute) -> None:
        if ins.node not in self.replayed:
            self.run_compute(ins)
            return
        # NOTE: clone_state costs no allocator bytes; set_state(get_state()) makes a transient
        # tensor of the generator's state size, which the simulator counts (rng_state_bytes)
        gen = self._generator(ins.node)
        current = gen.clone_state()
        gen.set_state(self.rng_saved[ins.node].get_state())
        self.run_compute(ins)
        gen.set_state(current.get_state())

    def _generator(self, nid: int) -> torch.Generator:
        node = self.graph.nodes[nid]
        outs = [o for o in node.outputs if o is not None] or list(node.inputs)
        dev = torch.device(self.graph.storages[self.graph.values[outs[0]].storage].device)
        if dev.type == "cuda":
            return torch.cuda.default_generators[dev.index or 0]
        return torch.default_generator

    def run_free(self, ins: Free) -> None:
        env = self.env
        for st in ins.storages:
            for vid in self.storage_members[st]:
                env[vid] = None

    # NOTE: the host buffers, copy stream and values to rebuild live in execute/offload.py
    def run_offload(self, ins: Offload) -> None:
        self.host.offload(ins.storage, self.env)

    def run_prefetch(self, ins: Prefetch) -> None:
        self.host.prefetch(ins.storage, self.env)

    def run_wait(self, ins: Wait) -> None:
        self.host.wait(ins.storage, self.env)

    # -- a whole step -------------------------------------------------------------------------
    def __call__(self, batch: Any, tensors: tuple[dict, dict] | None = None) -> torch.Tensor:
        """One step. ``tensors``: the model's (parameters, buffers) by name where the caller
        has them (``ModelSlots.tensors()``)."""
        g = self.graph
        # NOTE: the model's tensors found once a step (no walk of the model: ModelSlots),
        # shared by everything below
        params, buffers = self.slots.tensors() if tensors is None else tensors
        self.params = params
        if self.optimizer is not None:
            for key in g.outputs:
                if key.startswith("grad:") and params[key[5:]].grad is not None:
                    raise ValueError(
                        f"parameter {key[5:]} already has a .grad; with an optimizer in the step "
                        "gradients are not accumulated across steps: call "
                        "optimizer.zero_grad(set_to_none=True) before the step")
        self.hooks_ran = False
        loss = self.run_bound(bind_inputs(g, self.model, batch, self.optimizer, params,
                                          buffers, self.input_specs),
                              lambda: self._write_back(params))
        self.params = {}
        self.rng_saved = {}
        self.fresh_state = frozenset()
        if self.hooks_ran:
            # NOTE: the step was optimizer.step() for hooks, LR schedulers, EMA and loggers
            run_step_post_hooks(self.optimizer)
        return loss

    def run_bound(self, inputs: list[torch.Tensor], write_back) -> torch.Tensor:
        """The plan over ``inputs`` (``graph.inputs``' tensors in order; the list is emptied,
        so that the env holds the only references this step makes), ``write_back()`` once it
        ran, then what is left of the env dropped: the loss. The part of a step that
        ``latency_check`` times on synthetic inputs."""
        g = self.graph
        self.env = env = [None] * len(g.values)
        for vid, t in zip(g.inputs, inputs):
            env[vid] = t
        inputs.clear()
        with torch.no_grad():
            self._run(self, env)
            write_back()
        loss = env[g.outputs["loss"]]
        self.env = []
        return loss

    def _attach_grads(self) -> None:
        """Put the finished gradients on ``.grad`` before the first update, where eager's
        ``optimizer.step()`` hooks find them (no copy: the tensors the step holds anyway). Not
        with optimizer-in-backward, whose gradients are freed as they are used."""
        g = self.graph
        if g.meta.get("optimizer_in_backward"):
            return
        # NOTE: instructions run one by one (bench/instruction_times.py) have no step's dict
        params = self.params or dict(self.model.named_parameters())
        for key, vid in g.outputs.items():
            if key.startswith("grad:") and self.env[vid] is not None:
                params[key[5:]].grad = self.env[vid]

    def _write_back(self, params: dict[str, torch.Tensor]) -> None:
        env, g = self.env, self.graph
        for key, vid in g.outputs.items():
            kind, _, name = key.partition(":")
            if kind == "grad":
                p, grad = params[name], env[vid]
                if p.grad is None or p.grad is grad:
                    p.grad = grad
                else:
                    p.grad += grad  # NOTE: what autograd's AccumulateGrad does
            elif kind == "state":
                pname, _, skey = name.rpartition(":")
                self.optimizer.state[params[pname]][skey] = env[vid]


def execute(graph: Graph, plan: Plan, model: torch.nn.Module, batch: Any,
            optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Run ``plan`` once; return the loss. ``.grad`` / parameters / optimizer state are updated
    as eager PyTorch (``loss.backward()`` then ``optimizer.step()``) would update them."""
    return Executor(graph, plan, model, optimizer)(batch)
