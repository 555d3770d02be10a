"""load_model_file / trace_model_file: meta builds, keyword overrides, default loss, clear errors."""

from __future__ import annotations

import pytest
import torch

from autoddl.graph import NodeKind
from autoddl.loader import (ModelFile, ModelFileError, default_loss, load_model_file, parse_overrides,
                            trace_model_file)

MLP = """
import torch
from torch import nn

PRESETS = {"tiny": 4, "wide": 32}

def build_model(preset="tiny", depth=1):
    d = PRESETS[preset]
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(d, d), nn.ReLU()]
    return nn.Sequential(*layers)

def example_inputs(preset="tiny", batch=2):
    return (torch.randn(batch, PRESETS[preset]),)
"""

WITH_LOSS = MLP + """
def loss_fn(output, x):
    return ((output - x) ** 2).mean()
"""


def test_loads_on_meta_without_allocating(write_model):
    mf = load_model_file(write_model(MLP, "mlp.py"))
    assert isinstance(mf, ModelFile)
    assert mf.name == "mlp" and mf.path.endswith("mlp.py")
    assert all(p.is_meta for p in mf.model.parameters())
    assert len(mf.example_inputs) == 1 and mf.example_inputs[0].is_meta
    assert mf.example_inputs[0].shape == (2, 4)
    assert mf.loss_fn is default_loss


def test_real_device_build(write_model):
    mf = load_model_file(write_model(MLP), device="cpu")
    assert all(p.device.type == "cpu" and not p.is_meta for p in mf.model.parameters())
    out = mf.model(*mf.example_inputs)
    assert torch.isfinite(mf.loss_fn(out, *mf.example_inputs))


def test_overrides_go_to_the_functions_that_take_them(write_model):
    path = write_model(MLP)
    mf = load_model_file(path, preset="wide", depth=3, batch=5)   # depth: build only; batch: inputs only
    assert sum(isinstance(m, torch.nn.Linear) for m in mf.model) == 3
    assert mf.model[0].weight.shape == (32, 32)
    assert mf.example_inputs[0].shape == (5, 32)


def test_unknown_override_is_an_error(write_model):
    with pytest.raises(ModelFileError, match=r"neither build_model\(\) nor example_inputs\(\) takes 'dpth'.*"
                                             r"depth"):
        load_model_file(write_model(MLP), dpth=2)


def test_kwargs_functions_take_every_override(write_model):
    path = write_model("""
        import torch
        from torch import nn
        def build_model(**cfg):
            return nn.Linear(cfg.get("d", 3), 2)
        def example_inputs(d=3):
            return (torch.randn(1, d),)
    """)
    mf = load_model_file(path, d=6)
    assert mf.model.weight.shape == (2, 6) and mf.example_inputs[0].shape == (1, 6)


def test_file_loss_fn_is_used_and_traced(write_model):
    mf, graph = trace_model_file(write_model(WITH_LOSS, "ae.py"), depth=2)
    assert mf.loss_fn.__name__ == "loss_fn"
    assert set(graph.parameters()) == {"0.weight", "0.bias", "2.weight", "2.bias"}   # no "model." prefix
    ops = [n.op_name for n in graph.ops()]
    assert ops[-3:] == ["sub", "pow", "mean"]
    (out,) = graph.nodes_of(NodeKind.OUTPUT)
    assert out.input_metas[0].shape == ()                                           # the loss
    assert graph.model_name == "ae"


def test_default_loss_traced_when_file_has_none(write_model):
    _, graph = trace_model_file(write_model(MLP))
    assert graph.ops()[-1].op_name == "mean" and graph.ops()[-1].module_type == "loss_fn"


def test_default_loss_sums_means_of_floating_outputs():
    a, b = torch.ones(2, 3), torch.full((4,), 3.0)
    idx = torch.arange(3)
    assert default_loss((a, {"aux": b, "ids": idx}), a).item() == pytest.approx(1.0 + 3.0)
    assert default_loss(b).item() == pytest.approx(3.0)
    with pytest.raises(ModelFileError, match="no floating-point tensor.*define loss_fn"):
        default_loss(idx)


def test_missing_file():
    with pytest.raises(ModelFileError, match="model file '/no/such/model.py' does not exist"):
        load_model_file("/no/such/model.py")


@pytest.mark.parametrize("missing", ["build_model", "example_inputs"])
def test_missing_function_names_file_function_and_signature(write_model, missing):
    source = MLP.replace(f"def {missing}(", f"def _{missing}(")
    path = write_model(source, "broken.py")
    with pytest.raises(ModelFileError) as info:
        load_model_file(path)
    msg = str(info.value)
    assert str(path) in msg and f"defines no {missing}()" in msg
    assert f"def {missing}(**sizes) ->" in msg


def test_raising_build_model_names_file_function_and_error(write_model):
    path = write_model(MLP, "m.py")
    with pytest.raises(ModelFileError) as info:
        load_model_file(path, preset="huge")
    msg = str(info.value)
    assert str(path) in msg and "build_model(preset='huge') raised KeyError: 'huge'" in msg
    assert isinstance(info.value.__cause__, KeyError)


def test_raising_example_inputs(write_model):
    path = write_model(MLP.replace("return (torch.randn(batch, PRESETS[preset]),)",
                                   "raise RuntimeError('no data today')"))
    with pytest.raises(ModelFileError, match=r"example_inputs\(\) raised RuntimeError: no data today"):
        load_model_file(path)


@pytest.mark.parametrize("returned, described", [
    ("[1, 2]", "a sequence holding int"),
    ("{'x': 3}", "a dict holding 'x': int"),
    ("{}", "an empty dict"),
])
def test_example_inputs_must_be_tensors(write_model, returned, described):
    source = MLP.replace("return (torch.randn(batch, PRESETS[preset]),)", f"return {returned}")
    with pytest.raises(ModelFileError, match=f"example_inputs\\(\\) returned {described}, expected "):
        load_model_file(write_model(source))


def test_single_tensor_input_is_wrapped(write_model):
    source = MLP.replace("return (torch.randn(batch, PRESETS[preset]),)", "return torch.randn(batch, 4)")
    assert len(load_model_file(write_model(source)).example_inputs) == 1


def test_build_model_must_return_a_module(write_model):
    source = MLP.replace("return nn.Sequential(*layers)", "return layers")
    with pytest.raises(ModelFileError, match=r"build_model\(\) returned list, expected an nn.Module"):
        load_model_file(write_model(source))


def test_import_error_names_file(write_model):
    path = write_model("import torch\nraise ImportError('missing dependency foo')\n", "bad.py")
    with pytest.raises(ModelFileError, match=r"bad.py: importing the file failed: ImportError: missing dependency foo"):
        load_model_file(path)


def test_two_files_with_the_same_name_do_not_clash(write_model, tmp_path):
    a = write_model(MLP, "model.py")
    (tmp_path / "other").mkdir()
    b = tmp_path / "other" / "model.py"
    b.write_text(MLP.replace('"tiny": 4', '"tiny": 6'))
    assert load_model_file(a).example_inputs[0].shape == (2, 4)
    assert load_model_file(b).example_inputs[0].shape == (2, 6)


def test_parse_overrides_reads_json_else_strings():
    assert parse_overrides(["n=2", "lr=1e-3", "name=gpt", "flag=true", "layers=[2, 2, 1, 1]", 'quoted="7"',
                            "empty=", "eq=a=b"]) == {
        "n": 2, "lr": 1e-3, "name": "gpt", "flag": True, "layers": [2, 2, 1, 1], "quoted": "7", "empty": "",
        "eq": "a=b"}
    assert parse_overrides(["a=True", "b=False", "c=None"]) == {"a": True, "b": False, "c": None}  # Python spellings
    assert parse_overrides([]) == {} and parse_overrides(None) == {}


@pytest.mark.parametrize("pair", ["depth", "=2", "2x=3", "n layer=2"])
def test_parse_overrides_names_the_bad_pair_and_shows_an_example(pair):
    with pytest.raises(ValueError, match=r"--set .*expected KEY=VALUE.*e\.g\. --set n_layer=2") as info:
        parse_overrides([pair])
    assert repr(pair) in str(info.value)


# -- a model file as a real training setup: keyword inputs and targets only the loss takes ------------

SEQUENTIAL_WITH_TARGETS = """
import torch
from torch import nn
import torch.nn.functional as F

def build_model(d=4, classes=3):
    return nn.Sequential(nn.Linear(d, 8), nn.ReLU(), nn.Linear(8, classes))

def example_inputs(batch=6, d=4):
    return (torch.randn(batch, d),)

def example_targets(batch=6, classes=3):
    return (torch.randint(0, classes, (batch,)),)

def loss_fn(logits, target):
    return F.cross_entropy(logits, target)
"""

KEYWORD_INPUTS = """
import torch
from torch import nn

class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, input_ids, attention_mask=None, scale=None):
        h = self.emb(input_ids) * attention_mask[..., None]           # (B, T, 4)
        return {"logits": self.out(h), "hidden": h}

def build_model():
    return Encoder()

def example_inputs(batch=2, seq=5):
    return {"attention_mask": torch.ones(batch, seq), "input_ids": torch.randint(0, 10, (batch, seq))}

def example_targets(batch=2, seq=5):
    return {"labels": torch.randint(0, 2, (batch, seq))}

def loss_fn(output, labels):
    return torch.nn.functional.cross_entropy(output["logits"].flatten(0, 1), labels.flatten())
"""


def _consumers(graph, name):
    return [n for n in graph.ops() if any(r.node == name for r in n.inputs)]


def test_sequential_with_targets_traces_unwrapped(write_model):
    torch.manual_seed(0)
    mf = load_model_file(write_model(SEQUENTIAL_WITH_TARGETS), device="cpu")
    assert len(mf.forward_args) == 1 and mf.forward_kwargs == {} and len(mf.targets) == 1
    assert [t.shape for t in mf.example_inputs] == [(6, 4), (6,)]          # flat: inputs, then targets
    x, target = mf.example_inputs
    expected = torch.nn.functional.cross_entropy(mf.model(x), target)
    torch.testing.assert_close(mf.step_loss(), expected)
    graph = mf.trace()
    assert [n.target for n in graph.nodes_of(NodeKind.INPUT)] == ["input", "target"]
    # the target reaches only the loss; the input reaches the model's first Linear
    assert {n.module_type for n in _consumers(graph, "target")} == {"loss_fn"}
    assert [n.module_path for n in _consumers(graph, "input")] == ["0"]
    (loss,) = [n for n in graph.ops() if n.op_name == "cross_entropy_loss"]
    assert loss.flops == 5 * 6 * 3 + 6                                     # log-softmax per logit + 1 per target


def test_keyword_inputs_and_keyword_targets(write_model):
    torch.manual_seed(0)
    mf = load_model_file(write_model(KEYWORD_INPUTS), device="cpu")
    assert list(mf.forward_kwargs) == ["attention_mask", "input_ids"] and list(mf.targets) == ["labels"]
    mask, ids, labels = mf.example_inputs
    out = mf.model(input_ids=ids, attention_mask=mask)
    expected = torch.nn.functional.cross_entropy(out["logits"].flatten(0, 1), labels.flatten())
    torch.testing.assert_close(mf.step_loss(), expected)
    graph = mf.trace()
    assert [n.target for n in graph.nodes_of(NodeKind.INPUT)] == ["attention_mask", "input_ids", "labels"]
    assert {n.module_type for n in _consumers(graph, "labels")} == {"loss_fn"}
    assert [n.op_name for n in _consumers(graph, "input_ids")] == ["embedding"]
    assert {p for p in graph.parameters()} == {"emb.weight", "out.weight", "out.bias"}   # no "model." prefix


def test_keyword_inputs_without_targets_go_to_the_loss_by_keyword(write_model):
    source = KEYWORD_INPUTS.split("def example_targets")[0] + """
def loss_fn(output, input_ids, attention_mask):
    return (output["hidden"] * attention_mask[..., None]).sum() + input_ids.float().mean()
"""
    mf = load_model_file(write_model(source), device="cpu")
    mask, ids = mf.example_inputs
    out = mf.model(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(mf.step_loss(), (out["hidden"] * mask[..., None]).sum() + ids.float().mean())
    assert mf.targets == () and [n.target for n in mf.trace().nodes_of(NodeKind.INPUT)] == ["attention_mask", "input_ids"]


def test_step_loss_takes_a_flat_batch_of_the_same_layout(write_model):
    mf = load_model_file(write_model(SEQUENTIAL_WITH_TARGETS), device="cpu")
    halves = [t.chunk(2, dim=0)[0] for t in mf.example_inputs]          # a rank's batch shard
    args, kwargs, targets = mf.example_inputs.split(halves)
    assert args[0].shape == (3, 4) and kwargs == {} and targets[0].shape == (3,)
    expected = torch.nn.functional.cross_entropy(mf.model(halves[0]), halves[1])
    torch.testing.assert_close(mf.step_loss(values=halves), expected)
    with pytest.raises(ValueError, match=r"a step takes 2 tensors \(input_0, target\), got 1"):
        mf.example_inputs.split(halves[:1])


def test_step_inputs_pickle_with_their_layout(write_model):
    import pickle

    mf = load_model_file(write_model(KEYWORD_INPUTS), device="cpu")
    again = pickle.loads(pickle.dumps(mf.example_inputs))
    assert again.kwarg_names == ("attention_mask", "input_ids") and again.target_names == ("labels",)
    assert again.targets_by_keyword and all(torch.equal(a, b) for a, b in zip(again, mf.example_inputs))


def test_target_named_like_a_forward_input_is_an_error(write_model):
    source = KEYWORD_INPUTS.replace('return {"labels": torch.randint', 'return {"input_ids": torch.randint')
    with pytest.raises(ModelFileError, match=r"example_targets\(\) uses the name\(s\) \['input_ids'\] of forward inputs"):
        load_model_file(write_model(source))


def test_example_targets_must_be_tensors(write_model):
    source = SEQUENTIAL_WITH_TARGETS.replace("return (torch.randint(0, classes, (batch,)),)", "return [1, 2]")
    with pytest.raises(ModelFileError, match=r"example_targets\(\) returned a sequence holding int, expected"):
        load_model_file(write_model(source))
