"""The sweep's models: architectures that Hugging Face ``transformers`` ships, plus torch.nn blocks.

Each entry builds one model from a small config with random weights (``XConfig(...)`` then
``XForY(config)``: nothing is downloaded), one batch and how to get its loss, seeded, so two
builds are the same model.

Sizes: in real training's proportions, scaled down. A 7B Llama trained in bf16 (weights and
grads 2 bytes, fp32 master weights and AdamW moments 12: 16 bytes a parameter, ~112 GB) at
sequence 4096, a few sequences a GPU, has eager activations of ~2-4x that persistent state: the
hidden size is large beside the tokens per step (tokens / hidden ~ 4-16) and there are many
layers, so no single block's activations dominate. Here everything is fp32 with AdamW (16 bytes
a parameter too), and:

- transformers: ``HIDDEN=128``, ``LAYERS=4``, ``B, T = 2, 256``: 512 tokens, 4 per hidden unit.
  A block holds ~12 H^2 parameters (~0.2 M, 3 MiB of state) and keeps ~20 H floats a token for
  backward (~5 MiB at 512 tokens): eager peaks at ~2-4x the lower bound (weights + grads +
  AdamW state + batch), as in real training, instead of the ~17x of a 64-wide, 2-layer toy
  whose step was all activations. The vocabulary (1024, 8x the hidden size as Llama's 32k is
  8x 4096) keeps the logits a minor share, as they are in real LMs;
- MoE: four experts of half a dense MLP each (fine-grained experts, as Qwen-MoE or OLMoE);
- encoder-decoders: 512 encoder and 256 decoder tokens; Whisper: 4 x 250 encoder frames;
  wav2vec2/HuBERT: two seconds of audio a sample (their conv front-end is ~half the peak);
- vision transformers: 2 images of 64x64 in 4x4 patches (514 tokens, as the LMs); CNNs keep a
  batch of 16 and segmentation 8, since their activations per image are small beside their
  weights; state-space models: a short sequence (their CPU paths scan step by step);
- torch.nn blocks: the same ``HIDDEN``/``LAYERS`` and ``B, T``.

Eager peaks at 1.9-4.8x the lower bound on the transformers (gemma2, whose eager attention
materialises the scores, ~4x; CNNs 2.5-10x), and each step runs in under ~0.3 s on one CPU
thread (T5, 8 layers without SDPA, is the slowest).

``build(name)`` returns a :class:`SweepCase`; ``names()`` lists the sweep (``TEST_MODELS``, for
the harness's own tests, are built only when named).

Example:
    >>> case = build("gpt2")
    >>> case.family, case.hf_checkpointing
    ('decoder', True)
    >>> bool(torch.isfinite(case.loss()))
    True
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "TEST_MODELS", "SweepCase", "build", "names"]

SEED = 0
VOCAB = 1024       # NOTE: small, so the logits (activations) dominate, not the embedding weights
HIDDEN = 128
HEADS = 4
LAYERS = 4
B, T = 2, 256      # causal LMs and encoders: B * T / HIDDEN = 4 tokens per hidden unit
IMG, IMG_B, CNN_B, SEG_B = 64, 2, 16, 8  # vision: 64x64 images; ViTs batch 2, CNNs 16, seg 8
# NOTE: the configs pin SDPA where the model offers a choice; "eager" attention materialises
# the [B, H, T, T] scores, which is another model's memory profile than what users run
ATTN = {"attn_implementation": "sdpa"}


@dataclass
class SweepCase:
    """One sweep model: module, batch, loss and what checkpointing it supports.

    ``loss_fn`` None: the loss is ``model(**batch).loss`` (Hugging Face style).
    ``hf_checkpointing``: ``model.gradient_checkpointing_enable()`` exists and works;
    otherwise ``block_types`` are what per-block ``torch.utils.checkpoint`` wraps."""

    name: str
    family: str
    model: nn.Module
    batch: Any
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None
    hf_checkpointing: bool
    block_types: tuple[type, ...] = ()

    def loss(self, model: nn.Module | None = None) -> torch.Tensor:
        """The loss of ``model`` (default: this case's) on the batch."""
        m = self.model if model is None else model
        return m(**self.batch).loss if self.loss_fn is None else self.loss_fn(m, self.batch)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


def _tf():
    # NOTE: no hub access, ever: every model is built from a config written here
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    return transformers


def _hf(name: str, family: str, cls: str, cfg: str, batch: dict, loss_fn=None,
        blocks: tuple[str, ...] = (), **config) -> SweepCase:
    """``cls(cfg(**config))`` in train mode. ``blocks``: the class names that per-block
    ``torch.utils.checkpoint`` wraps where the model has no ``gradient_checkpointing_enable``."""
    tf = _tf()
    conf = getattr(tf, cfg)(**config)
    model = getattr(tf, cls)(conf)
    model.train()
    block_types = tuple(dict.fromkeys(type(m) for m in model.modules()
                                      if type(m).__name__ in blocks))
    return SweepCase(name, family, model, batch, loss_fn,
                     bool(getattr(model, "supports_gradient_checkpointing", False)), block_types)


# -- batches ----------------------------------------------------------------------------------

def _causal() -> dict:
    ids = torch.randint(0, VOCAB, (B, T), generator=_gen())
    return {"input_ids": ids, "labels": ids.clone()}   # NOTE: HF shifts the labels itself


def _masked() -> dict:
    g = _gen()
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    labels = torch.randint(0, VOCAB, (B, T), generator=g)
    chosen = torch.rand((B, T), generator=g) < 0.15   # NOTE: 15% of positions, as in BERT
    chosen[:, 0] = True
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.where(chosen, labels, torch.full_like(labels, -100))}


def _seq2seq(t_dec: int = T // 2, start: int = 0) -> dict:
    g = _gen()
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    labels = torch.randint(1, VOCAB, (B, t_dec), generator=g)
    # NOTE: decoder inputs shifted here, so no model runs its in-place shift inside the step
    dec = torch.cat((torch.full_like(labels[:, :1], start), labels[:, :-1]), dim=1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "decoder_input_ids": dec, "labels": labels}


def _images(n_labels: int = 10, size: int = IMG, batch: int = IMG_B) -> dict:
    g = _gen()
    return {"pixel_values": torch.randn((batch, 3, size, size), generator=g),
            "labels": torch.randint(0, n_labels, (batch,), generator=g)}


def _cnn_images() -> dict:
    # NOTE: CNNs' activations per image are small beside their weights: a larger batch
    return _images(batch=CNN_B)


def _seg(n_labels: int = 8, size: int = IMG) -> dict:
    g = _gen()
    return {"pixel_values": torch.randn((SEG_B, 3, size, size), generator=g),
            "labels": torch.randint(0, n_labels, (SEG_B, size, size), generator=g)}


# -- decoder LMs ------------------------------------------------------------------------------

_LM = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
           num_attention_heads=HEADS, intermediate_size=4 * HIDDEN, **ATTN)


def _llama_like(name: str, cls: str, cfg: str, **extra) -> Callable[[], SweepCase]:
    def make() -> SweepCase:
        return _hf(name, "decoder", cls, cfg, _causal(),
                   **{**_LM, "num_key_value_heads": 2, "max_position_embeddings": 2 * T, **extra})
    return make


def _gpt2() -> SweepCase:
    return _hf("gpt2", "decoder", "GPT2LMHeadModel", "GPT2Config", _causal(), vocab_size=VOCAB,
               n_positions=2 * T, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
               bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, **ATTN)


def _gpt_neox() -> SweepCase:
    return _hf("gpt-neox", "decoder", "GPTNeoXForCausalLM", "GPTNeoXConfig", _causal(),
               **{**_LM, "max_position_embeddings": 2 * T})


def _opt() -> SweepCase:
    return _hf("opt", "decoder", "OPTForCausalLM", "OPTConfig", _causal(), vocab_size=VOCAB,
               hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               ffn_dim=4 * HIDDEN, word_embed_proj_dim=HIDDEN, max_position_embeddings=2 * T,
               **ATTN)


def _falcon() -> SweepCase:
    return _hf("falcon", "decoder", "FalconForCausalLM", "FalconConfig", _causal(),
               vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
               num_attention_heads=HEADS, **ATTN)


def _bloom() -> SweepCase:
    return _hf("bloom", "decoder", "BloomForCausalLM", "BloomConfig", _causal(),
               vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS)


def _phi() -> SweepCase:
    return _hf("phi", "decoder", "PhiForCausalLM", "PhiConfig", _causal(),
               **{**_LM, "max_position_embeddings": 2 * T})


# -- mixture of experts -----------------------------------------------------------------------

# NOTE: fine-grained experts (Qwen-MoE, DeepSeek-MoE, OLMoE), each half a dense MLP: four of
# full size would make the experts' weights and their AdamW state outweigh the activations
_MOE = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=2 * HIDDEN)


def _moe(name: str, cls: str, cfg: str, **extra) -> Callable[[], SweepCase]:
    def make() -> SweepCase:
        return _hf(name, "moe", cls, cfg, _causal(),
                   **{**_LM, "num_key_value_heads": 2, "max_position_embeddings": 2 * T, **extra})
    return make


# -- encoders ---------------------------------------------------------------------------------

_ENC = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, intermediate_size=4 * HIDDEN,
            max_position_embeddings=2 * T)


def _encoder(name: str, cls: str, cfg: str, sdpa: bool = True, **extra) -> Callable[[], SweepCase]:
    def make() -> SweepCase:
        return _hf(name, "encoder", cls, cfg, _masked(),
                   **{**_ENC, **(ATTN if sdpa else {}), **extra})
    return make


def _distilbert() -> SweepCase:
    return _hf("distilbert", "encoder", "DistilBertForMaskedLM", "DistilBertConfig", _masked(),
               vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
               hidden_dim=4 * HIDDEN, max_position_embeddings=2 * T, **ATTN)


# -- encoder-decoders -------------------------------------------------------------------------

def _t5() -> SweepCase:
    return _hf("t5", "encoder-decoder", "T5ForConditionalGeneration", "T5Config", _seq2seq(),
               vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=4 * HIDDEN,
               num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS,
               decoder_start_token_id=0, pad_token_id=0, **ATTN)


def _bart_like(name: str, cls: str, cfg: str) -> Callable[[], SweepCase]:
    def make() -> SweepCase:
        return _hf(name, "encoder-decoder", cls, cfg, _seq2seq(start=2), vocab_size=VOCAB,
                   d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                   encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                   encoder_ffn_dim=4 * HIDDEN, decoder_ffn_dim=4 * HIDDEN,
                   max_position_embeddings=2 * T, pad_token_id=1, decoder_start_token_id=2,
                   **ATTN)
    return make


# -- speech -----------------------------------------------------------------------------------

MEL, AUDIO_POS = 80, 250   # NOTE: Whisper's encoder wants exactly 2 * max_source_positions frames
AUDIO = 2 * 16000          # two seconds of 16 kHz audio per sample (~100 frames) for the CTC models
SPEECH_B = 4               # NOTE: Whisper: 4 x 250 encoder frames = 1000 tokens, ~8 per hidden unit


def _whisper() -> SweepCase:
    g = _gen()
    labels = torch.randint(1, VOCAB, (SPEECH_B, 64), generator=g)
    batch = {"input_features": torch.randn((SPEECH_B, MEL, 2 * AUDIO_POS), generator=g),
             "decoder_input_ids": torch.cat((torch.zeros_like(labels[:, :1]), labels[:, :-1]), 1),
             "labels": labels}
    return _hf("whisper", "speech", "WhisperForConditionalGeneration", "WhisperConfig", batch,
               vocab_size=VOCAB, num_mel_bins=MEL, d_model=HIDDEN, encoder_layers=LAYERS,
               decoder_layers=LAYERS, encoder_attention_heads=HEADS,
               decoder_attention_heads=HEADS, encoder_ffn_dim=4 * HIDDEN,
               decoder_ffn_dim=4 * HIDDEN, max_source_positions=AUDIO_POS,
               max_target_positions=128, pad_token_id=0, decoder_start_token_id=0,
               bos_token_id=0, eos_token_id=1, **ATTN)


def _speech_config(**extra) -> dict:
    # NOTE: mask_time_prob=0: SpecAugment draws its masks with numpy, outside torch's RNG
    return dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                intermediate_size=4 * HIDDEN, conv_dim=(64, 64, 64, 64, 64, 64, 64),
                num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                mask_time_prob=0.0, layerdrop=0.0, **ATTN, **extra)


def _wav2vec2() -> SweepCase:
    """Wav2Vec2ForCTC with HF's own CTC loss, as users fine-tune it. NOTE: that loss selects the
    targets with ``labels.masked_select(labels >= 0)`` and CTC's alpha table is as long as the
    longest target: data-dependent shapes, which fitgraph refuses with a CaptureError (torch
    has no fake kernel for ``aten._ctc_loss`` even with int lengths)."""
    g = _gen()
    batch = {"input_values": torch.randn((B, AUDIO), generator=g),
             "labels": torch.randint(1, 32, (B, 20), generator=g)}
    return _hf("wav2vec2", "speech", "Wav2Vec2ForCTC", "Wav2Vec2Config", batch,
               **_speech_config(vocab_size=32))


def _hubert() -> SweepCase:
    """HubertForSequenceClassification (utterance labels, cross-entropy): the encoder without
    CTC's data-dependent loss (see ``_wav2vec2``)."""
    g = _gen()
    batch = {"input_values": torch.randn((B, AUDIO), generator=g),
             "labels": torch.randint(0, 10, (B,), generator=g)}
    return _hf("hubert", "speech", "HubertForSequenceClassification", "HubertConfig", batch,
               **_speech_config(num_labels=10))


# -- vision -----------------------------------------------------------------------------------

def _vision(name: str, family: str, cls: str, cfg: str, batch: Callable[[], dict] = _images,
            **config) -> Callable[[], SweepCase]:
    def make() -> SweepCase:
        return _hf(name, family, cls, cfg, batch(), **config)
    return make


_VIT = dict(image_size=IMG, patch_size=4, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, intermediate_size=4 * HIDDEN, num_labels=10)


# -- torch.nn building blocks ----------------------------------------------------------------

class _Recurrent(nn.Module):
    """An LSTM or GRU over a sequence of features, then a per-step classifier."""

    def __init__(self, kind: type):
        super().__init__()
        self.rnn = kind(HIDDEN, HIDDEN, num_layers=2, batch_first=True)
        self.head = nn.Linear(HIDDEN, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class _MHABlock(nn.Module):
    """Pre-norm attention block over ``nn.MultiheadAttention`` (batch first) and an MLP."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(),
                                 nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def _seq_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _seq_batch(classes: int = 32) -> tuple:
    g = _gen()
    return (torch.randn((B, T, HIDDEN), generator=g),
            torch.randint(0, classes, (B, T), generator=g))


def _rnn(name: str, kind: type) -> Callable[[], SweepCase]:
    def make() -> SweepCase:
        return SweepCase(name, "torch.nn", _Recurrent(kind).train(), _seq_batch(), _seq_loss,
                         False, (kind,))
    return make


def _mha() -> SweepCase:
    model = nn.Sequential(*[_MHABlock() for _ in range(LAYERS)], nn.Linear(HIDDEN, 32))
    return SweepCase("nn-mha", "torch.nn", model.train(), _seq_batch(), _seq_loss, False,
                     (_MHABlock,))


def _transformer_encoder() -> SweepCase:
    layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, 4 * HIDDEN, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False),
                          nn.Linear(HIDDEN, 32))
    return SweepCase("nn-transformer-encoder", "torch.nn", model.train(), _seq_batch(),
                     _seq_loss, False, (nn.TransformerEncoderLayer,))


# -- test-only entries (built only when named) ------------------------------------------------

class _Segfault(nn.Module):
    """Kills its own process with SIGSEGV on the first forward: the harness must survive it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)
        return self.lin(x)


def _tiny_mlp() -> SweepCase:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)])
    batch = torch.randn((64, 32), generator=_gen())
    return SweepCase("test-tiny-mlp", "test", model, batch,
                     lambda m, b: m(b).square().mean(), False, (nn.Sequential,))


def _segfault() -> SweepCase:
    return SweepCase("test-segfault", "test", _Segfault(), torch.randn(4, 8),
                     lambda m, b: m(b).sum(), False, ())


# -- the registry -----------------------------------------------------------------------------

MODELS: dict[str, Callable[[], SweepCase]] = {
    # decoder LMs
    "gpt2": _gpt2,
    "llama": _llama_like("llama", "LlamaForCausalLM", "LlamaConfig"),
    "mistral": _llama_like("mistral", "MistralForCausalLM", "MistralConfig"),
    "qwen2": _llama_like("qwen2", "Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": _llama_like("qwen3", "Qwen3ForCausalLM", "Qwen3Config", head_dim=HIDDEN // HEADS),
    "gemma": _llama_like("gemma", "GemmaForCausalLM", "GemmaConfig", head_dim=HIDDEN // HEADS),
    # NOTE: Gemma 2 has no SDPA path (its logit soft-capping): HF's eager attention
    "gemma2": _llama_like("gemma2", "Gemma2ForCausalLM", "Gemma2Config",
                          head_dim=HIDDEN // HEADS, sliding_window=T // 2,
                          attn_implementation="eager"),
    "phi": _phi,
    "gpt-neox": _gpt_neox,
    "opt": _opt,
    "falcon": _falcon,
    "bloom": _bloom,
    # mixture of experts
    "mixtral": _moe("mixtral", "MixtralForCausalLM", "MixtralConfig", **_MOE),
    "qwen2-moe": _moe("qwen2-moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
                      shared_expert_intermediate_size=2 * HIDDEN),
    "qwen3-moe": _moe("qwen3-moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
                      head_dim=HIDDEN // HEADS),
    "olmoe": _moe("olmoe", "OlmoeForCausalLM", "OlmoeConfig", num_experts=4,
                  num_experts_per_tok=2, intermediate_size=2 * HIDDEN),
    # encoders
    "bert": _encoder("bert", "BertForMaskedLM", "BertConfig"),
    "roberta": _encoder("roberta", "RobertaForMaskedLM", "RobertaConfig", pad_token_id=1,
                        max_position_embeddings=2 * T + 2),
    "distilbert": _distilbert,
    "albert": _encoder("albert", "AlbertForMaskedLM", "AlbertConfig", embedding_size=HIDDEN,
                       blocks=("AlbertLayer",)),
    "electra": _encoder("electra", "ElectraForMaskedLM", "ElectraConfig", embedding_size=HIDDEN),
    "deberta-v2": _encoder("deberta-v2", "DebertaV2ForMaskedLM", "DebertaV2Config", sdpa=False),
    # encoder-decoders
    "t5": _t5,
    "bart": _bart_like("bart", "BartForConditionalGeneration", "BartConfig"),
    "marian": _bart_like("marian", "MarianMTModel", "MarianConfig"),
    "pegasus": _bart_like("pegasus", "PegasusForConditionalGeneration", "PegasusConfig"),
    # speech
    "whisper": _whisper,
    "wav2vec2": _wav2vec2,
    "hubert": _hubert,
    # vision CNNs
    "resnet": _vision("resnet", "vision-cnn", "ResNetForImageClassification", "ResNetConfig",
                      _cnn_images, blocks=("ResNetBottleNeckLayer",), embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
                      layer_type="bottleneck", num_labels=10),
    "convnext": _vision("convnext", "vision-cnn", "ConvNextForImageClassification",
                        "ConvNextConfig", _cnn_images, blocks=("ConvNextLayer",),
                        hidden_sizes=[16, 32, 64, 128],
                        depths=[1, 1, 2, 1], num_labels=10),
    "efficientnet": _vision("efficientnet", "vision-cnn", "EfficientNetForImageClassification",
                            "EfficientNetConfig", _cnn_images, blocks=("EfficientNetBlock",),
                            image_size=IMG, width_coefficient=0.25, depth_coefficient=0.25,
                            num_labels=10, hidden_dim=320),
    "mobilenet-v2": _vision("mobilenet-v2", "vision-cnn", "MobileNetV2ForImageClassification",
                            "MobileNetV2Config", _cnn_images,
                            blocks=("MobileNetV2InvertedResidual",), image_size=IMG,
                            depth_multiplier=0.35,
                            num_labels=10),
    "regnet": _vision("regnet", "vision-cnn", "RegNetForImageClassification", "RegNetConfig",
                      _cnn_images, blocks=("RegNetYLayer",), embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1],
                      groups_width=16, num_labels=10),
    # vision transformers
    "vit": _vision("vit", "vision-transformer", "ViTForImageClassification", "ViTConfig",
                   **_VIT, **ATTN),
    "deit": _vision("deit", "vision-transformer", "DeiTForImageClassification", "DeiTConfig",
                    **_VIT, **ATTN),
    "beit": _vision("beit", "vision-transformer", "BeitForImageClassification", "BeitConfig",
                    **_VIT, use_relative_position_bias=True),
    "swin": _vision("swin", "vision-transformer", "SwinForImageClassification", "SwinConfig",
                    image_size=IMG, patch_size=2, embed_dim=32, depths=[1, 1, 2],
                    num_heads=[2, 4, 8], window_size=4, num_labels=10),
    # segmentation
    "segformer": _vision("segformer", "segmentation", "SegformerForSemanticSegmentation",
                         "SegformerConfig", _seg, num_encoder_blocks=4, depths=[1, 1, 1, 1],
                         hidden_sizes=[16, 32, 64, 128], decoder_hidden_size=64,
                         num_attention_heads=[1, 2, 4, 8], num_labels=8),
    # state-space models (the models' own torch paths: no CUDA kernels on the CPU)
    "mamba": lambda: _hf("mamba", "state-space", "MambaForCausalLM", "MambaConfig",
                         _ssm_batch(), vocab_size=VOCAB, hidden_size=HIDDEN,
                         state_size=8, num_hidden_layers=LAYERS, expand=2),
    "mamba2": lambda: _hf("mamba2", "state-space", "Mamba2ForCausalLM", "Mamba2Config",
                          _ssm_batch(), vocab_size=VOCAB, hidden_size=HIDDEN, state_size=16,
                          num_hidden_layers=LAYERS, expand=2, num_heads=8, head_dim=2 * HIDDEN // 8,
                          n_groups=1, chunk_size=32),
    # torch.nn building blocks
    "nn-lstm": _rnn("nn-lstm", nn.LSTM),
    "nn-gru": _rnn("nn-gru", nn.GRU),
    "nn-mha": _mha,
    "nn-transformer-encoder": _transformer_encoder,
}

SSM_T = 64   # NOTE: the CPU paths of Mamba scan step by step: a short sequence keeps the graph small


def _ssm_batch() -> dict:
    ids = torch.randint(0, VOCAB, (B, SSM_T), generator=_gen())
    return {"input_ids": ids, "labels": ids.clone()}


TEST_MODELS: dict[str, Callable[[], SweepCase]] = {
    "test-tiny-mlp": _tiny_mlp,
    "test-segfault": _segfault,
}


def names() -> list[str]:
    """The sweep's model names, in the table's order (test-only entries excluded)."""
    return list(MODELS)


def build(name: str) -> SweepCase:
    """Build sweep model ``name`` (seeded: two builds give the same weights and batch)."""
    makers = {**MODELS, **TEST_MODELS}
    if name not in makers:
        raise KeyError(f"unknown sweep model {name!r}; known: {', '.join(makers)}")
    torch.manual_seed(SEED)
    case = makers[name]()
    case.name = name
    return case
