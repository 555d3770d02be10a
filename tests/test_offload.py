"""Spilling to host memory (issue 13 items 1-2): the copy tasks of the step program, their price and
overlap, memory on both sides, and ``offload auto`` choosing a level only when nothing fits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dist_utils import block_stack_source

from autoddl.cli import main
from autoddl.cluster import Cluster, ClusterConfigError, LinkSpec
from autoddl.loader import load_model_file
from autoddl.offload import spill_groups
from autoddl.program import block_of, lower
from autoddl.training import Training
from costmodel.breakdown import plan_cost
from costmodel.simulate import simulate
from search.planner import search
from search.problem import NoFeasiblePlanError
from clusters import CPU_CLUSTER_PATH

ROOT = Path(__file__).resolve().parents[1]
DGX = ROOT / "configs" / "dgx-a100-8.yaml"
D = 256                      # width of every Linear
N_BLOCK = D * D + D          # parameters of one block (Linear(D, D))

def model(write_model, n: int, root: bool = True, name: str = "blocks.py", batch: int = 8, **kw):
    return load_model_file(write_model(block_stack_source(D, n, rows=batch, attr="blocks", root=root), name), **kw)


def one_device() -> Cluster:
    return Cluster.from_yaml(DGX).resized(1)


def plan_at(graph, cluster, level: str, precision: str = "fp32"):
    found = search(graph, cluster, training=Training(param_dtype=precision), cd_time_limit_s=0.05).found
    return dataclasses.replace(found, training=dataclasses.replace(found.training, offload=level))


# -- the copy tasks ------------------------------------------------------------------------------

@pytest.mark.parametrize("precision,size", [("fp32", 4), ("bf16", 2)])
def test_copy_tasks_bytes_and_count_match_the_hand_formulas(write_model, precision, size):
    """3 blocks + a root Linear, one device. params: each block copied in for forward (3), again for
    backward but for the last, still on the device (2), its gradients out (3); then the root's
    gradients out and its updated parameters in. optimizer: all gradients out, all parameters in."""
    mf = model(write_model, 3)
    graph = mf.trace(Training(param_dtype=precision).param_dtype)
    cluster = one_device()
    copies = [(t.copy, t.nbytes, t.tensor) for t in lower(graph, plan_at(graph, cluster, "params", precision)).copies()]
    block = N_BLOCK * size
    assert [c for c in copies if c[2].endswith("forward")] == [("h2d", block, f"h2d blocks.{i} forward")
                                                               for i in range(3)]
    assert [c for c in copies if c[2].endswith("backward")] == [("h2d", block, f"h2d blocks.{i} backward")
                                                                for i in (1, 0)]
    assert [c for c in copies if c[2].endswith("gradients") and "blocks" in c[2]] == [
        ("d2h", block, f"d2h blocks.{i} gradients") for i in (2, 1, 0)]
    assert copies[-2:] == [("d2h", N_BLOCK * size, "d2h gradients"), ("h2d", N_BLOCK * size, "h2d parameters")]
    assert len(copies) == 3 + 2 + 3 + 2
    optimizer = [(t.copy, t.nbytes) for t in lower(graph, plan_at(graph, cluster, "optimizer", precision)).copies()]
    assert optimizer == [("d2h", 4 * N_BLOCK * size), ("h2d", 4 * N_BLOCK * size)]
    assert lower(graph, plan_at(graph, cluster, "none", precision)).copies() == []


def test_optimizer_runs_on_the_host_at_its_memory_bandwidth(write_model):
    """The optimizer task moves to the host stream, priced as the same memory-bound pass at the host's
    bandwidth (one device: the node's whole bandwidth): torch's foreach AdamW on fp32 moves
    6 x 4N + 56N bytes (costmodel.compute.optimizer_bytes)."""
    mf = model(write_model, 3)
    graph = mf.trace("float32")
    cluster = one_device()
    plan = plan_at(graph, cluster, "optimizer")
    timeline = simulate(lower(graph, plan), graph, plan, cluster)
    (opt,) = [t for t in timeline.tasks if t.task.phase == "optimizer"]
    numel = 4 * N_BLOCK
    assert opt.task.stream == "host"
    assert opt.duration_s == pytest.approx((24 * numel + 56 * numel) / (409.6e9 / 1))
    link = cluster.host_link
    for t in timeline.tasks:
        if t.task.is_copy:
            assert t.duration_s == pytest.approx(link.latency_us * 1e-6 + t.task.nbytes / (link.bandwidth_gbps * 1e9))


# -- the simulated step against the closed form --------------------------------------------------------

@pytest.mark.parametrize("bandwidth_gbps", [1000.0, 0.05])      # compute-bound, copy-bound
def test_params_offload_step_is_per_group_max_of_compute_and_copy_plus_the_first_copy(write_model,
                                                                                      bandwidth_gbps):
    """Blocks only, one device: forward ends at c + sum_{i<n-1} max(F_i, c) + F_{n-1} (group i+1's copy
    overlaps group i's compute; the first copy is exposed); backward, from its first block on,
    takes sum_{i>0} max(B_i, c) + B_0 (the last block stays on the device)."""
    n = 4
    mf = model(write_model, n, root=False)
    graph = mf.trace("float32")
    cluster = dataclasses.replace(one_device(), host_link=LinkSpec(bandwidth_gbps, 10.0))
    plan = plan_at(graph, cluster, "params")
    timeline = simulate(lower(graph, plan), graph, plan, cluster)
    c = 10e-6 + N_BLOCK * 4 / (bandwidth_gbps * 1e9)
    compute = [t for t in timeline.tasks if t.task.stream == "compute" and block_of(graph[t.task.op]) != "root"]
    f = [sum(t.duration_s for t in compute if t.task.phase == "forward" and block_of(graph[t.task.op]) ==
             f"blocks.{i}") for i in range(n)]
    b = [sum(t.duration_s for t in compute if t.task.phase == "backward" and block_of(graph[t.task.op]) ==
             f"blocks.{i}") for i in range(n)]
    forward_end = max(t.end_s for t in compute if t.task.phase == "forward")
    assert forward_end == pytest.approx(c + sum(max(fi, c) for fi in f[:-1]) + f[-1], rel=1e-9)
    backward = [t for t in compute if t.task.phase == "backward"]
    start = min(t.start_s for t in backward)
    assert max(t.end_s for t in backward) - start == pytest.approx(sum(max(bi, c) for bi in b[1:]) + b[0],
                                                                   rel=1e-9)
    assert (c > max(f + b)) == (bandwidth_gbps < 1)          # the two regimes are what they claim


# -- memory ---------------------------------------------------------------------------------------------

def test_memory_with_and_without_offload_matches_hand_figures(write_model):
    """bf16, root Linear + 3 blocks (N = 4 x N_BLOCK). none: fp32 masters, gradients and AdamW states
    on the device. optimizer: the device keeps bf16 working copies and bf16 gradients; the host the
    masters, fp32 gradients and states. params: the device keeps the root's and two blocks' working
    copies and gradients; the host also the blocks' bf16 working copies."""
    mf = model(write_model, 3)
    graph = mf.trace("bfloat16")
    cluster = one_device()
    n = 4 * N_BLOCK
    mem = {level: plan_cost(graph, plan_at(graph, cluster, level, "bf16"), cluster).memory
           for level in ("none", "optimizer", "params")}
    assert (mem["none"]["parameters"], mem["none"]["gradients"], mem["none"]["optimizer_states"],
            mem["none"]["working_params"], mem["none"].get("host", 0)) == (4 * n, 4 * n, 8 * n, 2 * n, 0)
    assert (mem["optimizer"]["parameters"], mem["optimizer"]["gradients"], mem["optimizer"]["optimizer_states"],
            mem["optimizer"]["working_params"], mem["optimizer"]["host"]) == (0, 2 * n, 0, 2 * n, 16 * n)
    p = mem["params"]
    assert (p["parameters"], p["gradients"], p["working_params"], p["spilled_params"], p["spilled_grads"],
            p["host"]) == (0, 2 * N_BLOCK, 2 * N_BLOCK, 4 * N_BLOCK, 4 * N_BLOCK, 16 * n + 2 * 3 * N_BLOCK)
    for level in mem:       # the same activations on every level: only parameter state moves
        assert mem[level]["activations"] == mem["none"]["activations"]
        assert mem[level]["total"] == sum(v for k, v in mem[level].items() if k not in ("total", "host"))


def test_a_plan_whose_host_memory_exceeds_the_hosts_does_not_fit(write_model):
    mf = model(write_model, 3)
    graph = mf.trace("float32")
    roomy, small = one_device(), dataclasses.replace(one_device(), host_memory_gb=16 * 4 * N_BLOCK / 1e9 * 0.99)
    plan = plan_at(graph, roomy, "optimizer")
    assert plan_cost(graph, plan, roomy).fits_memory
    bd = plan_cost(graph, plan, small)
    assert bd.host_memory_bytes == 16 * 4 * N_BLOCK and bd.host_limit_bytes < bd.host_memory_bytes
    assert not bd.fits_memory


# -- offload auto ------------------------------------------------------------------------------------

def test_auto_offloads_only_when_nothing_fits_and_takes_the_first_level_that_does(write_model):
    """Root + 6 blocks on one device: with room, auto keeps everything on the device; with a limit
    between each level's memory it takes optimizer, then params; between params' and activations',
    activations (params and activations are one tier: the faster that fits); below that, nothing
    fits."""
    mf = model(write_model, 6)
    graph = mf.trace("float32")
    cluster = one_device()
    need = {level: plan_cost(graph, plan_at(graph, cluster, level), cluster).memory_bytes_per_device
            for level in ("none", "optimizer", "params", "activations")}
    assert need["none"] > need["optimizer"] > need["params"] > need["activations"]

    def chosen(limit_bytes: float) -> str:
        out = search(graph, cluster, training=Training(offload="auto"), memory_gb=limit_bytes / 1e9,
                     cd_time_limit_s=0.05)
        assert out.found_breakdown.memory_bytes_per_device <= limit_bytes
        return out.found.training.offload

    assert chosen(need["none"] * 1.01) == "none"
    assert chosen((need["none"] + need["optimizer"]) / 2) == "optimizer"
    assert chosen((need["optimizer"] + need["params"]) / 2) == "params"
    assert chosen((need["params"] + need["activations"]) / 2) == "activations"
    with pytest.raises(NoFeasiblePlanError):
        chosen(need["activations"] * 0.99)


def test_auto_plan_records_the_slowdown_against_the_plan_without_offload(write_model):
    mf = model(write_model, 6)
    graph = mf.trace("float32")
    cluster = one_device()
    limit = plan_cost(graph, plan_at(graph, cluster, "optimizer"), cluster).memory_bytes_per_device * 1.01
    out = search(graph, cluster, training=Training(offload="auto"), memory_gb=limit / 1e9, cd_time_limit_s=0.05)
    found = next(s for s in out.schemes if s.name == "found")
    plain = plan_cost(graph, plan_at(graph, cluster, "none"), cluster)
    assert found.no_offload_s == pytest.approx(plain.step_time_s) and not found.no_offload_fits
    assert found.step_time_s > found.no_offload_s
    assert any(n.startswith("offload optimizer (nothing fits") and f"{found.step_time_s / found.no_offload_s:.2f}x"
               in n for n in out.found.notes)


def test_auto_with_recompute_auto_recomputes_the_fewest_blocks_after_spilling(write_model):
    """With recompute auto and a limit that params offload meets only with some blocks recomputed, an
    offload params plan recomputes some blocks, not all, and fits; offload auto takes the faster of
    that and spilling activations too (one tier), which fits as well."""
    mf = model(write_model, 6)
    graph = mf.trace("float32")
    cluster = one_device()
    spilled = plan_at(graph, cluster, "params")
    plain = plan_cost(graph, spilled, cluster).memory_bytes_per_device
    full = dataclasses.replace(spilled, training=dataclasses.replace(spilled.training, recompute="full"))
    least = plan_cost(graph, full, cluster).memory_bytes_per_device
    assert least < plain
    limit = (least + plain) / 2
    out = search(graph, cluster, training=Training(offload="params", recompute="auto"), memory_gb=limit / 1e9,
                 cd_time_limit_s=0.05)
    training = out.found.training
    recomputed = [b for b, p in training.recompute_blocks.items() if p != "none"]
    assert training.offload == "params" and 0 < len(recomputed) <= 2 * 6
    assert out.found_breakdown.memory_bytes_per_device <= limit
    assert not all(p == "full" for p in training.recompute_blocks.values())
    auto = search(graph, cluster, training=Training(offload="auto", recompute="auto"), memory_gb=limit / 1e9,
                  cd_time_limit_s=0.05)
    assert auto.found.training.offload in ("params", "activations")
    assert auto.found_breakdown.memory_bytes_per_device <= limit
    assert auto.found_breakdown.step_time_s <= out.found_breakdown.step_time_s


def with_blocks(plan, k: int):
    blocks = tuple(f"blocks.{i}" for i in range(k))
    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, spill_blocks=blocks))


def test_spilling_some_blocks_copies_and_counts_only_those(write_model):
    """fp32, root + 6 blocks, the first 3 spilled: 3 copies in for forward, 2 for backward (the third
    stays), 3 gradient copies out; the other 3 blocks are kept like the root (their fp32 parameters
    and gradients on the device, their gradients out and parameters back around the optimizer)."""
    mf = model(write_model, 6)
    graph = mf.trace("float32")
    cluster = one_device()
    plan = with_blocks(plan_at(graph, cluster, "params"), 3)
    copies = [(t.copy, t.tensor) for t in lower(graph, plan).copies()]
    assert [t for c, t in copies if c == "h2d" and "blocks" in t] == [
        "h2d blocks.0 forward", "h2d blocks.1 forward", "h2d blocks.2 forward",
        "h2d blocks.1 backward", "h2d blocks.0 backward"]
    assert [t for c, t in copies if c == "d2h"] == ["d2h blocks.2 gradients", "d2h blocks.1 gradients",
                                                    "d2h blocks.0 gradients", "d2h gradients"]
    nbytes = {t.tensor: t.nbytes for t in lower(graph, plan).copies()}
    assert nbytes["d2h gradients"] == nbytes["h2d parameters"] == 4 * 4 * N_BLOCK      # root + 3 kept blocks
    mem = plan_cost(graph, plan, cluster).memory
    assert (mem["parameters"], mem["gradients"], mem["spilled_params"]) == (16 * N_BLOCK, 16 * N_BLOCK, 8 * N_BLOCK)
    with pytest.raises(ValueError, match=r"spill_blocks names \['blocks.9'\], which are no repeated block"):
        lower(graph, dataclasses.replace(plan, training=dataclasses.replace(plan.training, spill_blocks=("blocks.9",))))


def test_auto_spills_the_fewest_blocks_that_fit(write_model):
    """Memory falls block by block from the third spilled block on (the first two only trade kept
    parameters for the two in flight); with the limit at 3 blocks' memory, auto spills blocks 0-2."""
    mf = model(write_model, 6)
    graph = mf.trace("float32")
    cluster = one_device()
    spilled = plan_at(graph, cluster, "params")
    need = [plan_cost(graph, with_blocks(spilled, k), cluster).memory_bytes_per_device for k in range(1, 7)]
    assert need[0] == need[1] > need[2] > need[3] > need[4] > need[5]
    out = search(graph, cluster, training=Training(offload="auto"), memory_gb=need[2] / 1e9, cd_time_limit_s=0.05)
    assert out.found.training.offload == "params"
    assert out.found.training.spill_blocks == ("blocks.0", "blocks.1", "blocks.2")
    assert out.found_breakdown.memory_bytes_per_device == need[2]
    assert any("3 blocks spilled: blocks.0 .. blocks.2" in n for n in out.found.notes)


# -- refusals and the command line ---------------------------------------------------------------------

def test_offload_needs_the_host_fields_and_params_refuses_sharded_storage(write_model):
    mf = model(write_model, 3)
    graph = mf.trace("float32")
    old = dataclasses.replace(Cluster.from_yaml(ROOT / "configs" / "two-hosts.yaml").resized(1), host_link=None,
                              host_memory_gb=None, host_memory_bandwidth_gbps=None)     # a file from before them
    with pytest.raises(ClusterConfigError, match="host_link: missing; --offload optimizer needs it"):
        search(graph, old, training=Training(offload="optimizer"), cd_time_limit_s=0.05)
    two = Cluster.from_yaml(DGX).resized(2)
    zero3 = next(s for s in search(graph, two, cd_time_limit_s=0.05, mesh=(2,)).schemes if s.name == "zero3").plan
    spilled = dataclasses.replace(zero3, training=dataclasses.replace(zero3.training, offload="params"))
    with pytest.raises(ValueError, match=r"offload params copies each spilled parameter whole .* blocks\.0\.fc\.weight "
                                         r"is stored \[S\(0\)\]"):
        lower(graph, spilled)
    with pytest.raises(ValueError, match="training.offload 'disk' is not an offload level"):
        Training(offload="disk")


def test_cli_offload_auto_shows_the_level_and_the_slowdown(write_model, capsys, tmp_path):
    path = write_model(block_stack_source(D, 6, rows=8, attr="blocks", root=True))
    mf = load_model_file(path)
    graph = mf.trace("float32")
    cluster = one_device()
    limit = plan_cost(graph, plan_at(graph, cluster, "optimizer"), cluster).memory_bytes_per_device * 1.01
    assert main(["plan", str(path), "--cluster", str(DGX), "--devices", "1", "--offload", "auto",
                 "--memory-gb", f"{limit / 1e9:.9f}", "--memory-breakdown", "--out", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("scheme "))
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[1:2] == ["1"]}
    columns = [c.strip() for c in header.split("  ") if c.strip()]
    assert columns[6:11] == ["optimizer ms", "offload", "copies ms", "vs no offload", "host GB"]
    assert "dp" in rows and rows["found"][7] == "optimizer" and all(r[7] == "optimizer" for r in rows.values())
    assert "(does not fit without)" in out and "note: offload optimizer (nothing fits" in out
    from autoddl.plan import Plan
    assert Plan.load(tmp_path / "p.json").training.offload == "optimizer"


# -- the executor runs the copies --------------------------------------------------------------------

def _run_offloaded(mf, graph, plan):
    """On every rank: run_check (2 AdamW steps against one process), then one step whose copies are
    kept."""
    from executor.runtime import DistributedModel, build_optimizer, init_mesh, run_check, train_step

    mesh = init_mesh(plan)
    errors = run_check(mf.model, mf.example_inputs, mf.loss_fn, graph, plan, mesh, optimizer="adamw", steps=2)
    dmodel = DistributedModel(mf.model, graph, plan, mesh)
    train_step(dmodel, mf.example_inputs, build_optimizer("adamw", dmodel.parameters()))
    return errors, [(r.copy, r.nbytes, r.tensor) for r in dmodel.host_copies.records]


@pytest.mark.distributed
@pytest.mark.parametrize("level,ranks,precision", [("params", 2, "fp32"), ("params", 1, "bf16"),
                                                   ("activations", 2, "fp32"), ("optimizer", 2, "fp32")])
def test_executor_runs_the_programs_copies_and_matches_one_process(write_model, level, ranks, precision):
    """An offloaded plan (data parallel on 2 ranks; one rank in bf16) runs as its program says:
    ``params``: each block's parameters live in host buffers, copied in and out at the program's copy
    tasks; ``activations``: also what autograd saves in blocks 0 and 1 (block 2's stay), out after
    their forward and back before their backward; every level: the root's (all, under ``optimizer``)
    masters live on the host, their gradients copied out and updated working copies back around
    the optimizer there. Loss, gradients and parameters after 2 steps match one process, and the
    copies that ran are the program's, bytes included (a Linear+ReLU block saves its input and its
    ReLU output, as the rule counts its Linear and ReLU outputs)."""
    from autoddl.precision import check_rtol
    from dist_utils import run_ranks

    torch.manual_seed(0)
    mf = model(write_model, 3, device="cpu")
    training = Training(param_dtype=precision)
    graph = mf.trace(training.param_dtype)
    cluster = Cluster.from_yaml(DGX).resized(ranks)
    dp = next(s for s in search(graph, cluster, training=training, mesh=(ranks,), cd_time_limit_s=0.05).schemes
              if s.name == "dp").plan
    plan = dataclasses.replace(dp, training=dataclasses.replace(dp.training, offload=level))
    program = lower(graph, plan)
    expected = sorted((t.copy, t.nbytes, t.tensor) for t in program.copies())
    size = {"fp32": 4, "bf16": 2}[precision]
    act = 2 * (8 // ranks) * D * size
    assert len(expected) == {"params": 3 + 2 + 3 + 2, "activations": 3 + 2 + 3 + 2 + 2 + 2, "optimizer": 2}[level]
    assert [r for r in expected if r[2].endswith("activations")] == (
        [("d2h", act, "d2h blocks.0 activations"), ("d2h", act, "d2h blocks.1 activations"),
         ("h2d", act, "h2d blocks.0 activations"), ("h2d", act, "h2d blocks.1 activations")]
        if level == "activations" else [])
    for rank, (errors, ran) in enumerate(run_ranks(_run_offloaded, ranks, mf, graph, plan, timeout_s=120)):
        bad = {k: v for k, v in errors.items() if not v <= check_rtol(training.param_dtype)}
        assert not bad, f"rank {rank}: relative errors above the bound: {bad}"
        assert len(errors) == 1 + 2 * 8                 # loss, 8 gradients, 8 parameters
        assert sorted(ran) == expected


def test_run_summary_audits_the_copies_against_the_programs(write_model, capsys):
    """``autoddl run``'s summary compares the copies one step ran with the program's and counts a
    difference; saved activations' copies are matched by label, their bytes reported beside."""
    from autoddl.cli.run import _copies_audit

    mf = model(write_model, 3)
    graph = mf.trace("float32")
    program = lower(graph, plan_at(graph, one_device(), "params"))
    ran = [[t.copy, t.nbytes, t.tensor] for t in program.copies()]
    assert _copies_audit(program.copies(), ran) == 0
    assert "10 ran" in capsys.readouterr().out
    assert _copies_audit(program.copies(), ran[:-1]) == 1
    out = capsys.readouterr().out
    assert "9 ran" in out and "the program's 10" in out and "DIFFER" in out
    program = lower(graph, plan_at(graph, one_device(), "activations"))
    ran = [[t.copy, t.nbytes * (2 if t.tensor.endswith("activations") else 1), t.tensor] for t in program.copies()]
    a = 2 * 8 * D * 4
    assert _copies_audit(program.copies(), ran) == 0
    assert f"saved activations {8 * a / 1e6:.3f} MB ran, {4 * a / 1e6:.3f} MB by the program's rule" \
        in capsys.readouterr().out
    assert _copies_audit(program.copies(), [r for r in ran if r[2] != "h2d blocks.0 activations"]) == 1


def test_gradients_leave_after_their_buckets_all_reduce_over_both_axes(write_model):
    """Data parallel on both axes of a 2x2 mesh: a bucket is all-reduced once over axes 0 and 1
    flattened; a spilled block's gradients are copied out only after that, for every bucket holding
    one of them."""
    mf = model(write_model, 6)
    graph = mf.trace("float32")
    cluster = Cluster.from_yaml(CPU_CLUSTER_PATH)
    dp = next(s for s in search(graph, cluster, mesh=(2, 2), cd_time_limit_s=0.05).schemes if s.name == "dp").plan
    program = lower(graph, dataclasses.replace(dp, training=dataclasses.replace(dp.training, offload="params")))
    assert program.buckets and all(b.axis == (0, 1) for b in program.buckets)
    tasks = {t.id: t for t in program.tasks}
    bucket_of = {program.param_uses[i].fqn: b.index for b in program.buckets for i in b.uses}
    outs = [t for t in program.copies() if t.copy == "d2h" and "blocks" in t.tensor]
    assert len(outs) == 6
    for t in outs:
        group = t.tensor.split()[1]
        buckets = {bucket_of[u.fqn] for u in program.param_uses if u.fqn.startswith(group + ".")}
        waited = {(tasks[d].tensor, tasks[d].axis) for d in t.deps if tasks[d].phase == "grad_sync"}
        assert waited >= {(f"bucket{b}", (0, 1)) for b in buckets}, t.tensor


# -- spilling saved activations (offload activations) ----------------------------------------------------

GPT = ROOT / "examples" / "gpt.py"


def tiny_gpt(n_layer: int = 3, **kw):
    """The tiny gpt (examples/gpt.py: B 4, T 32, C 64, 4 heads) with ``n_layer`` blocks."""
    return load_model_file(GPT, preset="tiny", n_layer=n_layer, **kw)


def gpt_block_saved_bytes(b: int = 4, t: int = 32, c: int = 64, size: int = 4) -> int:
    """One gpt block's saved activations by autoddl/activations.py's rule, per token: ln_1 (C), c_attn (3C),
    attention (C), its contiguous copy (C), c_proj (C), add (C), ln_2 (C), c_fc (4C), gelu (4C),
    c_proj (C), add (C) = 19C (views, and outputs no op reads, save nothing)."""
    return 19 * c * b * t * size


@pytest.mark.parametrize("micro", [1, 2])
def test_activation_copies_bytes_and_count_match_the_hand_formula(micro):
    """3 gpt blocks, one device: per micro-step, blocks 0 and 1 send their saved activations out after
    their forward and take them back before their backward (block 1 first, prefetched while block 2's
    backward runs); block 2's stay. Parameters are copied as under ``params``."""
    mf = tiny_gpt(3)
    graph = mf.trace("float32")
    plan = plan_at(graph, one_device(), "activations")
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, micro_batches=micro))
    program = lower(graph, plan)
    acts = [(t.copy, t.nbytes, t.tensor, t.micro_step) for t in program.copies() if t.tensor.endswith("activations")]
    a = gpt_block_saved_bytes()
    assert acts == [row for m in range(micro) for row in [
        ("d2h", a, "d2h transformer.h.0 activations", m), ("d2h", a, "d2h transformer.h.1 activations", m),
        ("h2d", a, "h2d transformer.h.1 activations", m), ("h2d", a, "h2d transformer.h.0 activations", m)]]
    params = [(t.copy, t.tensor) for t in program.copies() if not t.tensor.endswith("activations")]
    plain = dataclasses.replace(plan, training=dataclasses.replace(plan.training, offload="params"))
    assert params == [(t.copy, t.tensor) for t in lower(graph, plain).copies()]
    tasks = {t.id: t for t in program.tasks}
    for t in program.copies():           # each copy in waits for its copy out
        if t.tensor.endswith("activations") and t.copy == "h2d":
            assert any(tasks[d].tensor == t.tensor.replace("h2d", "d2h") for d in t.deps)


def test_activation_spilling_memory_matches_hand_figures():
    """fp32, 3 gpt blocks of A saved bytes each: the device keeps the rest of the activations and two
    blocks' at once (the one computing and the one in flight); the host the two that leave."""
    mf = tiny_gpt(3)
    graph = mf.trace("float32")
    cluster = one_device()
    mem = {level: plan_cost(graph, plan_at(graph, cluster, level), cluster).memory for level in ("params", "activations")}
    a = gpt_block_saved_bytes()
    p, s = mem["params"], mem["activations"]
    assert (s["activations"], s["spilled_acts"], s["host"]) == (p["activations"] - 3 * a, 2 * a, p["host"] + 2 * a)
    assert s["total"] == p["total"] - a
    assert all(s[k] == p[k] for k in ("parameters", "gradients", "spilled_params", "spilled_grads"))


def test_activation_spilling_step_in_the_copy_bound_regime_is_the_closed_form(write_model):
    """n Linear+ReLU blocks on a batch of 4096 (saved activations a copy each, parameters c), a slow
    host link: the copies out run back to back from the end of block 0's forward; the copies back
    (activations then parameters, per block below the last) run back to back from the last copy
    out; then block 0's weight gradient, its gradients out and the host optimizer:
    c + F_0 + (n-1) a + (n-1)(a + c) + B_lin0 + c + T_opt."""
    from costmodel.host import host_copy_time_s

    n = 4
    mf = model(write_model, n, root=False, batch=4096)
    graph = mf.trace("float32")
    cluster = dataclasses.replace(one_device(), host_link=LinkSpec(0.05, 10.0))
    plan = plan_at(graph, cluster, "activations")
    timeline = simulate(lower(graph, plan), graph, plan, cluster)
    a, c = host_copy_time_s(2 * 4096 * D * 4, cluster), host_copy_time_s(N_BLOCK * 4, cluster)
    compute = [t for t in timeline.tasks if t.task.stream == "compute"]
    f0 = sum(t.duration_s for t in compute if t.task.phase == "forward" and block_of(graph[t.task.op]) == "blocks.0")
    (b_lin0,) = [t.duration_s for t in compute if t.task.phase == "backward" and t.task.op == "linear"]
    (opt,) = [t.duration_s for t in timeline.tasks if t.task.phase == "optimizer"]
    assert a > 10 * (c + sum(t.duration_s for t in compute))        # copy-bound
    step = max(t.end_s for t in timeline.tasks)
    assert step == pytest.approx(c + f0 + (n - 1) * a + (n - 1) * (a + c) + b_lin0 + c + opt, rel=1e-9)
    assert timeline.busy_s(phase="offload") == pytest.approx(2 * (n - 1) * a + (n + (n - 1) + n) * c, rel=1e-9)


def test_recompute_levels_are_counted_with_the_activations_spilled():
    """``recompute auto``'s per-level memory (search.planner.memory_at_levels) under offload
    activations is the full count (only the blocks that stay keep their activations on the device),
    not the activations rule's sum."""
    from search.planner import memory_at_levels, plan_memory, recompute_levels

    mf = tiny_gpt(3)
    graph = mf.trace("float32")
    cluster = one_device()
    plan = plan_at(graph, cluster, "activations")
    at = memory_at_levels(graph, plan, cluster)
    for level in recompute_levels(graph, Training(recompute="auto"))[::2]:
        training = dataclasses.replace(plan.training, recompute_blocks=level)
        assert at(training) == plan_memory(graph, dataclasses.replace(plan, training=training), cluster)


def test_spilled_activations_of_recomputed_blocks_are_refused_by_the_executor_and_never_chosen(write_model):
    """The executor does not run offload activations on a checkpointed block: validate_plan names the
    blocks and what to use instead, and offload auto with recompute auto never returns such a plan."""
    from executor.runtime import PlanExecutionError, validate_plan

    mf = model(write_model, 6)
    graph = mf.trace("float32")
    cluster = one_device()
    plan = plan_at(graph, cluster, "activations")
    full = dataclasses.replace(plan, training=dataclasses.replace(plan.training, recompute="full"))
    with pytest.raises(PlanExecutionError, match=r"offload activations of recomputed blocks \(blocks\.0, blocks\.1, "
                                                 r"blocks\.2, \.\.\.\) is not run by the executor.*--offload params"):
        validate_plan(graph, full)
    validate_plan(graph, plan)                       # without recompute it runs
    spilled = plan_cost(graph, plan_at(graph, cluster, "params"), cluster).memory_bytes_per_device
    least = plan_cost(graph, dataclasses.replace(full, training=dataclasses.replace(
        full.training, offload="params")), cluster).memory_bytes_per_device
    out = search(graph, cluster, training=Training(offload="auto", recompute="auto"),
                 memory_gb=(least + spilled) / 2e9, cd_time_limit_s=0.05)
    training = out.found.training
    if training.offload == "activations":
        blocks = [g.group for g in spill_groups(graph, out.found)]
        assert all(training.recompute_of(b) == "none" for b in blocks)
    assert out.found_breakdown.memory_bytes_per_device <= (least + spilled) / 2
