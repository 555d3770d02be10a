"""A repeated stack traced as 2 and 3 blocks and replicated (autoddl/replicate.py) gives the graph of
the full export node for node, and the same plan; a forward that indexes its blocks by a config
range, or whose blocks differ by their index, is exported whole with one line saying why."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from autoddl.cluster import Cluster
from autoddl.graph import OpGraph, TensorMeta
from autoddl.loader import load_model_file
from autoddl.replicate import expand, find_stack, first_difference
from autoddl.trace import trace
from search.planner import search

ROOT = Path(__file__).resolve().parents[1]


def both(mf, lines: list[str]):
    """(full export, replicated) of a model file's training step."""
    full = trace(mf.model, mf.example_inputs, mf.loss_fn, name=mf.name)
    rep = trace(mf.model, mf.example_inputs, mf.loss_fn, name=mf.name, replicate=True, say=lines.append)
    return full, rep


@pytest.mark.parametrize("model,sizes", [("gpt", dict(preset="tiny", n_layer=6)),
                                         ("llama", dict(preset="tiny", n_layers=5))])
def test_replicated_graph_and_plan_equal_the_full_exports(model, sizes):
    lines: list[str] = []
    full, rep = both(load_model_file(ROOT / "examples" / f"{model}.py", **sizes), lines)
    assert lines == []                                   # replicated, not fallen back
    assert rep.exported is None and full.exported is not None
    assert first_difference(rep, full) == "" and rep.fingerprint() == full.fingerprint()
    assert list(rep.parameters()) == list(full.parameters())
    dgx = Cluster.from_yaml(ROOT / "configs" / "dgx-a100-8.yaml")
    plans = [search(g, dgx, mesh=(2, 4)).found.to_dict() for g in (full, rep)]
    assert json.dumps(plans[0], sort_keys=True) == json.dumps(plans[1], sort_keys=True)


def test_hugging_face_mistral_replicated_equals_full_export():
    transformers = pytest.importorskip("transformers")
    mf = load_model_file(ROOT / "examples" / "hf" / "hf.py", device="cpu", arch="mistral")
    config = mf.model.config.to_dict()
    config.pop("layer_types", None)                     # rebuilt for 5 layers
    config = transformers.MistralConfig(**{**config, "num_hidden_layers": 5})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    mf.model = transformers.MistralForCausalLM(config).train()
    lines: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full, rep = both(mf, lines)
    assert lines == [] and find_stack(mf.model).path == "model.layers"
    assert first_difference(rep, full) == "" and len(rep) == len(full)


def test_one_changed_field_is_a_difference():
    graph = load_model_file(ROOT / "examples" / "gpt.py", preset="tiny", n_layer=2).trace()
    assert first_difference(expand(graph, "transformer.h", 2), graph) == ""
    nodes = list(graph.topo())
    op = next(n for n in nodes if n.is_op and n.outputs)
    changed = dataclasses.replace(op, outputs=(TensorMeta((*op.outputs[0].shape[:-1], 7), op.outputs[0].dtype),))
    other = OpGraph([changed if n is op else n for n in nodes])
    assert "outputs" in first_difference(graph, other)


class Block(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.index = index                              # an int equal to its position: allowed
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x)) * (self.index + 1 if self.scaled else 1)

    scaled = False


class Indexed(nn.Module):
    """Calls its blocks as ``self.blocks[i]`` over a config range: cut to 2 blocks, it fails."""

    def __init__(self, n: int = 5, scaled: bool = False):
        super().__init__()
        self.n = n
        self.blocks = nn.ModuleList(Block(i) for i in range(n))
        for b in self.blocks:
            b.scaled = scaled

    def forward(self, x):
        for i in range(self.n):
            x = self.blocks[i](x)
        return x.sum()


class Looped(Indexed):
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


@pytest.mark.parametrize("model,why", [(Indexed(), "does not export"),
                                       (Looped(scaled=True), "differ from their export")])
def test_falls_back_to_the_full_export_with_one_line(model, why):
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    lines: list[str] = []
    rep = trace(model, (x,), replicate=True, say=lines.append)
    full = trace(model, (x,))
    assert len(lines) == 1 and why in lines[0] and "all 5 blocks" in lines[0]
    assert rep.exported is not None and first_difference(rep, full) == ""


class Stacked(nn.Module):
    """Blocks in an nn.Sequential between two layers."""

    def __init__(self, n: int = 6):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 8), nn.Linear(8, 2)
        self.blocks = nn.Sequential(*(Block(i) for i in range(n)))

    def forward(self, x):
        return self.out(self.blocks(self.inp(x))).sum()


@pytest.mark.parametrize("model,n_blocks", [(Looped(), 5), (Stacked(), 6)])
def test_a_loop_or_a_sequential_is_replicated(model, n_blocks):
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    lines: list[str] = []
    rep = trace(model, (x,), replicate=True, say=lines.append)
    assert lines == [] and rep.exported is None
    assert first_difference(rep, trace(model, (x,))) == ""
    assert len(model.blocks) == n_blocks                 # the caller's model is left whole
