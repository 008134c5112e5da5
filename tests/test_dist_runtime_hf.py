"""Hugging Face models as users have them, run by ``fitgraph.dist.parallelize`` on gloo
processes (issue 28): each of Llama (grouped-query attention, a rotary embedding computed under
``torch.no_grad()``), GPT-2 (``Conv1D`` layers storing their weights (in, out); ``lm_head``
tied to the embedding by assignment) and BERT (a submodule named ``self``) pipelined and
tensor parallel, three AdamW steps with one process's losses and updated parameters (1e-5
relative, float64: see ``test_dist_runtime_parallelize``). Beyond the zoo, tiny configs of
Phi-3 (gate and up projections fused, ``chunk``ed apart), Phi (a partial rotary embedding
joined back with ``cat``; a key cache's first ``cat`` with an empty tensor), GPT-J (pairs
rotated with ``stack`` and ``flatten``), ALBERT (one layer called at every depth: a cut
between two of its calls, its shards shared by the calls) and BART, and T5 from the zoo
(cross-attention's keys and values of the encoder's output kept whole and cut to the shard's
heads; T5's position bias, one per head, too) tensor parallel.
"""

from __future__ import annotations

from types import SimpleNamespace

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
         pytest.param("hf-gpt2", "tp2-sp", marks=pytest.mark.slow),
         ("tiny-phi3", "tp2"), ("tiny-gptj", "tp2"), ("tiny-albert", "pp2xtp2"),
         ("hf-t5", "tp2"), pytest.param("tiny-bart", "tp2-sp", marks=pytest.mark.slow),
         pytest.param("tiny-phi", "tp2-sp", marks=pytest.mark.slow),
         pytest.param("tiny-albert", "pp2", marks=pytest.mark.slow)]
FIX = {"pp2": {"pp": 2, "dp": 1, "micro_batch": 2, "schedule": "1f1b"},
       "tp2": {"tp": 2, "pp": 1, "dp": 1, "micro_batch": 2, "schedule": "1f1b"},
       # sequence parallel: Llama's RMSNorm (its mean over the features, its weight) and
       # BERT's post-norm residuals on each shard's part of the sequence
       "tp2-sp": {"tp": 2, "pp": 1, "dp": 1, "micro_batch": 2, "schedule": "1f1b", "sp": True},
       "pp2xtp2": {"tp": 2, "pp": 2, "dp": 1, "micro_batch": 2, "schedule": "1f1b"}}


def _tiny(name: str):
    """A Hugging Face model of a family the zoo has not, from a tiny config (float64,
    eval mode), with its causal-LM or masked-LM batch."""
    import transformers as tf

    vocab = 512
    common = {"vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": 4,
              "num_attention_heads": 4, "intermediate_size": 128}
    config = {
        "tiny-phi3": lambda: tf.Phi3Config(num_key_value_heads=2, pad_token_id=0,
                                           **common, attn_implementation="sdpa"),
        "tiny-phi": lambda: tf.PhiConfig(**common, attn_implementation="sdpa"),
        "tiny-gptj": lambda: tf.GPTJConfig(vocab_size=vocab, n_embd=64, n_layer=4, n_head=4,
                                           rotary_dim=8, attn_implementation="eager"),
        "tiny-albert": lambda: tf.AlbertConfig(embedding_size=32, **common,
                                               attn_implementation="sdpa"),
        "tiny-deberta": lambda: tf.DebertaV2Config(**common),
        "tiny-bart": lambda: tf.BartConfig(vocab_size=vocab, d_model=64, encoder_layers=2,
                                           decoder_layers=2, encoder_attention_heads=4,
                                           decoder_attention_heads=4, encoder_ffn_dim=128,
                                           decoder_ffn_dim=128, attn_implementation="sdpa"),
    }[name]()
    torch.manual_seed(0)
    auto = {"tiny-albert": tf.AutoModelForMaskedLM, "tiny-deberta": tf.AutoModelForMaskedLM,
            "tiny-bart": tf.AutoModelForSeq2SeqLM}.get(name, tf.AutoModelForCausalLM)
    model = auto.from_config(config).to(torch.float64)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    if name in ("tiny-albert", "tiny-deberta"):   # NOTE: masked-LM targets on ~30%
        labels[torch.rand(BATCH, SEQ, generator=gen) > 0.3] = -100
    return SimpleNamespace(model=model, batch={"input_ids": ids, "labels": labels})


def build(name: str):
    if name.startswith("tiny-"):
        case = _tiny(name)
        case.model.eval()
        return case
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


def _auto_falls_back(rank: int, world: int):
    """``plan="auto"`` where the plan's tensor parallelism meets an op the runtime cannot
    split (DeBERTa's heads merged with the batch, ``[B*H, T, D]``): the first plan made is
    pinned to tp=2 (as a search may choose it), the runtime plans again without."""
    import fitgraph.dist.runtime.parallelize as par_mod
    from fitgraph.dist import parallelize

    torch.set_num_threads(1)
    case = build("tiny-deberta")
    made = par_mod._auto_plan
    fixes = []

    def pinned(model, batch, lf, fix, optimizer):
        fixes.append(dict(fix))
        return made(model, batch, lf, {"tp": 2, **fix} if not fixes[1:] else fix, optimizer)

    par_mod._auto_plan = pinned
    opt = torch.optim.AdamW(case.model.parameters(), lr=LR)
    with pytest.warns(UserWarning, match="planning again without tensor parallelism"):
        step = parallelize(case.model, case.batch, loss_fn, opt, plan="auto")
    losses = [float(step(case.batch)) for _ in range(STEPS)]
    return losses, step.full_parameters(), step.plan.parallelism.tp, fixes


def test_auto_plans_again_without_tensor_parallelism_the_runtime_cannot_run():
    pytest.importorskip("transformers")
    results = run_processes(_auto_falls_back, 2, timeout_s=300)
    ref_losses, ref_params, noise = one_process("tiny-deberta")
    got = {}
    for losses, params, tp, fixes in results:
        assert tp == 1 and fixes == [{}, {"tp": 1}]
        assert losses == pytest.approx(ref_losses, rel=1e-9)
        got.update(params)
    assert_like_reference(got, ref_params, noise, STEPS, LR)
