"""Record the strides the kernels make, where tracing on fake tensors guessed others.

A step is traced on fake tensors, whose layouts come from each op's meta kernel. Where a
tensor has a dimension of size 1, its stride there is free, and the meta kernel and the real
kernel may choose apart: BEiT's segmentation head pools to [N, C, 1, 1], and batch norm's
meta kernel keeps the convolution's channels-last strides (128, 1, 128, 128) where the CPU
kernel returns (128, 1, 1, 1). Later ops choose their memory format from those strides: the
bilinear upsampling made channels-last [N, C, 4, 4] on fake tensors and contiguous ones for
real, and so on through a concatenation to a 3x3 convolution, which the profiler priced on
channels-last inputs (8.9 MB with its workspace) while the step ran it on contiguous ones
(23.3 MB). The simulated peak was 12% under the measured one.

``strides_as_run`` runs, in order, each node that makes a tensor with a dimension of size 1,
or reads a value whose layout it changed, once on synthetic inputs laid out as the graph now
says (``execute.synthetic``: one op at a time, never the whole step); where an output
comes out with other strides than the trace recorded (same shape and offset), records the
kernel's (and a view's offset): later nodes then run on what the step will give them. A
view the trace made where the fake strides allowed one, and the kernels' strides do not,
reads a contiguous copy of its input (what eager's ``reshape`` does there): without it the
step failed ("view size is not compatible with input tensor's size and stride"). A node that
cannot run on synthetic inputs keeps its traced layout. ``graph.meta["strides_as_run"]``
counts the values changed. ``capture`` does not run it for a model on the ``meta`` device (a
paper-size configuration traced for a device it does not run on).

Example:
    >>> import torch, fitgraph
    >>> from fitgraph.capture.kernel_strides import strides_as_run
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    >>> x = torch.randn(2, 3, 3, 3).to(memory_format=torch.channels_last)
    >>> g = fitgraph.capture(model, x, lambda m, b: m(b).square().mean())
    >>> isinstance(strides_as_run(g).meta.get("strides_as_run", 0), int)
    True
"""

from __future__ import annotations

import torch

from ..graph.analysis import verify_graph
from ..graph.ir import Graph, Role, ValueRef, contiguous_strides
from ..transform.fission_meta import Meta
from ..transform.fission_writer import GraphWriter, OutSpec

__all__ = ["strides_as_run"]

_VIEWS = frozenset({"aten.view.default", "aten._unsafe_view.default"})


def strides_as_run(graph: Graph) -> Graph:
    """``graph`` with each value's strides as its kernel makes them (see the module doc);
    changed in place, and returned."""
    from ..execute.synthetic import SyntheticRunner

    if not graph.inputs:
        return graph
    device = graph.storages[graph.values[graph.inputs[0]].storage].device
    if device == "meta":
        return graph
    dev = torch.device(device)
    runner = SyntheticRunner(graph, dev)
    # NOTE: random ops run too: under fork_rng, the caller's random stream is not moved
    rng_devices = [dev.index or 0] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), torch.no_grad():
        changed, copied = _run_all(graph, runner)
    if copied:
        graph = _copied_before_views(graph, copied)
    if changed:
        graph.meta["strides_as_run"] = changed
        verify_graph(graph)
    return graph


def _run_all(graph: Graph, runner) -> tuple[int, set[int]]:
    """Run each node that may lay out apart once (module doc, ``_ambiguous``): the number of
    values whose strides changed, and the view nodes that cannot view their input as it is
    laid out for real."""
    from ..execute.synthetic import OPTIMIZER_PREFIX

    changed, copied = 0, set()
    moved: set[int] = set()   # NOTE: values whose layout the kernels changed
    for node in graph.nodes:
        if node.target.startswith(OPTIMIZER_PREFIX) or all(o is None for o in node.outputs):
            continue
        if moved.isdisjoint(node.inputs) and not any(
                _ambiguous(graph.values[v]) for v in node.outputs if v is not None):
            continue
        try:
            result = runner.callable(node)(runner.inputs(node))
        except Exception as e:
            if node.target in _VIEWS and "view size is not compatible" in str(e):
                # NOTE: the trace made a view where the fake strides allowed one; on the
                # kernels' strides eager's reshape copies first: so does the step
                out = graph.values[node.outputs[0]]
                out.stride, out.storage_offset = contiguous_strides(out.shape), 0
                copied.add(node.id)
                moved.add(out.id)
                changed += 1
            continue  # NOTE: what cannot run on synthetic inputs keeps its traced layout
        results = result if node.out_is_tuple else (result,)
        for vid, t in zip(node.outputs, results):
            if vid is None or not isinstance(t, torch.Tensor):
                continue
            v = graph.values[vid]
            stride, offset = tuple(t.stride()), t.storage_offset()
            if tuple(t.shape) == v.shape and (stride, offset) != (v.stride, v.storage_offset):
                # NOTE: a view's offset moves with its base's layout (channels 16: of a
                # channels-last tensor start at 16, of a contiguous one at 16 * H * W)
                v.stride, v.storage_offset = stride, offset
                moved.add(vid)
                changed += 1
        del result, results
    return changed, copied


def _ambiguous(v) -> bool:
    """A tensor of rank 2 or more with a dimension of size 1, whose stride there is free:
    where a meta kernel and the real one may lay it out apart (given the same inputs they
    agree elsewhere). Only nodes that make one, or read a value whose layout changed, are run:
    a graph traced for a model too large to run is not run whole either."""
    # NOTE: a parameter's gradient (a 1x1 convolution's weight) is read by the optimizer
    # only, elementwise: its layout chooses no later kernel's, and running the convolution
    # backward that makes it costs as much as the step's
    return len(v.shape) >= 2 and 1 in v.shape and v.role is not Role.GRADIENT


def _copied_before_views(graph: Graph, copied: set[int]) -> Graph:
    """``graph`` with each view node in ``copied`` reading a contiguous copy of its input (a
    new storage), as ``reshape`` does where it cannot view."""
    w = GraphWriter(graph)
    for n in graph.nodes:
        if n.id not in copied:
            w.copy_node(n)
            continue
        src = w.whole[n.inputs[0]]
        x, out = w.values[src], graph.values[n.outputs[0]]
        kw = dict(phase=n.phase, module=n.module, device=w.device_of(src))
        dense = w.add_node(f"{n.name}.copied", "aten.clone.default", (ValueRef(src),),
                           {"memory_format": torch.contiguous_format},
                           [OutSpec(f"{n.name}.copied",
                                    Meta(x.shape, contiguous_strides(x.shape), 0), x.dtype,
                                    role=out.role)], **kw)[0]
        args = (ValueRef(dense),) + tuple(n.args[1:])
        w.whole[out.id] = w.add_node(
            n.name, n.target, args, dict(n.kwargs),
            [OutSpec(out.name, Meta(out.shape, out.stride, 0), out.dtype,
                     storage=w.values[dense].storage, role=out.role)], **kw)[0]
    return w.finish(dict(graph.meta, views_copied=len(copied)))
