"""``plan="auto"``: the plan for the devices of this launch, made on rank 0 and sent to the
others (planning is deterministic, but capturing and searching once is enough).

The step is captured on one sample (the planner scales it to any micro-batch); the cluster is
this launch's processes on one node: CPU processes joined by gloo (the loopback link measured
by ``bench.gloo_link``), or the CUDA device's datasheet where the model is on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from ..planner import DistPlan

__all__ = ["auto_plan", "launch_cluster"]


def launch_cluster(world: int, device: torch.device):
    """The cluster of this launch: ``world`` devices on one node."""
    from ...cost import get_device
    from ..cluster import LINKS, Cluster

    if device.type == "cuda":
        spec = get_device(_cuda_spec_name(device))
        link = LINKS["nvlink3"]
    else:
        spec = get_device("cpu-generic")
        link = LINKS["gloo-loopback"]
    return Cluster(spec, world, 1, link, link)


def _cuda_spec_name(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device).lower()
    gib = torch.cuda.get_device_properties(device).total_memory / 2 ** 30
    if "h100" in name or "h200" in name:
        return "h100"
    if "a100" in name:
        return "a100-80gb" if gib > 60 else "a100-40gb"
    if "3090" in name:
        return "rtx3090"
    raise ValueError(f"no device model for {torch.cuda.get_device_name(device)}: plan with "
                     f"fitgraph plan-dist --device <one of fitgraph.cost.devices.DEVICES> and "
                     f"pass the saved plan")


def auto_plan(model: torch.nn.Module, example_batch: Any, loss_fn, world: int,
              global_batch: int, device: torch.device, fix: dict | None = None,
              optimizer=None) -> DistPlan:
    """The fastest plan of ``model`` on this launch (rank 0 plans, every rank gets it).
    ``fix``: fields pinned (``{"tp": 1, "max_zero": 1}``: each rank updates whole weights,
    for an optimizer like Muon); ``optimizer``: priced as it keeps its state
    (``precision.precision_of``; None: as Adam)."""
    import torch.distributed as dist

    from .batches import FlatBatch

    box: list = [None]
    if dist.get_rank() == 0:
        from ... import capture
        from ...cost import RooflineCostModel
        from ..graph_model import GraphModel
        from ..planner import plan
        from .precision import precision_of

        flat = FlatBatch.of(example_batch)
        batched = FlatBatch.batched(flat.tensors, global_batch)
        one = flat.rebuild([t[:1] if b else t for t, b in zip(flat.tensors, batched)])
        graph = capture(model, one, loss_fn)
        cluster = launch_cluster(world, device)
        precision = precision_of(model, optimizer)
        seq = max((t.shape[1] for t in flat.tensors if t.dim() > 1), default=1)
        # NOTE: plans only what runs here: one width, no loss in parts
        gm = GraphModel(graph, RooflineCostModel(cluster.device), batch_size=1, seq=seq,
                        loss_in_parts=False)
        box[0] = plan(gm, cluster, global_batch, precision=precision,
                      fix={"per_stage": False, **(fix or {})}).to_json()
    dist.broadcast_object_list(box, src=0)
    return DistPlan.from_json(box[0])
