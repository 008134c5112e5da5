"""The executor's side of offloading: host buffers, the copy stream, and the values to rebuild.

``HostStore`` carries out ``Offload`` / ``Prefetch`` / ``Wait`` (semantics in
``fitgraph.plan.instructions``) on the executor's ``env``:

* ``Offload(s)`` copies the bytes of storage ``s`` into its host buffer;
* the ``Wait(s)`` that ends it notes every value of ``s`` in ``env`` (dtype, shape, strides,
  offset) and drops them all, so the allocator releases the device storage there;
* ``Prefetch(s)`` allocates a device storage of the same size, copies the bytes back and rebuilds
  the noted values as views of it, so views and aliases come back as they were;
* on CUDA, copies run on a side stream that first waits for the compute stream (the data is
  ready), each copy records an event, and the ``Wait`` makes the compute stream wait for it. On
  the CPU, copies are synchronous and ``Wait`` only releases.

Host buffers are allocated once, when the store is built (pinned on CUDA), one per offloaded
storage, and reused by every step.

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.execute import execute
    >>> from fitgraph.solvers.offload.plan import offload_candidates, offload_plan
    >>> from fitgraph.cost import RooflineCostModel, get_device
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> batch = torch.randn(4, 8)
    >>> g = fitgraph.capture(model, batch, lambda m, b: m(b).square().mean())
    >>> p = fitgraph.eager_plan(g)
    >>> p = offload_plan(g, p, offload_candidates(g, p), RooflineCostModel(get_device("rtx3090")))
    >>> p.counts()["offload"] > 0, execute(g, p, model, batch).shape
    (True, torch.Size([]))
"""

from __future__ import annotations

import torch

from ..graph.ir import Graph
from ..plan.instructions import Offload, Plan

__all__ = ["HostStore"]


class HostStore:
    """Host copies of a plan's offloaded storages, and the copies to and from them."""

    def __init__(self, graph: Graph, plan: Plan, members: dict[int, list[int]]) -> None:
        self.graph, self.members = graph, members
        offloaded = sorted({ins.storage for ins in plan if isinstance(ins, Offload)})
        self.device: dict[int, torch.device] = {
            st: torch.device(graph.storages[st].device) for st in offloaded}
        # NOTE: allocated here, before any step, and reused by every step: on CUDA pinning is
        # slow and must not sit inside a step; on the CPU, host and "device" share one allocator
        # and the step's meter counts only what a step allocates, so buffers made here are off
        # the measured peak, as host memory is off the simulated one (law 2: simulated ==
        # measured exactly, on CPU too)
        self.buffers: dict[int, torch.Tensor] = {
            st: torch.empty(graph.storages[st].nbytes, dtype=torch.uint8,
                            pin_memory=self.device[st].type == "cuda")
            for st in offloaded}
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        for dev in sorted({d for d in self.device.values() if d.type == "cuda"}, key=str):
            self.streams[dev] = torch.cuda.Stream(dev)
        self.events: dict[int, torch.cuda.Event] = {}
        self.copying: dict[int, str] = {}
        self.kept: dict[int, list[tuple[int, torch.dtype, torch.Size, tuple[int, ...], int]]] = {}

    # -- the three instructions -----------------------------------------------------------------
    def offload(self, st: int, env: list) -> None:
        storage = self._device_storage(st, env)
        host = self.buffers[st]
        flat = torch.empty(0, dtype=torch.uint8, device=self.device[st]).set_(storage)
        del storage
        self._copy(st, host, flat, "offload")

    def prefetch(self, st: int, env: list) -> None:
        host = self.buffers[st]
        dev = self.device[st]
        # NOTE: allocated on the compute stream, from where the simulator counts it: the start
        # of the prefetch
        flat = torch.empty(host.numel(), dtype=torch.uint8, device=dev)
        self._copy(st, flat, host, "prefetch")
        storage = flat.untyped_storage()
        del flat
        for vid, dtype, shape, stride, offset in self.kept.pop(st):
            env[vid] = torch.empty(0, dtype=dtype, device=dev).set_(storage, offset, shape,
                                                                    stride)

    def wait(self, st: int, env: list) -> None:
        kind = self.copying.pop(st)
        event = self.events.pop(st, None)
        if event is not None:
            torch.cuda.current_stream(self.device[st]).wait_event(event)
        if kind == "offload":
            # NOTE: every value of the storage goes, as at a Free, so the allocator releases it
            # here; each is noted to be rebuilt on the same bytes at the prefetch
            kept = []
            for vid in self.members[st]:
                t = env[vid]
                if t is not None:
                    kept.append((vid, t.dtype, t.shape, t.stride(), t.storage_offset()))
                    env[vid] = None
            self.kept[st] = kept

    # -- helpers --------------------------------------------------------------------------------
    def _device_storage(self, st: int, env: list) -> torch.UntypedStorage:
        """The one device storage behind every value of ``st`` in ``env``, checked."""
        name = f"storage {st} ({self.graph.storages[st].name})"
        found = [env[v] for v in self.members[st] if env[v] is not None]
        if not found:
            raise RuntimeError(f"Offload of {name}: none of its values is on device")
        storage = found[0].untyped_storage()
        if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in found[1:]):
            raise RuntimeError(f"Offload of {name}: its values do not share one storage at run "
                               "time (the captured aliasing does not hold); do not offload it")
        if storage.nbytes() != self.buffers[st].numel():
            raise RuntimeError(f"Offload of {name}: {storage.nbytes()} bytes at run time, "
                               f"{self.buffers[st].numel()} captured; do not offload it")
        return storage

    def _copy(self, st: int, dst: torch.Tensor, src: torch.Tensor, kind: str) -> None:
        self.copying[st] = kind
        dev = self.device[st]
        if dev.type != "cuda":
            dst.copy_(src)
            return
        stream = self.streams[dev]
        # NOTE: the copy starts after everything the compute stream was given: the data to
        # offload is written, and a prefetch's fresh block (the compute stream's) is no longer
        # read by kernels still queued from its previous owner
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            self.events[st] = stream.record_event()
        # NOTE: no record_stream: the block is the compute stream's, and every reference to it
        # outlives the Wait that makes the compute stream wait for this copy (an offload's
        # values are dropped there; a prefetch's are read only after it), so a block freed
        # later is reused by kernels that run after the copy. record_stream would instead keep
        # it from reuse until the GPU has finished the copy as seen from the CPU, which runs
        # ahead: on a GPT-2 step the plan's peak grew by 4 GiB over the simulated one.
