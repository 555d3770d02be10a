"""The example models: presets trace on meta, tiny presets train on CPU, overrides work.

Parameter counts are checked against closed-form formulas written here, and
model pieces (rotary, RMSNorm, grouped-query attention, causal masking)
against plain reference computations.
"""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import autoddl

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODELS = ("gpt", "llama", "mlp", "vgg", "resnet")


def load(name: str):
    """Import examples/<name>.py by path, as the loader and the benchmark do."""
    mod_name = f"autoddl_example_{name}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[mod_name] = module
    return sys.modules[mod_name]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No AUTODDL_* variable from the caller's shell leaks into these tests."""
    import os
    for key in list(os.environ):
        if key.startswith("AUTODDL_"):
            monkeypatch.delenv(key)


# -- parameter-count formulas -------------------------------------------------------------
def gpt_params(c) -> int:
    C = c.n_embd
    per_block = 12 * C * C + 13 * C  # ln_1, c_attn, c_proj, ln_2, c_fc, c_proj (with biases)
    return c.vocab_size * C + c.block_size * C + c.n_layer * per_block + 2 * C  # lm_head tied to wte


def llama_params(c) -> int:
    D, kv = c.dim, c.n_kv_heads * c.head_dim
    per_layer = 2 * D * D + 2 * D * kv + 3 * D * c.ffn_dim + 2 * D  # wq wo, wk wv, w1 w2 w3, 2 norms
    return 2 * c.vocab_size * D + c.n_layers * per_layer + D       # untied embedding and output


def mlp_params(c) -> int:
    return c.n_layers * (c.width * c.width + c.width)


def vgg_params(c) -> int:
    total, c_in = 0, 3
    for item in load("vgg").VGG16_LAYOUT:
        if item != "M":
            c_out = item // c.width_divisor
            total += 9 * c_in * c_out + c_out
            c_in = c_out
    f = c.fc_width
    return total + (c_in * c.pool_size ** 2 + 1) * f + (f + 1) * f + (f + 1) * c.num_classes


def resnet_params(c) -> int:
    w = c.base_width
    total, c_in = 3 * 49 * w + 2 * w, w  # stem conv + bn
    for i, depth in enumerate(c.layers):
        width = w * 2 ** i
        for b in range(depth):
            total += c_in * width + 9 * width * width + width * 4 * width + 2 * (width + width + 4 * width)
            if b == 0:  # shortcut projection: every first block here changes channels
                total += c_in * 4 * width + 2 * 4 * width
            c_in = 4 * width
    return total + c_in * c.num_classes + c.num_classes


FORMULA = {"gpt": gpt_params, "llama": llama_params, "mlp": mlp_params, "vgg": vgg_params,
           "resnet": resnet_params}
ALL_PRESETS = [(m, p) for m in MODELS for p in load(m).PRESETS]


@pytest.mark.parametrize("model,preset", ALL_PRESETS)
def test_every_preset_builds_on_meta_with_formula_param_count(model, preset):
    mod = load(model)
    with torch.device("meta"):
        net = mod.build_model(preset)
        inputs = mod.example_inputs(preset)
    assert all(t.is_meta for t in inputs)
    assert all(p.is_meta for p in net.parameters())
    assert sum(p.numel() for p in net.parameters()) == FORMULA[model](mod.config(preset))


def test_published_parameter_counts():
    assert gpt_params(load("gpt").config("gpt2-small")) == 124_475_904
    assert round(gpt_params(load("gpt").config("gpt3-175b")) / 1e9) == 175
    assert llama_params(load("llama").config("llama3-8b")) == 8_030_261_248
    assert round(llama_params(load("llama").config("llama3-70b")) / 1e9, 1) == 70.6
    assert round(llama_params(load("llama").config("llama3.1-405b")) / 1e9, 1) == 405.9   # "405B" in the paper
    assert vgg_params(load("vgg").config("vgg16")) == 138_357_544     # torchvision vgg16
    assert resnet_params(load("resnet").config("resnet50")) == 25_557_032  # torchvision resnet50


# presets traced with torch.export here; gpt2-xl, gpt-6b, gpt3-175b, llama3-70b and llama3.1-405b only in benchmarks/
TRACED = [(m, p) for m, p in ALL_PRESETS
          if p not in ("gpt2-xl", "gpt-6b", "gpt3-175b", "llama3-70b", "llama3.1-405b")]
OP_COUNTS = {  # (model, preset) -> {op: count} the graph must contain
    ("gpt", "tiny"): {"scaled_dot_product_attention": 2, "embedding": 2},
    ("gpt", "gpt2-small"): {"scaled_dot_product_attention": 12},
    ("llama", "tiny"): {"scaled_dot_product_attention": 2, "rsqrt": 5, "silu": 2},
    ("llama", "llama3-8b"): {"scaled_dot_product_attention": 32, "rsqrt": 65, "silu": 32},
    ("mlp", "tiny"): {"linear": 4, "relu": 3},
    ("mlp", "large"): {"linear": 16, "relu": 15},
    ("vgg", "tiny"): {"conv2d": 13, "max_pool2d": 5, "linear": 3},
    ("vgg", "vgg16"): {"conv2d": 13, "max_pool2d": 5, "linear": 3},
    ("resnet", "tiny"): {"conv2d": 1 + 4 * 3 + 4, "batch_norm": 17},
    ("resnet", "resnet50"): {"conv2d": 1 + 16 * 3 + 4, "batch_norm": 53},
}


@pytest.mark.parametrize("model,preset", TRACED)
def test_preset_traces_on_meta(model, preset):
    mod = load(model)
    with torch.device("meta"):
        net = mod.build_model(preset)
        inputs = mod.example_inputs(preset)
    graph = autoddl.trace(net, inputs, mod.loss_fn, name=f"{model}:{preset}")
    ops = [n.op_name for n in graph.ops()]
    for op, count in OP_COUNTS[(model, preset)].items():
        assert ops.count(op) == count, (op, ops.count(op))
    assert graph.total_flops > 0
    assert graph.parameter_count == FORMULA[model](mod.config(preset))


def test_gpt_tied_embedding_is_one_parameter_in_the_graph():
    gpt = load("gpt")
    with torch.device("meta"):
        net = gpt.build_model("tiny")
        inputs = gpt.example_inputs("tiny")
    assert net.lm_head.weight is net.transformer.wte.weight
    graph = autoddl.trace(net, inputs, gpt.loss_fn)
    vocab_shaped = [n for n in graph.parameters().values() if n.outputs[0].shape == (512, 64)]
    assert len(vocab_shaped) == 1, [n.target for n in vocab_shaped]
    assert graph.parameter_count == gpt_params(gpt.config("tiny"))  # gpt2-small: 124,475,904


@pytest.mark.parametrize("model", MODELS)
def test_tiny_preset_trains_one_step_on_cpu(model):
    mod = load(model)
    torch.manual_seed(0)
    net = mod.build_model("tiny")
    inputs = mod.example_inputs("tiny")
    loss = mod.loss_fn(net(*inputs), *inputs)
    assert loss.ndim == 0 and torch.isfinite(loss)
    if model in ("gpt", "llama"):  # small init: next-token loss starts near ln(vocab)
        assert abs(loss.item() - math.log(mod.config("tiny").vocab_size)) < 0.5
    loss.backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert any(p.grad.abs().sum() > 0 for p in net.parameters())


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_language_models_are_causal(model):
    mod = load(model)
    torch.manual_seed(0)
    net = mod.build_model("tiny")
    idx, targets = mod.example_inputs("tiny")
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % mod.config("tiny").vocab_size
    with torch.no_grad():
        a, b = net(idx), net(changed)
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:], atol=1e-3)


def test_llama_rmsnorm_matches_torch():
    llama = load("llama")
    norm = llama.RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 8, 64)
    expected = F.rms_norm(x, (64,), norm.weight, eps=1e-5)
    assert torch.allclose(norm(x), expected, atol=1e-5)


def test_llama_rotary_is_a_rotation_depending_on_relative_position():
    llama = load("llama")
    cos, sin = llama.rotary_tables(16, 64, 10000.0)  # (64, 16) each
    q, k = torch.randn(16), torch.randn(16)

    def rot(x, pos):
        return llama.apply_rotary(x.view(1, 1, 1, 16), cos[pos:pos + 1], sin[pos:pos + 1]).flatten()

    assert torch.allclose(rot(q, 7).norm(), q.norm(), atol=1e-5)
    assert torch.allclose(rot(q, 0), q)  # position 0: angle 0
    # q_m . k_n depends only on m - n
    assert torch.allclose(rot(q, 10) @ rot(k, 7), rot(q, 33) @ rot(k, 30), atol=1e-4)


def test_llama_grouped_query_attention_matches_reference():
    llama = load("llama")
    torch.manual_seed(0)
    cfg = llama.config("tiny")  # 4 heads share 2 kv heads
    attn = llama.Attention(cfg)
    B, T, nh, nkv, hd = 2, 8, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    x = torch.randn(B, T, cfg.dim)
    cos, sin = llama.rotary_tables(hd, T, cfg.rope_theta)
    q = llama.apply_rotary(attn.wq(x).view(B, T, nh, hd).transpose(1, 2), cos, sin)
    k = llama.apply_rotary(attn.wk(x).view(B, T, nkv, hd).transpose(1, 2), cos, sin)
    v = attn.wv(x).view(B, T, nkv, hd).transpose(1, 2)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)  # head h uses kv h // 2
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, nh * hd)
    assert torch.allclose(attn(x, cos, sin), attn.wo(y), atol=1e-5)


# -- overrides: keyword > preset ----------------------------------------------------------
def test_keyword_override_changes_parameter_count():
    gpt = load("gpt")
    base, one = gpt.config("tiny"), gpt.config("tiny", n_layer=1)
    assert one.n_layer == 1 and one.n_embd == base.n_embd
    n = sum(p.numel() for p in gpt.build_model("tiny", n_layer=1).parameters())
    assert n == gpt_params(base) - (12 * 64 * 64 + 13 * 64)


def test_environment_is_not_read(monkeypatch):
    """The model files are standalone: sizes come from keywords and presets only (the CLI's --preset/--set)."""
    gpt, llama = load("gpt"), load("llama")
    monkeypatch.setenv("AUTODDL_GPT_N_LAYER", "1")
    monkeypatch.setenv("AUTODDL_PRESET", "tiny")
    monkeypatch.setenv("AUTODDL_GPT_PRESET", "gpt2-xl")
    assert gpt.config() == gpt.PRESETS["gpt2-small"] and llama.config() == llama.PRESETS["tiny"]
    assert gpt.config("tiny") == gpt.PRESETS["tiny"]
    assert gpt.config("tiny", n_layer=3).n_layer == 3  # keyword beats preset


def test_set_values_reach_the_config_typed():
    """`--set` pairs, parsed as the CLI does, give each field its type."""
    from autoddl.loader import parse_overrides

    def cfg(name, *pairs):
        kw = parse_overrides(pairs)
        return load(name).config(kw.pop("preset", None), **kw)

    assert cfg("resnet", "preset=tiny", "layers=[2, 1, 1, 1]").layers == (2, 1, 1, 1)
    assert cfg("vgg", "preset=tiny", "dropout=0.25").dropout == 0.25
    assert cfg("gpt", "preset=tiny", "bias=false").bias is False
    assert cfg("llama", "rope_theta=10000").rope_theta == 10000.0
    assert load("gpt").example_inputs("tiny", **parse_overrides(["batch_size=2"]))[0].shape == (2, 32)


def test_bad_settings_name_the_problem():
    gpt = load("gpt")
    with pytest.raises(ValueError, match="unknown preset 'gpt5'.*gpt2-small"):
        gpt.config("gpt5")
    with pytest.raises(TypeError, match=r"unknown config field\(s\) \['n_layers'\]"):
        gpt.config("tiny", n_layers=2)
    with pytest.raises(ValueError, match="n_embd=64 must be divisible by n_head=5"):
        gpt.config("tiny", n_head=5)
    with pytest.raises(ValueError, match="n_heads=4 must be divisible by n_kv_heads=3"):
        load("llama").config("tiny", n_kv_heads=3)
