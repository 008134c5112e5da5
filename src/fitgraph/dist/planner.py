"""``fitgraph.dist.plan``: the best multi-device plan for a training step, saved and loaded.

A ``DistPlan`` is what the planner chose (``parallelism``, each stage's blocks, devices and
memory plan) and what it predicts (step time, tokens/s, TFLOP/s per device, MFU, every stage's
time and memory, its parts adding up to its peak). ``to_json``/``save`` write it as versioned
JSON (``FORMAT``, ``VERSION``), the input of the multi-device executor; ``load`` reads it back.

Example:
    >>> from fitgraph.dist.cluster import dgx_a100
    >>> from fitgraph.dist.megatron_table import GptShape
    >>> p = plan(GptShape(24, 2304, 24), dgx_a100(1), global_batch=64)
    >>> p.fits, p.parallelism.devices, p.to_json()["format"]
    (True, 8, 'fitgraph.dist.plan')
    >>> DistPlan.from_json(p.to_json()).parallelism == p.parallelism
    True
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..cost.roofline import RooflineCostModel
from ..graph.ir import Graph, Role
from .cluster import Cluster
from .config import Parallelism
from .evaluate import Prediction, evaluate
from .graph_model import GraphModel
from .megatron_table import GptShape
from .memory import MIXED_ADAM, PRECISIONS, Precision
from .model import GptModel, ModelSpec
from .search import SearchResult, search

__all__ = ["FORMAT", "VERSION", "DistPlan", "Infeasible", "plan"]

FORMAT = "fitgraph.dist.plan"
VERSION = 1


class Infeasible(ValueError):
    """No configuration fits: ``binding`` names the memory term, ``smallest_devices`` the
    smallest cluster (in devices, the same nodes) found that fits, if any was found."""

    def __init__(self, message: str, binding: str = "", smallest_devices: int | None = None):
        super().__init__(message)
        self.binding = binding
        self.smallest_devices = smallest_devices


@dataclass
class DistPlan:
    model: str
    parallelism: Parallelism
    cluster: dict
    global_batch: int
    seq: int
    precision: str
    fits: bool
    binding: str
    predicted: dict
    stages: list[dict]
    plan_s: float
    search: dict = field(default_factory=dict)
    device_note: str = ""
    # the pipeline's chunks in order, each {"device": stage, "blocks": [...]}; and a hash of
    # the captured graph's parameter names and shapes ("" for a model by shape), which the
    # runtime compares with the model it is given
    chunks: list[dict] = field(default_factory=list)
    param_signature: str = ""
    # tensor parallelism of a captured model: parameter name -> "colwise" | "rowwise"
    tp_styles: dict[str, str] = field(default_factory=dict)
    prediction: Prediction | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        par = self.parallelism
        return {
            "format": FORMAT, "version": VERSION, "model": self.model,
            "global_batch": self.global_batch, "seq": self.seq, "precision": self.precision,
            "cluster": self.cluster, "device_note": self.device_note,
            "plan_s": self.plan_s, "fits": self.fits, "binding": self.binding,
            "parallelism": {"pp": par.pp, "tp": par.tp, "dp": par.dp, "zero": par.zero,
                            "microbatch": par.micro_batch, "n_microbatches": par.n_micro,
                            "schedule": par.schedule, "chunks": par.chunks, "sp": par.sp,
                            "recompute": par.recompute,
                            "overlap_grad_reduce": par.overlap_grad_reduce,
                            "widths": [list(w) for w in par.widths]},
            "predicted": self.predicted, "stages": self.stages, "search": self.search,
            "chunks": self.chunks, "param_signature": self.param_signature,
            "tp_styles": self.tp_styles,
        }

    @classmethod
    def from_json(cls, data: dict) -> DistPlan:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a fitgraph multi-device plan (format {data.get('format')!r})")
        if data.get("version") != VERSION:
            raise ValueError(f"plan version {data.get('version')}: this fitgraph reads "
                             f"version {VERSION}")
        p = data["parallelism"]
        par = Parallelism(tp=p["tp"], pp=p["pp"], dp=p["dp"], micro_batch=p["microbatch"],
                          n_micro=p["n_microbatches"], schedule=p["schedule"],
                          chunks=p["chunks"], zero=p["zero"], sp=p["sp"],
                          recompute=p["recompute"],
                          overlap_grad_reduce=p["overlap_grad_reduce"],
                          widths=tuple(tuple(w) for w in p.get("widths", ())))
        return cls(model=data["model"], parallelism=par, cluster=data["cluster"],
                   global_batch=data["global_batch"], seq=data["seq"],
                   precision=data["precision"], fits=data["fits"], binding=data["binding"],
                   predicted=data["predicted"], stages=data["stages"], plan_s=data["plan_s"],
                   search=data.get("search", {}), device_note=data.get("device_note", ""),
                   chunks=data.get("chunks", []),
                   param_signature=data.get("param_signature", ""),
                   tp_styles=data.get("tp_styles", {}))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> DistPlan:
        return cls.from_json(json.loads(Path(path).read_text()))


def _cluster_json(cluster: Cluster) -> dict:
    return {"device": cluster.device.name, "devices": cluster.devices,
            "devices_per_node": cluster.devices_per_node, "nodes": cluster.nodes,
            "intra": {"name": cluster.intra.name, "bandwidth": cluster.intra.bandwidth,
                      "latency_s": cluster.intra.latency_s},
            "inter": {"name": cluster.inter.name, "bandwidth": cluster.inter.bandwidth,
                      "latency_s": cluster.inter.latency_s},
            "flop_efficiency": cluster.device.flop_efficiency,
            "bandwidth_efficiency": cluster.device.bandwidth_efficiency,
            "memory_bytes": cluster.device.memory_bytes}


def _stage_json(pred: Prediction, model: ModelSpec | None = None) -> list[dict]:
    out = []
    for s in pred.stages:
        st = s.plan
        # NOTE: what the runtime needs to re-make a block's ops as planned: its units' ATen
        # ops (a captured model's; a model by its shape has none, and is re-made whole)
        signature = getattr(model, "op_signature", None)
        block_ops = {b: signature(b) for b, o in zip(st.blocks, st.plan)
                     if o.startswith("drop:") and signature is not None}
        out.append({
            "index": s.index, "tp": s.tp, "dp": s.dp, "blocks": list(st.blocks),
            "devices": list(s.ranks),
            "peak_bytes": s.peak_bytes, "memory": s.memory(),
            "memory_plan": dict(sorted(Counter(st.plan).items())),
            "block_options": list(st.plan),
            **({"block_ops": block_ops} if block_ops else {}),
            "offloaded_bytes": st.offload_bytes, "recomputed_s": st.recompute_s,
            "in_flight": st.in_flight,
            "time": {"fwd_s": st.fwd_s, "bwd_s": st.bwd_s, "recompute_s": st.recompute_s,
                     "busy_s": s.busy_s, "bubble_s": s.bubble_s, "tp_comm_s": s.tp_comm_s,
                     "p2p_s": s.p2p_s, "dp_sync_s": s.dp_sync_s, "tied_sync_s": s.tied_sync_s,
                     "optimizer_s": s.optimizer_s, "end_s": s.end_s,
                     "offload_exposed_s": st.offload_s},
        })
    return out


def _as_model(model, cluster: Cluster) -> ModelSpec:
    if isinstance(model, GptShape):
        return GptModel(model)
    if isinstance(model, Graph):
        return GraphModel(model, RooflineCostModel(cluster.device),
                          batch_size=_batch_size(model))
    if hasattr(model, "blocks") and hasattr(model, "why_not") and hasattr(model, "model_flops"):
        return model
    raise TypeError(
        f"fitgraph.dist.plan plans a GptShape, a captured Graph (fitgraph.capture(model, batch, "
        f"loss_fn)) or a dist ModelSpec (GptModel, GraphModel), not {type(model).__name__}")


def _batch_size(graph: Graph) -> int:
    """The samples a graph was captured at: its first batch tensor's first dim."""
    for vid in graph.inputs:
        v = graph.values[vid]
        if v.role is Role.INPUT and v.shape:
            return int(v.shape[0])
    raise ValueError("the graph has no batch tensor to tell its batch size: wrap it in "
                     "GraphModel(graph, cost_model, batch_size=...)")


def _tp_styles(model: ModelSpec, par: Parallelism) -> dict[str, str]:
    tps = {w[0] for w in par.widths} | {par.tp}
    if max(tps) == 1 or not hasattr(model, "tensor_parallel"):
        return {}
    if len(tps) > 1:
        return {}   # NOTE: stages of several widths: the runtime refuses them (one width)
    return dict(sorted(model.tensor_parallel(par.tp).styles.items()))


def from_prediction(pred: Prediction, model: ModelSpec, cluster: Cluster, precision: Precision,
                    plan_s: float, found: SearchResult | None = None,
                    device_note: str = "") -> DistPlan:
    predicted = {"step_s": pred.step_s, "pipeline_s": pred.pipeline_s,
                 "tokens_per_s": pred.tokens_per_s, "tflops_per_device": pred.tflops_per_device,
                 "mfu": pred.mfu, "peak_bytes_per_device": pred.peak_bytes_per_device,
                 "budget_bytes": pred.budget_bytes, "model_flops": pred.model_flops,
                 "executed_flops": pred.executed_flops}
    stats = {}
    if found is not None:
        stats = {"candidates": found.candidates, "evaluated": found.evaluated,
                 "simulated": found.simulated, "seconds": found.seconds,
                 "rejected": found.rejected}
    return DistPlan(model=model.name, parallelism=pred.parallelism,
                    cluster=_cluster_json(cluster), global_batch=pred.parallelism.global_batch,
                    seq=model.seq, precision=precision.name, fits=pred.fits,
                    binding=pred.binding, predicted=predicted, stages=_stage_json(pred, model),
                    plan_s=plan_s, search=stats, device_note=device_note,
                    chunks=[{"device": d, "blocks": list(b)} for d, b in pred.chunks],
                    param_signature=getattr(model, "param_signature", ""),
                    tp_styles=_tp_styles(model, pred.parallelism), prediction=pred)


def plan(model, cluster: Cluster, global_batch: int, *, fix: dict | None = None,
         precision: Precision | str = MIXED_ADAM, budget: float | None = None,
         device_note: str = "", grow: bool = True) -> DistPlan:
    """The fastest plan of ``model`` on ``cluster`` at ``global_batch`` samples per step:
    ``model`` is a ``GptShape``, a captured ``Graph`` (timed by the roofline of the cluster's
    device, at the batch it was captured at) or a ``ModelSpec``; ``fix`` pins parallelism
    fields (``config.parse_fix``).

    When every field that decides the configuration is pinned, this is the prediction of that
    configuration, which is returned even if it does not fit (``fits`` False, ``binding`` says
    why). Otherwise it raises ``Infeasible`` when nothing fits, naming the binding memory term
    and (``grow``) the smallest cluster of the same nodes found that fits.
    """
    start = time.perf_counter()
    spec = _as_model(model, cluster)
    precision = PRECISIONS[precision] if isinstance(precision, str) else precision
    fix = dict(fix or {})
    pinned = {"tp", "pp", "dp", "micro_batch", "schedule"} <= set(fix)
    if pinned:
        par = _pinned(fix, cluster, global_batch)
        pred = evaluate(spec, cluster, par, precision=precision, budget=budget)
        if pred is None:
            raise ValueError(f"{spec.name} cannot be cut into {par.pp} stages")
        return from_prediction(pred, spec, cluster, precision, time.perf_counter() - start,
                               device_note=device_note)
    found = search(spec, cluster, global_batch, fixed=fix, precision=precision, budget=budget)
    if found.best is None:
        raise _infeasible(spec, cluster, global_batch, fix, precision, budget, found, grow)
    return from_prediction(found.best, spec, cluster, precision, time.perf_counter() - start,
                           found, device_note)


def budget_between(model, cluster: Cluster, global_batch: int, fix: dict, between: float,
                   **kw) -> float:
    """A memory budget ``between`` (0–1) of the way from the plan of ``fix`` re-making every
    block to the one keeping everything (its largest stage's): under it, the stages choose
    their memory plans op by op. ``kw``: as ``plan``'s.

    Example:
        >>> from fitgraph.cost import get_device
        >>> from fitgraph.dist import LINKS, Cluster, GptShape
        >>> cluster = Cluster(get_device("a100-80gb"), 8, 1, LINKS["nvlink3"], LINKS["hdr-ib"])
        >>> fix = {"tp": 2, "pp": 4, "dp": 1, "micro_batch": 1, "schedule": "1f1b"}
        >>> gpt = GptShape(24, 2048, 16, seq=2048)
        >>> lo, hi = (budget_between(gpt, cluster, 16, fix, x) for x in (0.0, 1.0))
        >>> lo < budget_between(gpt, cluster, 16, fix, 0.5) < hi
        True
    """
    peaks = [[s["peak_bytes"] for s in plan(model, cluster, global_batch,
                                            fix={**fix, "recompute": r}, **kw).stages]
             for r in ("full", "none")]
    return max(lo + between * (hi - lo) for lo, hi in zip(*peaks))


def _pinned(fix: dict, cluster: Cluster, global_batch: int) -> Parallelism:
    tp, pp, dp, b = fix["tp"], fix["pp"], fix["dp"], fix["micro_batch"]
    if tp * pp * dp != cluster.devices:
        raise ValueError(f"tp {tp} x pp {pp} x dp {dp} = {tp * pp * dp} devices, but the "
                         f"cluster has {cluster.devices}")
    if global_batch % (dp * b):
        raise ValueError(f"global batch {global_batch} is not a multiple of dp {dp} x "
                         f"micro-batch {b}")
    rest = {k: v for k, v in fix.items()
            if k not in ("tp", "pp", "dp", "micro_batch", "max_zero")}
    rest.setdefault("n_micro", global_batch // (dp * b))
    if rest["n_micro"] != global_batch // (dp * b):
        raise ValueError(f"n_micro {rest['n_micro']} does not make global batch {global_batch} "
                         f"with dp {dp} and micro-batch {b}")
    if rest.get("schedule") in ("interleaved", "zb-v"):
        rest.setdefault("chunks", 2)
    return Parallelism(tp=tp, pp=pp, dp=dp, micro_batch=b, **rest)


def _infeasible(spec, cluster, global_batch, fix, precision, budget, found, grow) -> Infeasible:
    if found.closest is not None:
        binding = f"the closest configuration's {found.closest.binding}"
    elif found.least_static > found.budget:
        gib = 2**30
        room = found.budget
        binding = (f"weights, gradients and optimizer state: the least any configuration puts "
                   f"on a device is {found.least_static / gib:.1f} GiB, above the "
                   f"{room / gib:.1f} GiB budget")
    else:
        binding = "; ".join(f"{count} configurations: {why}"
                            for why, count in sorted(found.rejected.items())) or "none fits"
    smallest = None
    if grow:
        for factor in (2, 4, 8, 16, 32, 64):
            bigger = Cluster(cluster.device, cluster.devices_per_node, cluster.nodes * factor,
                              cluster.intra, cluster.inter)
            f = search(spec, bigger, global_batch, fixed={k: v for k, v in fix.items()
                                                          if k not in ("dp",)},
                       precision=precision, budget=budget, top=1)
            if f.best is not None:
                smallest = bigger.devices
                break
    message = (f"no configuration of {spec.name} fits {cluster.devices} x "
               f"{cluster.device.name} at global batch {global_batch}: {binding}")
    if smallest:
        message += f"; the smallest cluster found that fits has {smallest} devices"
    return Infeasible(message, binding, smallest)
