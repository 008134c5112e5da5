"""Each rank's measured peak is its plan's prediction (DESIGN law 7; issue 28): GPT-2 (small,
float32, batch 8 of 64 tokens) run by ``fitgraph.dist.parallelize`` on gloo processes, every
rank's CPU allocator metered over three steps (``measure_memory=True``), within 5% of the
peak the plan predicts for its stage — pipelined (1F1B, with and without recompute, op by op,
interleaved, ZB-V), tensor parallel (with sequence parallelism too), ZeRO-1 and ZeRO-3 (FSDP2)
data parallel, pipelined × tensor parallel (op by op too) and pipelined × FSDP2. (Gloo frees a collective's buffers on its own threads,
which the meter cannot see: while metering, ``collective_frees`` leaves them to the rank's
thread; a rank measured over its prediction is measured once more, the lower kept: a free
missed on gloo's threads only ever adds.)

Not here (measured apart from the prediction, ``python -m fitgraph.bench.dist_runtime``):
ZeRO-1 over stages (its optimizer shards whole tensors, unevenly).
"""

from __future__ import annotations

import pytest
import torch

import fitgraph
import fitgraph.zoo as zoo
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.dist import FP32_ADAM, LINKS, Cluster
from fitgraph.dist.graph_model import GraphModel
from fitgraph.dist.planner import budget_between, plan
from fitgraph.dist.runtime import run_processes

BATCH, SEQ = 8, 64
CONFIGS = {
    "pp2-1f1b": {"pp": 2, "dp": 1, "micro_batch": 2, "schedule": "1f1b", "recompute": "none"},
    "pp2-recompute": {"pp": 2, "dp": 1, "micro_batch": 2, "schedule": "1f1b",
                      "recompute": "full"},
    "pp2-drop": {"pp": 2, "dp": 1, "micro_batch": 2, "schedule": "1f1b", "between": 0.5},
    "pp2-interleaved": {"pp": 2, "dp": 1, "micro_batch": 1, "schedule": "interleaved",
                        "chunks": 2},
    "pp2-zbv": {"pp": 2, "dp": 1, "micro_batch": 2, "schedule": "zb-v", "chunks": 2},
    "tp2": {"tp": 2, "pp": 1, "dp": 1, "micro_batch": 2, "schedule": "1f1b"},
    "tp2-sp": {"tp": 2, "pp": 1, "dp": 1, "micro_batch": 2, "schedule": "1f1b", "sp": True},
    "dp2-zero1": {"pp": 1, "dp": 2, "micro_batch": 2, "schedule": "1f1b", "zero": 1},
    "dp2-zero3": {"pp": 1, "dp": 2, "micro_batch": 2, "schedule": "1f1b", "zero": 3},
    "pp2xtp2": {"tp": 2, "pp": 2, "dp": 1, "micro_batch": 2, "schedule": "1f1b"},
    "pp2xdp2-zero3": {"pp": 2, "dp": 2, "micro_batch": 2, "schedule": "1f1b", "zero": 3},
    "pp2xtp2-drop": {"tp": 2, "pp": 2, "dp": 1, "micro_batch": 2, "schedule": "1f1b",
                     "between": 0.5},
}


def _case(name: str = "gpt2", seq: int = SEQ):
    case = zoo.build(name, "small", batch_size=BATCH, seq_len=seq)
    case.model.eval()
    return case


def _metered(rank: int, world: int, plan_json: dict, name: str = "gpt2", seq: int = SEQ):
    from fitgraph.dist import parallelize

    torch.set_num_threads(1)
    case = _case(name, seq)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-4)
    step = parallelize(case.model, case.batch, case.loss_fn, opt, plan=plan_json,
                       measure_memory=True)
    for _ in range(3):
        step(case.batch)
    return step.report().to_json()[rank]


@pytest.fixture(scope="module")
def graphs():
    case = _case()
    out = {}
    for mb in (1, 2):
        graph = fitgraph.capture(case.model, {k: v[:mb] for k, v in case.batch.items()},
                                 case.loss_fn)
        out[mb] = GraphModel(graph, RooflineCostModel(get_device("cpu-generic")),
                             batch_size=mb, seq=SEQ)
    return out


# NOTE: pp2 x dp2 with ZeRO-3 (~22 s) repeats what pp2 and dp2-zero3 show, pp2 x tp2 (~18 s)
# what pp2 and tp2 show, dp2-zero1 (~9 s) what dp2-zero3 shows with less sharded: `make
# test-slow`
_SLOW = ("pp2xdp2-zero3", "pp2xtp2", "dp2-zero1", "pp2xtp2-drop")


@pytest.mark.parametrize("config", [c if c not in _SLOW else
                                    pytest.param(c, marks=pytest.mark.slow) for c in CONFIGS])
def test_each_ranks_measured_peak_is_its_prediction(config, graphs):
    fix = {"tp": 1, **CONFIGS[config]}
    between = fix.pop("between", None)
    world = fix["tp"] * fix["pp"] * fix["dp"]
    link = LINKS["gloo-loopback"]
    cluster = Cluster(get_device("cpu-generic"), world, 1, link, link)
    gm = graphs[fix["micro_batch"]]
    budget = (None if between is None else
              budget_between(gm, cluster, BATCH, fix, between, precision=FP32_ADAM))
    p = plan(gm, cluster, BATCH, fix=fix, precision=FP32_ADAM, budget=budget)
    assert any(o.startswith("drop:") for s in p.stages for o in s["block_options"]) == bool(
        between)
    rows = run_processes(_metered, world, p.to_json(), timeout_s=300)
    if any(r["peak_bytes"] > 1.05 * r["predicted_peak_bytes"] for r in rows):
        # NOTE: a buffer gloo frees on a thread the meter does not see (rare, however the
        # threads are scheduled) only ever adds to a measured peak: measured again, the lower
        again = run_processes(_metered, world, p.to_json(), timeout_s=300)
        rows = [min(a, b, key=lambda r: r["peak_bytes"]) for a, b in zip(rows, again)]
    for r in rows:
        assert r["peak_bytes"] == pytest.approx(r["predicted_peak_bytes"], rel=0.05), r


@pytest.mark.slow
@pytest.mark.hf
def test_a_sequence_parallel_llama_ranks_peak_is_its_prediction():
    """Hugging Face's Llama at tp=2 with sequence parallelism: its attention and MLP split,
    each norm's output gathered for the column-parallel projections after it, and the norms
    and residuals on parts — as the plan prices it."""
    pytest.importorskip("transformers")
    case = _case("hf-llama", 128)
    graph = fitgraph.capture(case.model, {k: v[:2] for k, v in case.batch.items()},
                             case.loss_fn)
    gm = GraphModel(graph, RooflineCostModel(get_device("cpu-generic")), batch_size=2, seq=128)
    link = LINKS["gloo-loopback"]
    cluster = Cluster(get_device("cpu-generic"), 2, 1, link, link)
    p = plan(gm, cluster, BATCH, precision=FP32_ADAM,
             fix={"tp": 2, "pp": 1, "dp": 1, "micro_batch": 2, "schedule": "1f1b", "sp": True})
    for r in run_processes(_metered, 2, p.to_json(), "hf-llama", 128, timeout_s=300):
        assert r["peak_bytes"] == pytest.approx(r["predicted_peak_bytes"], rel=0.05), r
