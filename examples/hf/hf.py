"""Hugging Face architectures from small configs with random weights, as one model file.

    autoddl plan examples/hf/hf.py --set arch=llama --cluster configs/local-cpu.yaml

``arch`` picks the architecture (``ARCHS``); nothing is downloaded: each model is
built from a ``transformers`` config class with a few layers and a small width,
so every architecture traces in seconds and runs on two CPU ranks. Inputs go to
``forward`` by keyword as Hugging Face names them (``input_ids``,
``attention_mask``, ``pixel_values``, ...); the labels are targets that only the
loss takes (``example_targets``), so the HF model is used unwrapped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

# sizes shared by every architecture: hidden 64, 4 heads (2 key/value heads where the
# architecture has grouped-query attention), 2 layers, vocabulary 128
HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, VOCAB = 64, 4, 2, 2, 128, 128
CLASSES = 4          # classification heads (BERT, RoBERTa, ViT, Whisper)

_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=1)   # inside the small vocabulary
_DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                use_cache=False, **_TOKENS)
_ENCODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=64, num_labels=CLASSES,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

# arch -> (model class, config class, config keywords, kind)
ARCHS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", _DECODER, "causal_lm"),
    "mistral": ("MistralForCausalLM", "MistralConfig", _DECODER, "causal_lm"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", _DECODER, "causal_lm"),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", {**_DECODER, "head_dim": HIDDEN // HEADS}, "causal_lm"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", _DECODER, "causal_lm"),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig",
                 {k: v for k, v in _DECODER.items() if k != "num_key_value_heads"}, "causal_lm"),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",
             dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64, use_cache=False,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_TOKENS), "causal_lm"),
    "bert": ("BertForSequenceClassification", "BertConfig", _ENCODER, "classify_text"),
    "roberta": ("RobertaForSequenceClassification", "RobertaConfig",
                {**_ENCODER, "max_position_embeddings": 66, "pad_token_id": 1}, "classify_text"),
    "t5": ("T5ForConditionalGeneration", "T5Config",
           dict(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=LAYERS,
                num_heads=HEADS, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0), "seq2seq"),
    "vit": ("ViTForImageClassification", "ViTConfig",
            dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                 image_size=32, patch_size=8, num_labels=CLASSES, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0), "classify_image"),
    "whisper": ("WhisperForAudioClassification", "WhisperConfig",
                dict(d_model=HIDDEN, encoder_layers=LAYERS, encoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                     decoder_layers=1, decoder_attention_heads=HEADS, decoder_ffn_dim=FFN, num_mel_bins=16,
                     max_source_positions=16, vocab_size=VOCAB, num_labels=CLASSES, dropout=0.0,
                     use_weighted_layer_sum=False, pad_token_id=0, bos_token_id=1, eos_token_id=1,
                     decoder_start_token_id=1), "classify_audio"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.0},
                "causal_lm"),
}


def build_model(arch: str = "llama", experts: str = "grouped_mm") -> torch.nn.Module:
    """The HF model of ``arch`` with random weights, fp32, SDPA attention (T5: eager), train mode.

    ``experts`` is the MoE expert implementation (Mixtral): HF's default ``grouped_mm``
    (a custom op, ``transformers::grouped_mm_fallback``, on CPU) or ``batched_mm``
    (each token gathers its experts' weights: plain aten ops). autoddl traces either as one
    ``autoddl::moe_experts`` op per layer (autoddl/moe.py), so both give the same graph."""
    model_cls, config_cls, config_kw, _ = _arch(arch)
    config = getattr(transformers, config_cls)(**config_kw)
    config._attn_implementation = "eager" if arch == "t5" else "sdpa"
    if "num_local_experts" in config_kw:
        config._experts_implementation = experts
    return getattr(transformers, model_cls)(config).train()


def example_inputs(arch: str = "llama", batch: int = 8, seq: int = 16) -> dict[str, torch.Tensor]:
    """One batch by HF keyword: token ids (+ attention mask), pixels, or log-mel features."""
    kind = _arch(arch)[3]
    if kind == "classify_image":
        return {"pixel_values": torch.randn(batch, 3, 32, 32)}
    if kind == "classify_audio":
        return {"input_features": torch.randn(batch, 16, 32)}            # (B, mel bins, 2 * source positions)
    ids = torch.randint(2, VOCAB, (batch, seq))
    if kind == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(2, VOCAB, (batch, seq))}
    return {"input_ids": ids}


def example_targets(arch: str = "llama", batch: int = 8, seq: int = 16) -> dict[str, torch.Tensor]:
    """The labels, which only the loss takes: a token per position for language models (the
    next tokens of a real batch), a class per example for classifiers."""
    kind = _arch(arch)[3]
    if kind in ("causal_lm", "seq2seq"):
        return {"labels": torch.randint(0, VOCAB, (batch, seq))}
    return {"labels": torch.randint(0, CLASSES, (batch,))}


def loss_fn(output, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits against the labels (token-level for language models)."""
    logits = output.logits                                                # (B, T, V) or (B, C)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _arch(arch: str):
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not one of {', '.join(ARCHS)}; pass --set arch=NAME")
    return ARCHS[arch]
