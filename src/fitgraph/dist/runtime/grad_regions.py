"""Grad-mode (and disabled-autocast) regions of a traced step made plain ops, so that the
pipeline splitter keeps them.

``torch.export`` records a ``with torch.no_grad():`` region of a model (a method decorated with
it: Hugging Face's rotary embedding of Llama, Mistral, Qwen...) as a higher-order op,
``wrap_with_set_grad_enabled(False, <subgraph>, *inputs)``, the subgraph an attribute of the
traced program. ``torch.distributed.pipelining`` (torch 2.13) loses that attribute when it
rebuilds the module hierarchy: the module comes back called without its inputs and fails.
Here each such region is inlined into the traced graph before the split: its ops in place, and
— as ``no_grad`` made them — its results detached, so no gradient flows through them (the
same results and gradients; the region's ops keep nothing for a backward that cannot reach
them). A ``torch.autocast(..., enabled=False)`` region (``wrap_with_autocast``) is inlined
too, as it is: outside any autocast its ops run as they are written (a step run under an
enclosing autocast would cast them). A region switching grad or autocast on, or one holding
further subgraphs, is left as it is (and ``stage_split`` refuses what it breaks).

Example:
    >>> import torch
    >>> class Rotary(torch.nn.Module):
    ...     @torch.no_grad()
    ...     def forward(self, x):
    ...         return x.cos(), x.sin()
    >>> class M(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.rot = Rotary()
    ...     def forward(self, x):
    ...         c, s = self.rot(x)
    ...         return (c + s).sum()
    >>> ep = torch.export.export(M(), (torch.randn(3),))
    >>> inline_grad_regions(ep)
    1
    >>> any("wrap_with" in str(n.target) for n in ep.graph.nodes)
    False
"""

from __future__ import annotations

import operator

import torch

__all__ = ["inline_grad_regions"]


def inline_grad_regions(ep) -> int:
    """Inline ``ep``'s no-grad regions (results detached) and disabled-autocast regions in
    place; how many were."""
    hops = {getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None): _grad_region,
            getattr(torch.ops.higher_order, "wrap_with_autocast", None): _autocast_region}
    hops.pop(None, None)
    gm = ep.graph_module
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in hops:
            continue
        region = hops[node.target](node.args)
        if region is None:
            continue
        sub_node, inputs, detach = region
        sub = getattr(gm, sub_node.target, None) if sub_node.op == "get_attr" else None
        if (sub is None or node.kwargs
                or any(n.op == "get_attr" for n in sub.graph.nodes)
                or any(u.target is not operator.getitem for u in node.users)):
            continue
        results = _inline(graph, node, sub, inputs, detach)
        for user in list(node.users):
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not sub_node.users:
            graph.erase_node(sub_node)
            delattr(gm, sub_node.target)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done


def _grad_region(args) -> tuple | None:
    """``wrap_with_set_grad_enabled(enabled, subgraph, *inputs)``: a no-grad one."""
    enabled, sub, *inputs = args
    return None if enabled else (sub, inputs, True)


def _autocast_region(args) -> tuple | None:
    """``wrap_with_autocast(device, dtype, enabled, cache, subgraph, *inputs)``: a disabled
    one."""
    _device, _dtype, enabled, _cache, sub, *inputs = args
    return None if enabled else (sub, inputs, False)


def _inline(graph, node, sub, inputs, detach: bool) -> list:
    """``sub``'s ops copied before ``node`` on ``inputs``; its results (detached)."""
    env: dict = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, inputs))
    where = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace", "source_fn_stack")
             if k in node.meta}
    out = None
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out = n.args[0]
                break
            copy = graph.node_copy(n, lambda x: env[x])
            # NOTE: the region's ops sit in the module that ran it (the pipeline splitter
            # rebuilds the module hierarchy from this)
            copy.meta.update(where)
            env[n] = copy
        results = []
        for r in out if isinstance(out, (tuple, list)) else (out,):
            value = env[r] if isinstance(r, torch.fx.Node) else r
            if detach and isinstance(value, torch.fx.Node):
                detached = graph.call_function(torch.ops.aten.detach.default, (value,))
                detached.meta.update({**value.meta, **where})
                value = detached
            results.append(value)
    return results
