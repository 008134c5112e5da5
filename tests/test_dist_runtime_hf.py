"""Hugging Face models as users have them, run by ``fitgraph.dist.parallelize`` on gloo
processes (issue 28): each of Llama (grouped-query attention, a rotary embedding computed under
``torch.no_grad()``), GPT-2 (``Conv1D`` layers storing their weights (in, out); ``lm_head``
tied to the embedding by assignment) and BERT (a submodule named ``self``) pipelined and
tensor parallel, three AdamW steps with one process's losses and updated parameters (1e-5
relative, float64: see ``test_dist_runtime_parallelize``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import adamw_reference, assert_like_reference, row_parallel_seq_dims

import fitgraph
import fitgraph.zoo as zoo
from fitgraph.cost import RooflineCostModel, get_device
from fitgraph.dist import LINKS, Cluster
from fitgraph.dist.graph_model import GraphModel
from fitgraph.dist.planner import plan
from fitgraph.dist.runtime import run_processes

pytestmark = pytest.mark.hf

BATCH, SEQ, STEPS, LR = 8, 16, 3, 1e-3
# NOTE: ~10 s each; two run in ``make test-slow`` only (the default run keeps under 25 min)
CASES = [("hf-llama", "tp2"), ("hf-gpt2", "pp2"), ("hf-bert", "pp2"), ("hf-llama", "tp2-sp"),
         pytest.param("hf-llama", "pp2", marks=pytest.mark.slow),
         pytest.param("hf-gpt2", "tp2", marks=pytest.mark.slow),
         pytest.param("hf-bert", "tp2-sp", marks=pytest.mark.slow),
         pytest.param("hf-gpt2", "tp2-sp", marks=pytest.mark.slow)]
FIX = {"pp2": {"pp": 2, "dp": 1, "micro_batch": 2, "schedule": "1f1b"},
       "tp2": {"tp": 2, "pp": 1, "dp": 1, "micro_batch": 2, "schedule": "1f1b"},
       # sequence parallel: Llama's RMSNorm (its mean over the features, its weight) and
       # BERT's post-norm residuals on each shard's part of the sequence
       "tp2-sp": {"tp": 2, "pp": 1, "dp": 1, "micro_batch": 2, "schedule": "1f1b", "sp": True}}


def build(name: str):
    case = zoo.build(name, "small", batch_size=BATCH, seq_len=SEQ, dtype=torch.float64)
    case.model.eval()      # NOTE: no dropout: the ranks and one process draw no masks
    return case


def loss_fn(model, batch):
    return model(**batch).loss


def _train(rank: int, world: int, name: str, plan_json: dict):
    from fitgraph.dist import parallelize

    torch.set_num_threads(1)
    case = build(name)
    opt = torch.optim.AdamW(case.model.parameters(), lr=LR)
    step = parallelize(case.model, case.batch, loss_fn, opt, plan=plan_json)
    losses = [float(step(case.batch)) for _ in range(STEPS)]
    return losses, step.full_parameters(), row_parallel_seq_dims(step)


def one_process(name: str):
    case = build(name)
    return adamw_reference(case.model, lambda: loss_fn(case.model, case.batch), STEPS, LR)


@pytest.mark.parametrize(("name", "config"), CASES)
def test_hugging_face_model_planned_run_has_one_process_results(name, config):
    pytest.importorskip("transformers")
    case = build(name)
    micro = {k: v[:2] for k, v in case.batch.items()}
    gm = GraphModel(fitgraph.capture(case.model, micro, loss_fn),
                    RooflineCostModel(get_device("cpu-generic")), batch_size=2, seq=SEQ)
    fix = FIX[config]
    devices = fix["pp"] * fix["dp"] * fix.get("tp", 1)
    cluster = Cluster(get_device("cpu-generic"), devices, 1, LINKS["nvlink3"], LINKS["hdr-ib"])
    p = plan(gm, cluster, BATCH, fix={"tp": 1, **fix})
    results = run_processes(_train, devices, name, p.to_json(), timeout_s=300)
    ref_losses, ref_params, noise = one_process(name)
    got = {}
    for losses, params, seq_dims in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        got.update(params)
        # sequence parallel where planned: every row-parallel sum reduce-scattered
        assert bool(seq_dims) == (fix.get("tp", 1) > 1)
        assert all((d is not None) == bool(fix.get("sp")) for d in seq_dims)
    assert_like_reference(got, ref_params, noise, STEPS, LR)
