"""A graph's inputs, parsed once: what each one is and the shape and dtype it was captured with.

Input names say where a real tensor comes from (``param:<name>``, ``buffer:<name>``,
``batch:<leaf>``, ``state:<param>:<key>``, ``const:<key>``); parsing them and building torch
shapes and dtypes costs microseconds each, hundreds of inputs a step, so executors keep the
parsed list.

Example:
    >>> import torch, fitgraph
    >>> g = fitgraph.capture(torch.nn.Linear(2, 1), torch.randn(3, 2), lambda m, b: m(b).sum())
    >>> [(s.kind, s.key) for s in input_specs(g)]
    [('param', 'weight'), ('param', 'bias'), ('batch', 0)]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..graph.ir import Graph

__all__ = ["InputSpec", "input_specs"]


class InputSpec(NamedTuple):
    name: str          # the graph's input name
    kind: str          # param | buffer | batch | state | const
    key: str | int     # the parameter / buffer / constant name, the batch leaf's index
    state_key: str     # for optimizer state: the key in the parameter's state ("exp_avg")
    shape: torch.Size
    dtype: torch.dtype


def input_specs(graph: Graph) -> list[InputSpec]:
    """One ``InputSpec`` per ``graph.inputs``, in order."""
    out = []
    for vid, name in zip(graph.inputs, graph.input_names):
        kind, _, key = name.partition(":")
        state_key = ""
        if kind == "state":
            key, _, state_key = key.rpartition(":")
        v = graph.values[vid]
        out.append(InputSpec(name, kind, int(key) if kind == "batch" else key, state_key,
                             torch.Size(v.shape), getattr(torch, v.dtype)))
    return out
