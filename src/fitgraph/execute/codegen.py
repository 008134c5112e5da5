"""A plan compiled to straight-line Python: the executor's per-instruction overhead, cut.

Walking a Plan instruction by instruction costs a few microseconds of Python around every
op (the dispatch on ``ins.op``, binding arguments, storing outputs). ResNet-50 runs thousands
of small ops a step, so that overhead alone was 3-7% of the step on a CPU, eaten out of every
latency limit. ``compile_plan`` writes the plan once as one Python function, one line per
instruction::

    env[12] = f7(env[10], env[11], 1)            # Compute: the op, its refs and constants
    env[10] = env[11] = None                     # Free: every value of the storage
    s3(ex, i3)                                   # anything else: the executor's own method

Plain ``Compute`` / ``Recompute`` of a deterministic node and ``Free`` are inlined; random
nodes whose RNG state is saved or replayed, recomputes that skip in-place side effects,
optimizer updates (their arguments bound inline) and Offload / Prefetch / Wait call the
executor's ``run_*`` method, so their semantics live in one place. The generated code holds no reference to a tensor between lines
(no temporaries but a tuple result, dropped at once), so values die at their ``Free`` as they
did.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute.executor import Executor
    >>> model = torch.nn.Linear(4, 1)
    >>> batch = torch.randn(2, 4)
    >>> g = fitgraph.capture(model, batch, lambda m, b: m(b).square().mean())
    >>> ex = Executor(g, fitgraph.eager_plan(g), model)
    >>> "env[" in ex.source and ex(batch).shape
    torch.Size([])
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..graph.ir import ValueRef
from ..plan.instructions import Compute, Free, Recompute

__all__ = ["compile_plan"]

_LITERALS = (bool, int, str, type(None))


def _direct(fn: Any) -> Any:
    """An ATen op's C++ callable (``OpOverload._op``): ``OpOverload.__call__`` is a Python
    frame that only forwards to it, ~0.3 us an op; a GRU's step unrolled is ~20k ops."""
    if isinstance(fn, torch._ops.OpOverload) and callable(getattr(fn, "_op", None)):
        return fn._op
    return fn


def compile_plan(ex) -> tuple[Any, str]:
    """(``run(ex, env)``, its source) for executor ``ex``'s plan over ``ex.graph``."""
    g = ex.graph
    names: dict[str, Any] = {}
    lines = ["def run(ex, env):"]

    def bind(obj: Any) -> str:
        """A global name for ``obj`` in the generated code."""
        key = f"c{len(names)}"
        names[key] = obj
        return key

    def expr(a: Any) -> str:
        if isinstance(a, ValueRef):
            return f"env[{a.id}]"
        if isinstance(a, tuple):
            return "(" + "".join(f"{expr(x)}, " for x in a) + ")"
        if isinstance(a, list):
            return "[" + ", ".join(expr(x) for x in a) + "]"
        if isinstance(a, _LITERALS) or isinstance(a, float) and math.isfinite(a):
            return repr(a)  # NOTE: repr of a finite float reads back as the same float
        return bind(a)

    fns: dict[int, str] = {}
    for k, ins in enumerate(ex.plan.instructions):
        if isinstance(ins, Free):
            vids = [v for st in ins.storages for v in ex.storage_members[st]]
            if vids:
                lines.append("    " + " = ".join(f"env[{v}]" for v in vids) + " = None")
            continue
        if type(ins) is Compute and ex.fns[ins.node] is None:
            # NOTE: an optimizer update, its (param, grad, [state...]) bound inline: a generic
            # binder costs ~10 us an update, hundreds of them a step
            node = g.nodes[ins.node]
            lines.append(f"    ex.run_update({bind(node)}, {', '.join(expr(a) for a in node.args)})")
            continue
        inline = (isinstance(ins, (Compute, Recompute)) and ex.fns[ins.node] is not None
                  and ins.node not in ex.replayed
                  and not (isinstance(ins, Recompute) and ins.node in ex.skip_writes))
        if not inline:
            lines.append(f"    {bind(ex.steps[k])}(ex, {bind(ins)})")
            continue
        node = g.nodes[ins.node]
        if ins.node not in fns:
            fns[ins.node] = bind(_direct(ex.fns[ins.node]))
        call_args = [expr(a) for a in node.args]
        call_args += [f"{key}={expr(v)}" for key, v in node.kwargs.items()]
        call = f"{fns[ins.node]}({', '.join(call_args)})"
        outs = node.outputs
        if node.out_is_tuple:
            lines.append(f"    _r = {call}")
            lines += [f"    env[{vid}] = _r[{i}]" for i, vid in enumerate(outs) if vid is not None]
            lines.append("    _r = None")
        elif outs and outs[0] is not None:
            lines.append(f"    env[{outs[0]}] = {call}")
        else:
            lines.append(f"    {call}")
    lines.append("    return None")
    source = "\n".join(lines) + "\n"
    scope = dict(names)
    exec(compile(source, f"<fitgraph plan of {len(ex.plan.instructions)} instructions>",
                 "exec"), scope)
    return scope["run"], source
