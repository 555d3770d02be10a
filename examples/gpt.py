"""GPT: a nanoGPT-style decoder-only transformer (GPT-2 / GPT-3 shapes).

Token + position embedding, pre-LayerNorm blocks of causal self-attention
(F.scaled_dot_product_attention, is_causal=True) and a 4x GELU MLP, a final
LayerNorm and an lm_head tied to the token embedding. No dropout: the model is
meant for planning (torch.export on the meta device) and small CPU runs.

Presets (PRESETS below; default "gpt2-small"):
  tiny        2 layers, 4 heads, 64 wide, vocab 512, batch 4 x seq 32 (tests)
  gpt2-small  12/12/768, vocab 50304, seq 1024, batch 16    (124.5M params)
  gpt2-xl     48/25/1600, vocab 50304, seq 1024, batch 16   (1.56B params)
  gpt-6b      28/16/4096, vocab 50400, seq 2048, batch 1    (5.9B params; GPT-J-6B's sizes: EleutherAI/gpt-j-6b
              config.json n_layer 28, n_head 16, n_embd 4096, n_positions 2048, vocab_size 50400; this file's
              GPT-2 blocks, learned positions and tied lm_head, not GPT-J's rotary parallel blocks)
  gpt3-175b   96/96/12288, vocab 50304, seq 2048, batch 32  (175B params)

Sizes are set by keyword, then preset (the file reads no environment):
  build_model("tiny", n_layer=1)           keyword wins
  on the command line: --preset NAME --set FIELD=VALUE (one --set per field)

Inputs: (idx, targets), both (B, T) int64; forward(idx, targets=None) returns
logits (B, T, vocab); loss_fn(logits, idx, targets) is the cross entropy.
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
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = 50304     # GPT-2's 50257 padded up to a multiple of 64
    block_size: int = 1024      # longest sequence the position embedding covers
    bias: bool = True           # biases in Linear and LayerNorm, as GPT-2
    batch_size: int = 16        # example_inputs batch
    seq_len: int = 1024         # example_inputs sequence length, <= block_size

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"gpt config: n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.seq_len > self.block_size:
            raise ValueError(f"gpt config: seq_len={self.seq_len} exceeds block_size={self.block_size}; "
                             "raise block_size or lower seq_len")


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=512, block_size=64, batch_size=4, seq_len=32),
    "gpt2-small": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
    "gpt-6b": GPTConfig(n_layer=28, n_head=16, n_embd=4096, vocab_size=50400, block_size=2048, batch_size=1,
                        seq_len=2048),
    "gpt3-175b": GPTConfig(n_layer=96, n_head=96, n_embd=12288, block_size=2048, batch_size=32, seq_len=2048),
}
DEFAULT_PRESET = "gpt2-small"


def config(preset: str | None = None, **overrides) -> GPTConfig:
    """The preset's config with keyword overrides applied (keyword > preset)."""
    name = preset or DEFAULT_PRESET
    if name not in PRESETS:
        raise ValueError(f"gpt: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    base = PRESETS[name]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = set(overrides) - fields
    if unknown:
        raise TypeError(f"gpt: unknown config field(s) {sorted(unknown)}; valid fields: {sorted(fields)}")
    return dataclasses.replace(base, **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        # q, k, v projections at once, laid out head by head as Megatron-LM does
        # ([q_h, k_h, v_h] for each head h), so splitting the output features keeps heads whole
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hs = self.head_dim
        # heads counted from the projection's width, so a tensor-parallel rank reshapes its own heads
        qkv = self.c_attn(x).view(B, T, -1, 3 * hs)                     # (B, T, nh, 3 hs)
        q, k, v = qkv.transpose(1, 2).split(hs, dim=3)                  # 3 x (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)    # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)              # (B, T, C)
        return self.c_proj(y)                                          # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))   # (B, T, C)
        return x


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2
        if not self.lm_head.weight.is_meta:
            self.apply(self._init_weights)
            for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, dtype=torch.long, device=idx.device)   # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)    # (B, T, C)
        for block in self.transformer.h:
            x = block(x)                                             # (B, T, C)
        x = self.transformer.ln_f(x)                                 # (B, T, C)
        return self.lm_head(x)                                       # (B, T, vocab)


def build_model(preset: str | None = None, **overrides) -> GPT:
    """A GPT with the preset's sizes (see the module docstring for presets and overrides)."""
    return GPT(config(preset, **overrides))


def example_inputs(preset: str | None = None, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's batch: (idx, targets), both (batch_size, seq_len) int64 token ids."""
    cfg = config(preset, **overrides)
    idx = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), dtype=torch.long)  # (B, T)
    targets = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len), dtype=torch.long)  # (B, T)
    return idx, targets


def loss_fn(logits: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of logits (B, T, V) against targets (B, T)."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
