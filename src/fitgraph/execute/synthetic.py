"""Synthetic inputs for a graph's nodes, and the callables that run them alone: what the
profiler (``cost/profiler.py``), the in-situ timer (``cost/in_situ.py``) and the latency
check run nodes on.

Floating tensors are ``torch.rand`` (uniform in [0, 1), so sqrt/log/multinomial stay valid),
integers are zeros (valid indices and labels), bools are ones, except random bits drawn at
their density (a dropout mask kept as bits); values that share a storage in the graph share
one here, with the graph's strides and offsets. A node whose opaque inputs (an LSTM's oneDNN
workspace) only their makers can produce runs after them (``chains``).

Example:
    >>> import torch, fitgraph
    >>> g = fitgraph.capture(torch.nn.Linear(8, 4), torch.randn(2, 8), lambda m, b: m(b).sum())
    >>> runner = SyntheticRunner(g, torch.device("cpu"))
    >>> node = g.nodes[0]
    >>> out = runner.callable(node)(runner.inputs(node))
    >>> tuple(out.shape) == g.values[node.outputs[0]].shape
    True
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from ..graph.ir import DTYPE_BYTES, Graph, Node, Storage, storage_bytes
from .bit_packing import pack_bits
from .ops import ArgBinder, resolve_target
from .optimizer_ops import run_optimizer_node

__all__ = ["OPTIMIZER_PREFIX", "SyntheticRunner", "fill_valid", "no_subnormals", "torch_dtype"]

OPTIMIZER_PREFIX = "fitgraph.optimizer."


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@contextlib.contextmanager
def no_subnormals():
    """Subnormal floats flushed to zero on the CPU while a whole graph runs on synthetic inputs
    (the mode as it was after).

    NOTE: uniform [0, 1) weights carried through a whole step make subnormal floats (products
    of small probabilities and gradients), which x86 CPUs compute many times slower: on a
    2-core x86 machine Gemma-2's eager plan ran 150 ms on synthetic inputs and 73 ms with them
    flushed, where eager PyTorch on the real batch runs 78. The latency check then read the
    eager plan 2.2x eager PyTorch and fell back to eager on every try. Real batches and
    trained weights rarely make them; where they do, eager PyTorch pays the same.

    Example:
        >>> import torch
        >>> with no_subnormals():
        ...     flushed = float(torch.full((1,), 1e-38) * 1e-2)
        >>> flushed, float(torch.full((1,), 1e-38) * 1e-2) > 0
        (0.0, True)
    """
    was = _flushing()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(was)


def _flushing() -> bool:
    """Whether subnormal results are flushed to zero now (torch has no getter).

    NOTE: a numpy product (the same CPU flag): a torch one inside a compiler backend runs on
    fake tensors, which hold no value to read"""
    return float((np.full(1, 1e-38, dtype=np.float32) * np.float32(1e-2))[0]) == 0.0


def fill_valid(buf: torch.Tensor, dtype: torch.dtype, density: float | None = None) -> None:
    """Fill a byte buffer with valid data for ``dtype`` (see the module doc); bools (and
    bits packed into bytes) with random bits of ``density`` where given."""
    if dtype == torch.bool:
        if density is None:
            buf.fill_(1)
        else:
            buf.copy_(torch.rand(buf.numel(), device=buf.device) < density)
        return
    if dtype == torch.uint8 and density is not None:  # NOTE: bits packed eight to a byte
        buf.copy_(pack_bits(torch.rand(buf.numel() * 8, device=buf.device) < density))
        return
    if not (dtype.is_floating_point or dtype.is_complex):
        buf.zero_()
        return
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = buf.numel() // itemsize
    flat = buf[: n * itemsize].view(dtype)
    if dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        flat.uniform_()
    else:  # NOTE: float8 / complex have no uniform_ kernel everywhere: go through float32
        flat.copy_(torch.rand(n, device=buf.device))


class SyntheticRunner:
    """Makes synthetic inputs for a graph's nodes and the callables that run them."""

    def __init__(self, graph: Graph, device: torch.device,
                 densities: dict[int, float] | None = None,
                 chains: dict[int, tuple[int, ...]] | None = None) -> None:
        self.graph, self.device = graph, device
        self.densities = densities or {}
        # NOTE: node -> nodes to run first (its opaque inputs' makers; all its producers
        # where it failed alone): a copy, as the profiler adds to it
        self.chains = dict(chains or {})
        first = graph.storages[graph.values[graph.inputs[0]].storage] if graph.inputs else None
        self.graph_device = first.device if first is not None else "cpu"
        self.remap = torch.device(self.graph_device) != device

    def _device_for(self, st: Storage) -> torch.device:
        # NOTE: host-side scalars of a GPU graph (Adam's step) stay on the host; everything
        # else runs on the profiling device
        if st.device == "cpu" and self.graph_device != "cpu":
            return torch.device("cpu")
        return self.device

    def inputs(self, node: Node) -> list:
        """An env (indexed by value id) holding fresh tensors for ``node.inputs``: synthetic,
        except what the nodes making its opaque inputs output (run here first, on synthetic
        inputs of their own)."""
        chain = self.chains.get(node.id)
        if not chain:
            return self.values(node.inputs)
        g = self.graph
        made = {v for p in chain for v in g.nodes[p].outputs if v is not None}
        need = dict.fromkeys(v for nid in (*chain, node.id) for v in g.nodes[nid].inputs
                             if v not in made)
        env = self.values(need)
        for p in chain:
            maker = g.nodes[p]
            result = self.callable(maker)(env)
            if maker.out_is_tuple:
                for vid, r in zip(maker.outputs, result):
                    if vid is not None:
                        env[vid] = r
            elif maker.outputs and maker.outputs[0] is not None:
                env[maker.outputs[0]] = result
            del result
        keep = set(node.inputs)
        return [t if i in keep else None for i, t in enumerate(env)]

    def values(self, vids) -> list:
        """An env (indexed by value id) holding fresh synthetic tensors for ``vids``; values
        that share a storage in the graph share one here."""
        g = self.graph
        env: list = [None] * len(g.values)
        need: dict[int, int] = {}
        for vid in vids:
            v = g.values[vid]
            extent = storage_bytes(v.shape, v.stride, v.storage_offset, DTYPE_BYTES[v.dtype])
            need[v.storage] = max(need.get(v.storage, g.storages[v.storage].nbytes), extent)
        bufs: dict[int, torch.Tensor] = {}
        for vid in vids:
            v = g.values[vid]
            dtype = torch_dtype(v.dtype)
            buf = bufs.get(v.storage)
            if buf is None:
                buf = torch.empty(need[v.storage], dtype=torch.uint8,
                                  device=self._device_for(g.storages[v.storage]))
                fill_valid(buf, dtype, self.densities.get(v.storage))
                bufs[v.storage] = buf
            t = torch.empty(0, dtype=dtype, device=buf.device)
            t.set_(buf.untyped_storage(), v.storage_offset, v.shape, v.stride)
            env[vid] = t
        return env

    def callable(self, node: Node):
        """``run(env) -> result`` for ``node``, arguments bound from ``env``."""
        if self.remap:
            node = dataclasses.replace(node, args=self._remap(node.args),
                                       kwargs=self._remap(node.kwargs))
        binder = ArgBinder(node)
        if node.target.startswith(OPTIMIZER_PREFIX):

            def run_optimizer(env: list):
                args, _ = binder(env)
                return run_optimizer_node(node, args[0], args[1], list(args[2]), None)

            return run_optimizer
        fn = resolve_target(node.target)

        def run(env: list):
            args, kwargs = binder(env)
            return fn(*args, **kwargs)

        return run

    def _remap(self, obj):
        """Constant ``torch.device`` arguments of the graph's device -> the profiling device."""
        if isinstance(obj, torch.device):
            return self.device if obj == torch.device(self.graph_device) else obj
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._remap(o) for o in obj)
        if isinstance(obj, dict):
            return {k: self._remap(v) for k, v in obj.items()}
        return obj
