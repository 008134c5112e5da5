"""Mixture-of-experts models capture, plan and train as eager (issue 25, finding 1).

Hugging Face's MoE experts (transformers 5) run ``torch.nn.functional.grouped_mm`` by default
(``experts_implementation="grouped_mm"``): tokens sorted by expert, one grouped GEMM with the
cumulative token counts as offsets — shapes independent of the routing. torch's meta kernel for
``aten._grouped_mm`` accepts bfloat16 only, while the CPU and CUDA kernels eager runs accept
float32, bfloat16 and float16; fitgraph's fake mode traces the op as the real kernels do
(``capture/grouped_mm.py``), so the captured graph holds the kernels eager ran: bitwise equal.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_bitwise_equal_models, check_same_as_eager

import fitgraph
from fitgraph import CaptureError
from fitgraph.capture.fake_mode import CaptureFakeMode
from fitgraph.capture.grouped_mm import grouped_mm_flops

DTYPES = [torch.float32, torch.bfloat16]
VOCAB = 128
LR = 1e-3


def _layouts(dt):
    """(mat_a, mat_b, offs, FLOPs) of the four layouts; outputs' last dims need padding."""
    offs = lambda *o: torch.tensor(o, dtype=torch.int32)  # noqa: E731
    return [
        (torch.randn(10, 16, dtype=dt), torch.randn(3, 6, 16, dtype=dt).transpose(-2, -1),
         offs(3, 7, 10), 2 * 10 * 16 * 6),                        # 2D x 3D: MoE forward
        (torch.randn(6, 16, dtype=dt), torch.randn(16, 8, dtype=dt), offs(3, 7, 16),
         2 * 6 * 16 * 8),                                         # 2D x 2D: weight gradient
        (torch.randn(3, 6, 16, dtype=dt), torch.randn(6, 16, dtype=dt).t(), offs(2, 4, 6),
         2 * 6 * 16 * 6),                                         # 3D x 2D
        (torch.randn(6, 5, 16, dtype=dt), torch.randn(6, 6, 16, dtype=dt).transpose(-2, -1),
         None, 2 * 6 * 5 * 16 * 6),                               # 3D x 3D: bmm
    ]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_mm_fake_kernel_allocates_as_the_cpu_kernel(dt):
    for a, b, o, flops in _layouts(dt):
        real = torch._grouped_mm(a, b, offs=o)
        mode = CaptureFakeMode()
        fo = mode.from_tensor(o) if o is not None else None
        with mode:
            fake = torch._grouped_mm(mode.from_tensor(a), mode.from_tensor(b), offs=fo)
        assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
        assert fake.untyped_storage().nbytes() == real.untyped_storage().nbytes()
        assert grouped_mm_flops(a, b, o) == flops


def test_grouped_mm_fake_kernel_rejects_what_the_cpu_kernel_rejects():
    cases = [(torch.randn(10, 16, dtype=torch.float64), torch.randn(3, 16, 8, dtype=torch.float64)),
             (torch.randn(10, 16), torch.randn(3, 16, 6))]  # NOTE: rows of 24 bytes: unaligned
    for a, b in cases:
        o = torch.tensor([3, 7, 10], dtype=torch.int32)
        with pytest.raises(RuntimeError):
            torch._grouped_mm(a, b, offs=o)
        mode = CaptureFakeMode()
        with pytest.raises(RuntimeError), mode:
            torch._grouped_mm(mode.from_tensor(a), mode.from_tensor(b), offs=mode.from_tensor(o))


def _mixtral(layers=1, **kw):
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256, **kw))


def _qwen2_moe(layers=1):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        max_position_embeddings=256))


def _qwen3_moe(layers=1):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=256))


def _deepseek_v3(layers=2):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=256))


def _gpt_oss(layers=1):
    from transformers import GptOssConfig, GptOssForCausalLM
    return GptOssForCausalLM(GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, layer_types=["full_attention"] * layers,
        max_position_embeddings=256))


def _olmoe(layers=1):
    from transformers import OlmoeConfig, OlmoeForCausalLM
    return OlmoeForCausalLM(OlmoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=None))


def _batch(b=2, t=16):
    ids = torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def _check_bitwise(make, dt):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = make().to(dt)
    assert model.config._experts_implementation == "grouped_mm"  # NOTE: transformers' default
    g = check_same_as_eager(model, _batch(), make_optimizer=_adamw, steps=2)
    gmm = [n for n in g.nodes if n.target == "aten._grouped_mm.default"]
    assert {n.phase.value for n in gmm} == {"forward", "backward"}
    assert all(n.flops > 0 and ".experts" in n.module for n in gmm)


@pytest.mark.hf
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("make", [_mixtral, _qwen2_moe, _qwen3_moe], ids=lambda f: f.__name__)
def test_hf_moe_trains_bitwise_as_eager(make, dt):
    """Two AdamW steps through the captured graph: loss, gradients, weights and optimizer
    state bitwise equal to eager's, in float32 and bfloat16."""
    _check_bitwise(make, dt)


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("make", [_deepseek_v3, _gpt_oss, _olmoe], ids=lambda f: f.__name__)
def test_more_hf_moe_families_train_bitwise_as_eager(make, dt):
    """DeepSeek-V3 (grouped top-k routing, shared experts), GPT-OSS (biased, transposed
    experts, clamped gate), OLMoE."""
    _check_bitwise(make, dt)


def _plan_and_step(model, batch, **kw):
    """``fitgraph.optimize`` then one step, against one eager AdamW step of a twin: the same
    loss, gradients and weights, bitwise where the plan keeps every op as eager runs it,
    close where fission split a region (its pieces round sums differently); the measured peak
    is the planned one."""
    a, b = model, copy.deepcopy(model)
    oa, ob = _adamw(a.parameters()), _adamw(b.parameters())
    step = fitgraph.optimize(b, batch, None, ob, **kw)
    torch.manual_seed(1)
    la = a(**batch).loss
    la.backward()
    oa.step()
    torch.manual_seed(1)
    lb = step(batch)
    report = step.report()
    if report.notes.get("winner") == "fission":
        torch.testing.assert_close(lb, la.detach())
        for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
            # NOTE: AdamW turns a rounding-noise gradient into a whole step of lr
            torch.testing.assert_close(pb, pa, atol=2.5 * LR, rtol=0, msg=n)
    else:
        assert torch.equal(lb, la.detach())
        assert_bitwise_equal_models(a, b)
    assert report.measured_peak_bytes == report.planned_peak_bytes
    return report


@pytest.mark.hf
@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_mixtral_plans_within_budget_and_trains_as_eager(dt):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    report = _plan_and_step(_mixtral(2).to(dt), _batch(4, 64), budget=0.6,
                            cost_model="cpu-generic", time_budget=2)
    assert report.planned_peak_bytes <= report.budget_bytes


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(budget=0.6), dict(latency_limit=1.1)], ids=str)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("make", [_mixtral, _qwen3_moe], ids=lambda f: f.__name__)
def test_moe_plans_with_measured_costs_and_trains_as_eager(make, dt, kw):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    report = _plan_and_step(make(2).to(dt), _batch(4, 64), time_budget=10, **kw)
    if "budget" in kw:
        assert report.planned_peak_bytes <= report.budget_bytes


@pytest.mark.hf
def test_moe_loop_experts_name_the_module_and_the_fix():
    """transformers' ``experts_implementation="eager"`` loops over the tokens each expert got
    (``nonzero``): data-dependent shapes, no static graph. The error says to use grouped_mm."""
    pytest.importorskip("transformers")
    model = _mixtral(experts_implementation="eager")
    with pytest.raises(CaptureError, match="data-dependent") as e:
        fitgraph.capture(model, _batch())
    assert e.value.module == "model.layers.0.mlp.experts"
    assert e.value.op == "aten.nonzero.default"
    assert "set_experts_implementation('grouped_mm')" in str(e.value)
    assert "modeling_mixtral.py" in str(e.value)  # NOTE: the source line that did it
