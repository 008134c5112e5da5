"""Small Hugging Face ``transformers`` models, built from configs (random weights).

Nothing is downloaded: every model is ``Model(config)`` from a config written
here, and batches are random token ids / pixels, so no tokenizer is needed.
``loss_fn`` is None: the batch is a dict with ``labels`` and the loss is
``model(**batch).loss``. ``transformers`` is imported only when one of these is
built (``pip install fitgraph[hf]``).

Names: hf-bert (BertForMaskedLM), hf-gpt2 (GPT2LMHeadModel), hf-llama
(LlamaForCausalLM), hf-t5 (T5ForConditionalGeneration), hf-vit
(ViTForImageClassification). Only a "small" config exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .registry import (
    BuildArgs,
    ZooCase,
    construct,
    count_params,
    fmt_params,
    generator,
    pick,
    rand_floats,
    rand_ints,
    rand_padding_mask,
    register,
)

# NOTE: the same shapes as the built-in small configs where there is a twin
# (hf-bert = bert-base small, hf-gpt2 = gpt2 small, hf-llama = llama small,
# hf-vit = vit-b16 small, minus dropout). Measured fp32, 1 CPU thread: each
# step 0.3-0.8 s; activations 73-87% of the eager peak (hf-bert 291 MB,
# hf-gpt2 336 MB, hf-llama 386 MB, hf-t5 264 MB, hf-vit 94 MB).
_VOCAB = 8192
_SDPA = {"attn_implementation": "sdpa"}


def _transformers(name: str) -> Any:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            f"zoo model {name!r} needs Hugging Face transformers: pip install fitgraph[hf]"
        ) from e
    return transformers


def _make(args: BuildArgs, cls: Any, config: Any) -> nn.Module:
    # NOTE: every config is made with attn_implementation="sdpa" (_SDPA); it
    # traces under make_fx(tracing_mode="fake") for all five, with and without
    # a padding attention_mask. The causal LMs get no attention_mask, as in
    # packed pre-training: HF then passes is_causal to SDPA instead of
    # materialising a [B, 1, T, T] mask.
    return construct(lambda: cls(config), args)


def _case(args: BuildArgs, model: nn.Module, batch: dict, block: type, what: str) -> ZooCase:
    desc = f"HF {what}, {fmt_params(count_params(model))} params (random init)"
    return ZooCase(args.name, args.config, model, batch, None, (block,), desc)


def _bert(args: BuildArgs) -> ZooCase:
    tf = _transformers(args.name)
    from transformers.models.bert.modeling_bert import BertLayer

    B, T = pick(args.batch_size, 2), pick(args.seq_len, 512)
    cfg = tf.BertConfig(
        vocab_size=_VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=max(512, T),
        **_SDPA,
    )
    model = _make(args, tf.BertForMaskedLM, cfg)
    gen = generator(args)
    input_ids = rand_ints((B, T), _VOCAB, gen, args)
    labels = rand_ints((B, T), _VOCAB, gen, args)
    if not args.is_meta:
        # NOTE: masked-LM targets on ~15% of positions, -100 (ignored) elsewhere.
        chosen = torch.rand((B, T), generator=gen) < 0.15
        chosen[:, 0] = True
        labels = torch.where(chosen.to(args.device), labels, torch.full_like(labels, -100))
    batch = {
        "input_ids": input_ids,
        "token_type_ids": torch.zeros_like(input_ids),
        "attention_mask": rand_padding_mask(B, T, gen, args),
        "labels": labels,
    }
    what = f"BertForMaskedLM: 4 layers, d=256, vocab {_VOCAB}, seq {T}, batch {B}"
    return _case(args, model, batch, BertLayer, what)


def _causal_batch(args: BuildArgs, B: int, T: int) -> dict[str, torch.Tensor]:
    # NOTE: labels == input_ids; HF shifts them inside the loss.
    input_ids = rand_ints((B, T), _VOCAB, generator(args), args)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def _gpt2(args: BuildArgs) -> ZooCase:
    tf = _transformers(args.name)
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    B, T = pick(args.batch_size, 2), pick(args.seq_len, 512)
    cfg = tf.GPT2Config(
        vocab_size=_VOCAB, n_positions=max(1024, T), n_embd=256, n_layer=4, n_head=4,
        bos_token_id=_VOCAB - 1, eos_token_id=_VOCAB - 1,
        **_SDPA,
    )
    model = _make(args, tf.GPT2LMHeadModel, cfg)
    what = f"GPT2LMHeadModel: 4 layers, d=256, vocab {_VOCAB}, seq {T}, batch {B}"
    return _case(args, model, _causal_batch(args, B, T), GPT2Block, what)


def _llama(args: BuildArgs) -> ZooCase:
    tf = _transformers(args.name)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    B, T = pick(args.batch_size, 4), pick(args.seq_len, 512)
    cfg = tf.LlamaConfig(
        vocab_size=_VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(2048, T),
        **_SDPA,
    )
    model = _make(args, tf.LlamaForCausalLM, cfg)
    what = f"LlamaForCausalLM: 4 layers, d=256, GQA 4/2 heads, vocab {_VOCAB}, seq {T}, batch {B}"
    return _case(args, model, _causal_batch(args, B, T), LlamaDecoderLayer, what)


def _t5(args: BuildArgs) -> ZooCase:
    tf = _transformers(args.name)
    from transformers.models.t5.modeling_t5 import T5Block

    B, T = pick(args.batch_size, 4), pick(args.seq_len, 256)
    T_dec = max(1, T // 4)
    cfg = tf.T5Config(
        vocab_size=_VOCAB, d_model=256, d_kv=64, d_ff=1024, num_layers=4,
        num_decoder_layers=4, num_heads=4, decoder_start_token_id=0, pad_token_id=0,
        **_SDPA,
    )
    model = _make(args, tf.T5ForConditionalGeneration, cfg)
    gen = generator(args)
    input_ids = rand_ints((B, T), _VOCAB, gen, args)
    labels = rand_ints((B, T_dec), _VOCAB, gen, args)
    # NOTE: decoder inputs are shifted here, at build time, so the model does
    # not run its in-place _shift_right inside the captured step.
    start = torch.zeros_like(labels[:, :1])
    decoder_input_ids = torch.cat((start, labels[:, :-1]), dim=1)
    batch = {
        "input_ids": input_ids,
        "attention_mask": rand_padding_mask(B, T, gen, args),
        "decoder_input_ids": decoder_input_ids,
        "labels": labels,
    }
    what = f"T5ForConditionalGeneration: 4+4 layers, d=256, vocab {_VOCAB}, seq {T}->{T_dec}, batch {B}"
    return _case(args, model, batch, T5Block, what)


def _vit(args: BuildArgs) -> ZooCase:
    tf = _transformers(args.name)
    from transformers.models.vit.modeling_vit import ViTLayer

    B, S = pick(args.batch_size, 8), pick(args.image_size, 224)
    if S % 16:
        raise ValueError(f"hf-vit image_size must be a multiple of 16, got {S}")
    cfg = tf.ViTConfig(
        image_size=S, patch_size=16, hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
        intermediate_size=768, num_labels=1000, problem_type="single_label_classification",
        **_SDPA,
    )
    model = _make(args, tf.ViTForImageClassification, cfg)
    gen = generator(args)
    batch = {
        "pixel_values": rand_floats((B, 3, S, S), gen, args),
        "labels": rand_ints((B,), 1000, gen, args),
    }
    what = f"ViTForImageClassification: 4 layers, d=192, {S}x{S}, batch {B}"
    return _case(args, model, batch, ViTLayer, what)


_BUILDERS: dict[str, tuple[Callable[[BuildArgs], ZooCase], tuple[str, ...]]] = {
    "hf-bert": (_bert, ("batch_size", "seq_len")),
    "hf-gpt2": (_gpt2, ("batch_size", "seq_len")),
    "hf-llama": (_llama, ("batch_size", "seq_len")),
    "hf-t5": (_t5, ("batch_size", "seq_len")),
    "hf-vit": (_vit, ("batch_size", "image_size")),
}

for _name, (_builder, _overrides) in _BUILDERS.items():
    register(_name, configs=("small",), overrides=_overrides, hf=True)(_builder)
