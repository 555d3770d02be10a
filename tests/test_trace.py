"""trace(): meta-device export into an OpGraph with shapes, FLOPs, parameters, modules, and clear errors."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoddl
from autoddl.graph import NodeKind, OpGraph
from autoddl.trace import TraceError, tied_aliases, to_meta


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + F.gelu(self.fc(self.ln(x)))


class Net(nn.Module):
    def __init__(self, d: int = 8, vocab: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied weights: one parameter, two uses
        self.register_buffer("scale", torch.ones(d))

    def forward(self, idx, targets):
        x = self.emb(idx) * self.scale                  # (B, T, d)
        for block in self.blocks:
            x = block(x)
        pos = torch.arange(idx.shape[1])                # created in forward without device=
        return self.head(x) + pos[None, :, None]        # (B, T, vocab)


def lm_loss(logits, idx, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def inputs(batch: int = 2, seq: int = 5):
    return torch.randint(0, 16, (batch, seq)), torch.randint(0, 16, (batch, seq))


@pytest.fixture(scope="module")
def net() -> Net:
    return Net()


@pytest.fixture(scope="module")
def graph(net) -> OpGraph:
    return autoddl.trace(net, inputs())


@pytest.fixture(scope="module")
def loss_graph(net) -> OpGraph:
    return autoddl.trace(net, inputs(), lm_loss)


def test_caller_model_untouched(net, graph):
    assert all(p.device.type == "cpu" for p in net.parameters())
    before = {k: v.clone() for k, v in net.state_dict().items()}
    autoddl.trace(net, inputs())
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    copy = to_meta(net)
    assert all(p.is_meta for p in copy.parameters()) and copy.head.weight is copy.emb.weight


def test_4gb_parameter_traces_without_allocating():
    with torch.device("meta"):
        big = nn.Sequential(nn.Linear(32768, 32768))
    start = time.perf_counter()
    g = autoddl.trace(big, (torch.empty(8, 32768, device="meta"),))
    assert time.perf_counter() - start < 30
    assert g.parameter_bytes == (32768 * 32768 + 32768) * 4          # 4.3 GB described, none allocated
    (linear,) = g.ops()
    assert linear.flops == 2 * 8 * 32768 * 32768 + 8 * 32768
    assert linear.params == ("0.weight", "0.bias")


def test_placeholders_are_nodes(graph):
    params = graph.parameters()
    assert set(params) == {"emb.weight", "blocks.0.ln.weight", "blocks.0.ln.bias", "blocks.0.fc.weight",
                           "blocks.0.fc.bias", "blocks.1.ln.weight", "blocks.1.ln.bias",
                           "blocks.1.fc.weight", "blocks.1.fc.bias"}       # tied head.weight is emb.weight
    assert params["emb.weight"].outputs[0].shape == (16, 8)
    assert [n.target for n in graph.nodes_of(NodeKind.BUFFER)] == ["scale"]
    assert [n.target for n in graph.nodes_of(NodeKind.INPUT)] == ["idx", "targets"]
    (out,) = graph.nodes_of(NodeKind.OUTPUT)
    assert out.input_metas[0].shape == (2, 5, 16)


def test_every_op_is_annotated(graph):
    for node in graph.ops():
        assert node.target.startswith("aten.") or node.target == "getitem", node
        assert node.outputs and len(node.input_metas) == len(node.inputs), node
        assert node.flops >= 0 and node.bytes_read >= 0 and node.bytes_written >= 0
        assert node.module_type, node
    assert not any("assert" in n.target for n in graph.ops())
    assert graph.total_flops > 0


def test_linear_node_fields(graph):
    fc = [n for n in graph.ops() if n.module_path == "blocks.1.fc"]
    assert [n.target for n in fc] == ["aten.linear.default"]
    (node,) = fc
    assert node.params == ("blocks.1.fc.weight", "blocks.1.fc.bias")
    assert node.module_type == "Linear"
    assert [m.shape for m in node.input_metas] == [(2, 5, 8), (8, 8), (8,)]
    assert node.outputs[0].shape == (2, 5, 8) and node.outputs[0].dtype == "float32"
    assert node.flops == 2 * (2 * 5 * 8) * 8 + 2 * 5 * 8
    assert node.bytes_read == (2 * 5 * 8 + 8 * 8 + 8) * 4 and node.bytes_written == 2 * 5 * 8 * 4


def test_tied_weight_has_two_uses(graph):
    uses = graph.uses(graph.parameters()["emb.weight"].name)
    assert sorted(c.target for c, _, _ in uses) == ["aten.embedding.default", "aten.linear.default"]
    head = next(c for c, _, _ in uses if c.target == "aten.linear.default")
    assert head.params == ("emb.weight",) and head.module_path == "head"
    assert tied_aliases(graph.exported) == {"p_head_weight": "p_emb_weight"}
    assert "p_head_weight" not in graph and graph.parameter_count == 16 * 8 + 2 * (8 + 8 + 8 * 8 + 8)


def test_factory_in_forward_lands_on_meta(graph):
    (arange,) = [n for n in graph.ops() if n.op_name == "arange"]
    assert arange.outputs[0].shape == (5,) and arange.flops == 0


def test_loss_tracing(graph, loss_graph):
    targets = [n.target for n in loss_graph.ops()]
    assert targets[-1] == "aten.cross_entropy_loss.default"
    assert len(loss_graph.ops()) == len(graph.ops()) + 3                       # 2 reshapes + the loss
    assert set(loss_graph.parameters()) == set(graph.parameters())             # no "model." prefix
    assert [n.target for n in loss_graph.nodes_of(NodeKind.INPUT)] == ["idx", "targets"]
    assert [n.target for n in loss_graph.nodes_of(NodeKind.BUFFER)] == ["scale"]
    loss_ops = [n for n in loss_graph.ops() if n.module_type == "loss_fn"]
    assert [n.op_name for n in loss_ops][-1] == "cross_entropy_loss" and len(loss_ops) == 3
    assert all(n.module_path == "" for n in loss_ops)
    top = [n for n in loss_graph.ops() if n.module_type == "Net"]
    assert top and all(n.module_path == "" for n in top)                       # model's own ops, no "model"
    assert {n.module_path for n in loss_graph.ops()} >= {"emb", "blocks.0.ln", "blocks.1.fc", "head"}
    (out,) = loss_graph.nodes_of(NodeKind.OUTPUT)
    assert out.input_metas[0].shape == ()
    assert loss_graph.fingerprint() != graph.fingerprint()


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class ItemSize(nn.Module):
    def forward(self, x):
        n = int(x.max().item())
        return x[:n]


class NonZero(nn.Module):
    def forward(self, x):
        return x.nonzero()


def test_data_dependent_branch_error(capsys):
    with pytest.raises(TraceError) as info:
        autoddl.trace(DataDependent(), (torch.randn(3),))
    msg = str(info.value)
    assert msg.startswith("cannot trace DataDependent")
    assert "data-dependent control flow" in msg
    assert "test_trace.py" in msg and "if x.sum() > 0:" in msg                 # where it is
    assert "torch.where" in msg and "torch.cond" in msg and "shapes or config" in msg  # what to do
    assert info.value.location and "GuardOnDataDependentSymNode" in info.value.details
    assert "def forward" not in capsys.readouterr().err                        # torch's graph dump kept quiet


def test_item_error_names_the_conversion():
    with pytest.raises(TraceError, match=r"\.item\(\)") as info:
        autoddl.trace(ItemSize(), (torch.randn(3),))
    assert "int(x.max().item())" in str(info.value)


def test_data_dependent_shape_error():
    with pytest.raises(TraceError, match="nonzero.*data-dependent shape") as info:
        autoddl.trace(NonZero(), (torch.randn(3),))
    assert "x.nonzero()" in str(info.value) and "masked_fill" in str(info.value)


def test_forward_failure_points_at_user_code():
    with pytest.raises(TraceError) as info:
        autoddl.trace(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 5),))
    msg = str(info.value)
    assert "cannot trace Sequential" in msg and "model(*example_inputs)" in msg
    assert "torch says:" in msg


def test_trace_rejects_non_module():
    with pytest.raises(TypeError, match="needs an nn.Module"):
        autoddl.trace(lambda x: x, (torch.randn(2),))


class PlainTensorAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.mask = torch.ones(3)          # not a registered buffer

    def forward(self, x):
        return self.fc(x) * self.mask


class PinnedDevice(nn.Module):
    def forward(self, x):
        return x + torch.ones(3, device="cpu")


def test_plain_tensor_attribute_becomes_a_constant_node():
    model = PlainTensorAttr()
    g = autoddl.trace(model, (torch.randn(2, 3),))
    (mask,) = g.nodes_of(NodeKind.BUFFER)
    assert mask.target == "mask" and mask.outputs[0].shape == (3,)
    assert not model.mask.is_meta


def test_device_pinned_tensor_error():
    with pytest.raises(TraceError, match="pinned to a real device") as info:
        autoddl.trace(PinnedDevice(), (torch.randn(3),))
    assert 'torch.ones(3, device="cpu")' in str(info.value) and "device=x.device" in str(info.value)


# -- higher-order ops: grad-mode and autocast regions are inlined, others named ----------------------

class Rotary(nn.Module):
    """A rotary-embedding-like module whose table is computed under @torch.no_grad(), from a
    parameter too, so that leaving the region must cut the gradient there."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(1, d + 1, dtype=torch.float32))
        self.w = nn.Parameter(torch.randn(d))

    @torch.no_grad()
    def table(self, x):
        pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)        # (T,)
        freqs = pos[:, None] * self.inv_freq.to(device=x.device, dtype=torch.float32)  # (T, d)
        return freqs.cos() * self.w, freqs.sin()

    def forward(self, x):                                                            # x: (B, T, d)
        cos, sin = self.table(x)
        with torch.autocast("cpu", enabled=False):
            y = x * cos + x.flip(-1) * sin
        return y * self.w


def _run_graph_module(graph: OpGraph, model: nn.Module, *inputs):
    """Run the (inlined) exported graph module on real tensors, the way the executor walks it."""
    ep = graph.exported
    sig = ep.graph_signature
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    values = []
    for spec in sig.input_specs:
        values.append(state[spec.target] if spec.target is not None else inputs[len(values) - len(state)])
    return _LocalRun(ep.graph_module).run(*values)


class _LocalRun(torch.fx.Interpreter):
    """Skips export's metadata assertions and moves meta devices to the CPU, as the executor does."""

    def call_function(self, target, args, kwargs):
        from autoddl.ops import localize_devices

        if getattr(target, "__name__", "").startswith("_assert"):
            return None
        args, kwargs = localize_devices(args, kwargs, "cpu")
        return target(*args, **kwargs)


def test_grad_and_autocast_regions_are_inlined_into_the_graph_module():
    model = Rotary()
    graph = autoddl.trace(model, (torch.randn(2, 3, 4),))
    gm = graph.exported.graph_module
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert not [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert not [name for name, _ in gm.named_children()]
    # OpGraph and graph module agree node for node (the trace drops unused assertions only)
    ops_in_gm = [n.name for n in gm.graph.nodes if n.op == "call_function"
                 and not (n.target.__name__.startswith("_assert") and not n.users)]
    assert ops_in_gm == [n.name for n in graph.ops()]
    cos = [n for n in graph.ops() if n.op_name == "cos"]
    assert len(cos) == 1 and cos[0].outputs[0].shape == (3, 4)
    # the region's ops keep their module path; its outputs are detached where the region ends
    assert {n.module_path for n in graph.ops() if n.op_name in ("cos", "sin", "arange")} == {""}
    assert sum(n.op_name == "detach" for n in graph.ops()) == 2


def test_inlined_no_grad_region_keeps_gradients_out_of_it():
    torch.manual_seed(0)
    model = Rotary()
    x = torch.randn(2, 3, 4)
    graph = autoddl.trace(model, (x,))
    (out,) = _run_graph_module(graph, model, x)
    out.sum().backward()
    graph_grad = model.w.grad.clone()
    model.w.grad = None
    model(x).sum().backward()               # eager: w inside table() gets no gradient
    torch.testing.assert_close(graph_grad, model.w.grad)
    torch.testing.assert_close(out, model(x))


class Autocast(nn.Module):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return x @ x.transpose(-1, -2)


class Cond(nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,))


def test_enabled_autocast_region_is_named_with_its_line():
    with pytest.raises(TraceError) as info:
        autoddl.trace(Autocast(), (torch.randn(2, 3, 3),))
    message = str(info.value)
    assert "torch.autocast region" in message and "bfloat16" in message
    assert "test_trace.py" in info.value.location and "x @ x.transpose" in info.value.location
    assert "what to do: plan in fp32" in message


def test_control_flow_higher_order_op_is_named_with_what_to_do():
    with pytest.raises(TraceError) as info:
        autoddl.trace(Cond(), (torch.randn(3),))
    assert "torch.ops.higher_order.cond" in str(info.value)
    assert "what to do:" in str(info.value) and "torch.cond" in info.value.hint


def test_localize_devices_replaces_meta_devices_everywhere():
    from autoddl.ops import localize_devices

    meta, cpu, cuda = torch.device("meta"), torch.device("cpu"), torch.device("cuda", 1)
    args, kwargs = localize_devices((None, meta, torch.float32, [meta, (meta, 3)], cuda),
                                    {"device": meta, "other": cuda, "dtype": torch.int64}, "cpu")
    assert args == (None, cpu, torch.float32, [cpu, (cpu, 3)], cuda)
    assert isinstance(args[3], list) and isinstance(args[3][1], tuple)
    assert kwargs == {"device": cpu, "other": cuda, "dtype": torch.int64}
    # the positional device of aten.to.device, as HF's rotary `inv_freq.to(device=x.device)` traces
    node = next(n for n in autoddl.trace(Rotary(), (torch.randn(2, 3, 4),)).ops() if n.target == "aten.to.device")
    assert node.args[1] == meta
    local_args, _ = localize_devices(node.args, node.kwargs, "cpu")
    assert local_args[1] == cpu
