"""Llama 3: a decoder with RMSNorm, rotary embeddings, SwiGLU and grouped-query attention.

Each block: x + attn(rmsnorm(x)), then x + swiglu(rmsnorm(x)). Attention uses
n_kv_heads < n_heads key/value heads (each shared by n_heads / n_kv_heads query
heads), rotary position embeddings from precomputed cos/sin buffers applied with
the real-valued rotate-half form (no complex numbers, so it exports as plain
ops), and causal F.scaled_dot_product_attention. The lm_head is not tied.

Presets (PRESETS below; default "tiny", because the real ones are large):
  tiny        2 layers, dim 64, 4 heads, 2 kv heads, ffn 192, vocab 512, batch 4 x seq 32
  llama3-8b   32 layers, dim 4096, 32/8 heads, ffn 14336, vocab 128256,
              batch 8 x seq 8192 (Llama 3's training context)     (8.03B params)
  llama3-70b  80 layers, dim 8192, 64/8 heads, ffn 28672, vocab 128256,
              batch 8 x seq 8192                                  (70.6B params)
              (Llama 3.1 70B has the same shapes: 3.1 changed only the rotary scaling)
  llama3.1-405b  126 layers, dim 16384, 128/8 heads, ffn 53248, vocab 128256,
              batch 8 x seq 8192                                  (405.9B params)

float_logits=True casts the logits to float32 for the loss, as TorchTitan computes its cross entropy.

Sizes are set by keyword, then preset (the file reads no environment):
  build_model("tiny", n_layers=1)          keyword wins
  on the command line: --preset NAME --set FIELD=VALUE (one --set per field)

Inputs: (tokens, targets), both (B, T) int64; forward(tokens, targets=None)
returns logits (B, T, vocab); loss_fn(logits, tokens, targets) is the cross entropy.
"""

# No `from __future__ import annotations`: dataclasses would then need this module in
# sys.modules, which a loader importing the file by path may not have set up.
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int                 # hidden size of the SwiGLU MLP
    vocab_size: int = 128256
    max_seq_len: int = 8192      # length of the precomputed rotary tables
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    batch_size: int = 8          # example_inputs batch
    seq_len: int = 8192          # example_inputs sequence length, <= max_seq_len
    float_logits: bool = False   # logits cast to float32 for the loss, as TorchTitan's cross entropy
                                 # (train.py loss_fn at 9dec370: cross_entropy(pred.flatten(0, 1).float(), ...))

    def __post_init__(self) -> None:
        problems = []
        if self.dim % self.n_heads:
            problems.append(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            problems.append(f"head_dim={self.dim // self.n_heads} must be even for rotary embeddings")
        if self.seq_len > self.max_seq_len:
            problems.append(f"seq_len={self.seq_len} exceeds max_seq_len={self.max_seq_len}")
        if problems:
            raise ValueError("llama config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=512,
                        max_seq_len=64, batch_size=4, seq_len=32),
    # Llama 3 8B / 70B (Meta's params.json: ffn_dim_multiplier 1.3 / 1.3, multiple_of 1024 / 4096)
    "llama3-8b": LlamaConfig(n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "llama3-70b": LlamaConfig(n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    # Llama 3.1 405B (Dubey et al., "The Llama 3 Herd of Models", arXiv:2407.21783, Table 3: 126 layers,
    # model dimension 16,384, FFN dimension 53,248, 128 attention heads, 8 key/value heads)
    "llama3.1-405b": LlamaConfig(n_layers=126, dim=16384, n_heads=128, n_kv_heads=8, ffn_dim=53248),
}
DEFAULT_PRESET = "tiny"


def config(preset: str | None = None, **overrides) -> LlamaConfig:
    """The preset's config with keyword overrides applied (keyword > preset)."""
    name = preset or DEFAULT_PRESET
    if name not in PRESETS:
        raise ValueError(f"llama: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    base = PRESETS[name]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"llama: unknown config field(s) {sorted(unknown)}; valid fields: {sorted(fields)}")
    return dataclasses.replace(base, **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # written out (not F.rms_norm) so it exports as plain pow / mean / rsqrt / mul ops
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight  # (B, T, C)


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (max_seq_len, head_dim): angle pos * theta^(-2i/head_dim), halves repeated."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (hd/2,)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)          # (L, hd/2)
    angles = torch.cat([angles, angles], dim=-1)                                              # (L, hd)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + hd/2]) of x (B, nh, T, hd) by the angles in cos/sin (T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)                    # 2 x (B, nh, T, hd/2)
    rotated = torch.cat([-x2, x1], dim=-1)         # (B, nh, T, hd)
    return x * cos + rotated * sin                 # (B, nh, T, hd)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.wq(x).view(B, T, nh, hd).transpose(1, 2)    # (B, nh, T, hd)
        k = self.wk(x).view(B, T, nkv, hd).transpose(1, 2)   # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, nkv, hd).transpose(1, 2)   # (B, nkv, T, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        rep = nh // nkv                                      # query heads per kv head
        k = k[:, :, None].expand(B, nkv, rep, T, hd).reshape(B, nh, T, hd)  # (B, nh, T, hd)
        v = v[:, :, None].expand(B, nkv, rep, T, hd).reshape(B, nh, T, hd)  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)         # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hd)              # (B, T, C)
        return self.wo(y)                                                   # (B, T, C)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, C) -> (B, T, F) -> (B, T, C)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, C)
        x = x + self.feed_forward(self.ffn_norm(x))               # (B, T, C)
        return x


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, hd)
        if not self.output.weight.is_meta:
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, mean=0.0, std=0.02)
                    if name.endswith(("wo.weight", "w2.weight")):  # scaled residual projections
                        nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = tokens.shape
        h = self.tok_embeddings(tokens)                  # (B, T, C)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hd) each
        if cos.dtype != h.dtype:                         # computing in bf16 / fp16 (mixed precision)
            cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)                       # (B, T, C)
        logits = self.output(self.norm(h))               # (B, T, vocab)
        return logits.float() if self.config.float_logits else logits


def build_model(preset: str | None = None, **overrides) -> Llama:
    """A Llama with the preset's sizes (see the module docstring for presets and overrides)."""
    return Llama(config(preset, **overrides))


def example_inputs(preset: str | None = None, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's batch: (tokens, targets), both (batch_size, seq_len) int64 token ids."""
    cfg = config(preset, **overrides)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), dtype=torch.long)   # (B, T)
    targets = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), dtype=torch.long)  # (B, T)
    return tokens, targets


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of logits (B, T, V) against targets (B, T)."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
