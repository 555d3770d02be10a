"""Megatron's vocabulary-parallel output layer (issue 10, item 4).

- The vocab-parallel cross-entropy (autoddl/ops/loss.py): every signature with the logits split
  on the class dim runs on simulated devices in lockstep (one thread per device, their
  all-reduces exchanged through shared memory) on meshes (2,), (4,) and (2, 2), alone or beside
  a batch split, and must give F.cross_entropy's loss and logits gradient on the whole tensors;
  the collectives each device ran are exactly the ones the rule declares. The same kernel on two
  gloo ranks with torch.distributed's all-reduce.
- It is an inner signature: offered only to a caller that asks for it, and refused to a caller
  that gives no all_reduce.
- GPT-2 (tiny), whose lm_head is tied to the token embedding: on the tp baseline both uses read
  the one vocabulary-split weight, and the lm_head's compute per device is its FLOPs / degree, as
  dp's is (hand-computed: 2 * tokens * n_embd * vocab).
"""

from __future__ import annotations

import itertools
import math
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import autoddl
import autoddl.ops as R
from autoddl.collective_kinds import CollectiveKind
from autoddl.graph import NodeKind
from autoddl.sbp import B, NdSbp, S, Signature
from shard_sim import assemble, coords, make_node, shard
from clusters import CPU_CLUSTER_PATH

ROOT = Path(__file__).resolve().parents[1]
MESHES = [(2,), (4,), (2, 2)]


class LockstepMesh:
    """The devices of a mesh as threads that meet at every all-reduce (each device runs the same
    sequence of collectives, as ranks do): ``comm(coord)`` is that device's ``all_reduce``."""

    def __init__(self, mesh_shape):
        self.mesh = tuple(mesh_shape)
        self.barrier = threading.Barrier(math.prod(self.mesh))
        self.slots: dict[tuple, torch.Tensor] = {}
        self.log: dict[tuple, list[tuple]] = {c: [] for c in coords(self.mesh)}

    def comm(self, coord):
        def all_reduce(t: torch.Tensor, axis: int, op: str) -> torch.Tensor:
            self.log[coord].append((axis, op, t.numel() * t.element_size()))
            self.slots[coord] = t.clone()
            self.barrier.wait()
            group = [c for c in self.slots if all(c[a] == coord[a] for a in range(len(coord)) if a != axis)]
            parts = torch.stack([self.slots[c] for c in sorted(group)])
            out = parts.sum(0) if op == "sum" else parts.amax(0)
            self.barrier.wait()                       # everyone has read before the slots are reused
            return out
        return all_reduce

    def run(self, fn):
        """fn(coord, all_reduce) on every device at once; results by coord (the first error raised)."""
        results, errors = {}, []

        def target(c):
            try:
                results[c] = fn(c, self.comm(c))
            except BaseException as exc:             # noqa: BLE001 -- re-raised below
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(c,)) for c in coords(self.mesh)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        return results


def _inner(node, mesh):
    """The candidate signatures only the inner rules add: those splitting the class dim."""
    plain = set(R.candidate_signatures(node, mesh))
    return [s for s in R.candidate_signatures(node, mesh, inner_collectives=True) if s not in plain]


def _check(node, sig, mesh, logits, target, seed=0):
    """Run ``sig`` on the lockstep mesh; compare the loss and the logits gradient with the
    unsharded op, and the collectives that ran with the rule's declaration."""
    gen = torch.Generator().manual_seed(seed)
    red = int(R.registry.bound_args(node).get("reduction", 1))
    ignore = int(R.registry.bound_args(node).get("ignore_index", -100))
    full_x = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(full_x, target, reduction=["none", "mean", "sum"][red], ignore_index=ignore)
    grad_out = torch.randn(ref.shape, generator=gen, dtype=ref.dtype)
    ref.backward(grad_out)
    xs = shard(logits, sig.inputs[0], mesh, gen)
    ts = shard(target, sig.inputs[1], mesh, gen)
    gs = shard(grad_out, sig.outputs[0], mesh, gen) if grad_out.ndim else None
    lock = LockstepMesh(mesh)
    args, kwargs = R.local_args(node, sig, mesh)

    def device(c, all_reduce):
        kernel = R.local_kernel(node, sig, mesh, c, all_reduce=all_reduce)
        x = xs[c].clone().requires_grad_(True)
        out = kernel(x, ts[c], *args[2:], **kwargs)
        g = gs[c] if gs is not None else grad_out           # the output gradient, laid out as the output
        out.backward(g)
        return out.detach(), x.grad

    results = lock.run(device)
    loss = assemble({c: r[0] for c, r in results.items()}, sig.outputs[0], mesh, "loss", 1e-9, 1e-12)
    grad = assemble({c: r[1] for c, r in results.items()}, sig.inputs[0], mesh, "grad", 1e-9, 1e-12)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, full_x.grad, rtol=1e-9, atol=1e-12)
    declared = [(c.axis, c.reduce_op, c.nbytes) for c in R.inner_collectives(node, sig, mesh)]
    assert declared and all(lock.log[c] == declared for c in coords(mesh)), (declared, lock.log)
    assert all(c.kind is CollectiveKind.ALL_REDUCE for c in R.inner_collectives(node, sig, mesh))


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
def test_vocab_parallel_cross_entropy_matches_the_unsharded_op(mesh, reduction):
    n, v = 8, 16
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(n, v, generator=gen, dtype=torch.float64) * 4
    target = torch.randint(0, v, (n,), generator=gen)
    node = make_node("aten.cross_entropy_loss.default", logits, target, None, reduction)
    sigs = _inner(node, mesh)
    assert sigs, "no class-split signature offered"
    class_axes = {tuple(a for a, s in enumerate(sig.inputs[0]) if s.is_split(1)) for sig in sigs}
    assert (0,) in class_axes and (len(mesh) == 1 or {(1,), (0, 1)} <= class_axes)
    for k, sig in enumerate(sigs):
        _check(node, sig, mesh, logits, target, seed=k)


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=lambda m: "x".join(map(str, m)))
def test_ignored_targets_and_extra_dims(mesh):
    """Targets equal to ignore_index count for nothing (mean over the others, as torch); logits
    (N, C, d) with targets (N, d): the class dim is still dim 1."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 8, 6, generator=gen, dtype=torch.float64) * 3
    target = torch.randint(0, 8, (4, 6), generator=gen)
    target[0, :3] = -100
    target[2, 5] = -100
    node = make_node("aten.cross_entropy_loss.default", logits, target, None, 1)
    class_only = [s for s in _inner(node, mesh) if all(x.is_split(1) or x.is_broadcast() for x in s.inputs[0])]
    assert class_only
    for sig in class_only:            # the batch unsplit: the mean over valid targets is exact
        _check(node, sig, mesh, logits, target)


def test_large_logits_do_not_overflow():
    """The shared row max keeps exp() finite where the raw logits would overflow it."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 8, generator=gen, dtype=torch.float64) * 5 + 1000.0
    logits[:, 5] += 400.0                                   # the max lives on the second device
    target = torch.randint(0, 8, (4,), generator=gen)
    node = make_node("aten.cross_entropy_loss.default", logits, target, None, 1)
    _check(node, Signature.parse("[S(1)], [B] -> [B]"), (2,), logits, target)


def test_vocab_parallel_is_offered_only_to_callers_that_run_inner_collectives():
    logits, target = torch.empty(8, 16), torch.empty(8, dtype=torch.int64)
    node = make_node("aten.cross_entropy_loss.default", logits, target, None, 1)
    sig = Signature.parse("[S(1)], [B] -> [B]")
    assert sig not in R.candidate_signatures(node, (2,))
    assert sig in R.candidate_signatures(node, (2,), inner_collectives=True)
    assert R.inner_collectives(node, sig, (2,)) == [
        R.InnerCollective(CollectiveKind.ALL_REDUCE, 0, 8 * 4, "max", "row max"),
        R.InnerCollective(CollectiveKind.ALL_REDUCE, 0, 2 * 8 * 4, "sum", "sum-exp, target logit")]
    assert R.inner_collectives(node, Signature.parse("[S(0)], [S(0)] -> [P]"), (2,)) == []
    with pytest.raises(ValueError, match="communicates inside its kernel"):
        R.local_kernel(node, sig, (2,), (0,))
    # not offered where the class split would be wrong or unsupported: class weights, label
    # smoothing, probability targets
    for extra in [(torch.empty(16), 1), (None, 1, -100, 0.1)]:
        other = make_node("aten.cross_entropy_loss.default", logits, target, *extra)
        assert not _inner(other, (2,)), extra
    probs = make_node("aten.cross_entropy_loss.default", logits, torch.empty(8, 16), None, 1)
    assert not _inner(probs, (2,))


def _gloo_vocab_parallel(logits, target):
    """On each of 2 gloo ranks: its half of the vocabulary, torch.distributed's all_reduce."""
    import torch.distributed as dist

    from autoddl.ops.loss import vocab_parallel_cross_entropy

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def all_reduce(t, axis, op):
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t

    half = logits.shape[1] // 2
    x = logits[:, rank * half:(rank + 1) * half].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target, rank * half, (0,), all_reduce)
    loss.backward()
    return loss.item(), x.grad


@pytest.mark.distributed
def test_vocab_parallel_cross_entropy_on_two_gloo_ranks():
    from dist_utils import run_ranks

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(16, 32, generator=gen) * 3
    target = torch.randint(0, 32, (16,), generator=gen)
    full = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(full, target)
    ref.backward()
    results = run_ranks(_gloo_vocab_parallel, 2, logits, target, timeout_s=120)
    for loss, _ in results:
        assert loss == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(torch.cat([g for _, g in results], dim=1), full.grad, rtol=1e-5, atol=1e-7)


# -- GPT-2's tied embedding / lm_head on the tp baseline -------------------------------------------

@pytest.fixture(scope="module")
def gpt():
    return autoddl.trace_model_file(ROOT / "examples" / "gpt.py", preset="tiny")[1]


def _schemes(graph, devices):
    from autoddl.cluster import Cluster
    from search.planner import search

    cluster = Cluster.from_yaml(CPU_CLUSTER_PATH).resized(devices)
    return {s.name: s for s in search(graph, cluster, mesh=(devices,), cd_time_limit_s=0.1).schemes}


@pytest.mark.parametrize("devices", [2, 4])
def test_tp_lm_head_is_vocab_parallel_and_costs_its_flops_over_the_degree(gpt, devices):
    """GPT-2 tiny (vocab 512, n_embd 64, batch 4 x 32): the lm_head's forward is
    2 * 128 tokens * 64 * 512 = 8.39 MFLOP. Under tp its tied weight is vocabulary-split for the
    embedding and the lm_head alike, so each device computes 1/degree of it -- the share dp's
    batch split gives it, not the whole lm_head -- and the program's forward task says so."""
    from autoddl.program import lower

    cfg = dict(tokens=4 * 32, n_embd=64, vocab=512)
    head_flops = 2 * cfg["tokens"] * cfg["n_embd"] * cfg["vocab"]
    schemes = _schemes(gpt, devices)
    head = next(n for n in gpt.ops() if n.module_path == "lm_head")
    assert head.flops == head_flops == 8_388_608
    per_device = {}
    for name in ("dp", "tp"):
        plan = schemes[name].plan
        tasks = [t for t in lower(gpt, plan).tasks if t.op == head.name and t.phase == "forward" and not t.collective]
        per_device[name] = tasks[0].local_flops
        if name == "tp":
            wte = plan.param_storage["transformer.wte.weight"]
            assert wte == NdSbp.of(S(0))
            emb = next(n for n in gpt.ops() if n.module_path == "transformer.wte")
            assert plan.signatures[emb.name].inputs[0] == wte                   # vocab-parallel lookup
            assert plan.signatures[head.name].inputs[1] == wte                  # the same split, no move
            assert plan.signatures[head.name].outputs[0] == NdSbp.of(S(2))      # logits split on vocab
            assert not [c for c in lower(gpt, plan).collectives() if c.tensor == "transformer.wte.weight"]
    assert per_device["tp"] == per_device["dp"] == head_flops / devices
    # compute seconds of the lm_head: tp's equal dp's (the same local matmul shape, transposed)
    rows = {name: schemes[name].breakdown.per_op.set_index("op").loc[head.name, "compute_us"]
            for name in ("dp", "tp")}
    assert rows["tp"] == pytest.approx(rows["dp"], rel=1e-9)
