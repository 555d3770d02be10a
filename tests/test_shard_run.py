"""Running shard tasks: a tiny GPT cut in two, its shards moved between two ranks emulated in one
process (every message kind: parameters, activations and the tied weight, gradients), against the
same job trained alone; and ``autoddl schedule --run`` on the bundled sweep on 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoddl.shard_program import JobPlacement, ScheduledTask, ShardedJob, transfers
from executor.shard_worker import build_job, message_maps, run_tasks, train_alone

ROOT = Path(__file__).resolve().parents[1]
JOB = {"name": "gpt", "model": str(ROOT / "examples" / "gpt.py"), "args": {"preset": "tiny"}, "seed": 3,
       "lr": 0.05, "cuts": ["transformer.h.1"]}
# step 0: shard 0 on device 0, shard 1 on device 1; step 1 swapped: every message kind crosses
DEVICE = {(0, 0): 0, (0, 1): 1, (1, 0): 1, (1, 1): 0}


def _forced_schedule(job: ShardedJob) -> list[ScheduledTask]:
    placement, out = JobPlacement(job), []
    for i, key in enumerate(job.tasks()):
        device = DEVICE[(key.step, key.shard)]
        inbox = placement.task_inputs(key, device)
        placement.place(key, device)
        out.append(ScheduledTask(0, key, device, float(i), i + 1.0, 0.0, inbox))
    return out


def test_shards_moved_between_two_emulated_ranks_train_as_the_job_alone():
    ranks = {r: [build_job(JOB)] for r in (0, 1)}
    ranks[1][0].warm_up()                            # an untimed step that must leave the weights as they were
    flows = ranks[0][0].flows
    job = ShardedJob("gpt", 2, (1.0, 1.0), (1.0, 1.0), param_bytes=(1, 1), flows=flows, cuts=tuple(JOB["cuts"]))
    tasks = _forced_schedule(job)
    assert {x.what.split(":")[0] for x in transfers(tasks)} == {"params", "act", "grad"}
    mailbox: dict[int, torch.Tensor] = {}
    maps = {r: message_maps(tasks, r) for r in ranks}
    for t in tasks:                                  # one global order in which every message is sent first
        run_tasks(ranks[t.device], [t], maps[t.device], lambda buf, src, tag: buf.copy_(mailbox.pop(tag)),
                  lambda x, dst, tag: mailbox.__setitem__(tag, x.clone()), lambda: 0.0)
    assert not mailbox
    losses = [ranks[1][0].losses[0], ranks[0][0].losses[1]]
    alone, model = train_alone(JOB, 2)
    assert losses == pytest.approx(alone, rel=1e-5)
    assert alone[1] < alone[0]
    # after step 1, shard 0's parameters are final on device 1 and shard 1's on device 0
    final = {name: ranks[1 if ranks[0][0].homes[name] == 0 else 0][0].params[name] for name in ranks[0][0].params}
    trained = dict(model.named_parameters(remove_duplicate=False))
    for node, fqn in ranks[0][0].fqns.items():
        assert torch.allclose(final[node], trained[fqn], rtol=1e-5, atol=1e-7), fqn


def test_a_spilled_job_moved_between_two_emulated_ranks_through_host_memory_trains_as_alone():
    ranks = {r: [build_job(JOB)] for r in (0, 1)}
    model = ranks[0][0]
    flat = [model.payload(0, "params", s) for s in range(model.shards)]
    job = ShardedJob("gpt", 2, (1.0, 1.0), (1.0, 1.0), param_bytes=tuple(4 * f.numel() for f in flat),
                     flows=model.flows, cuts=tuple(JOB["cuts"]), spill=True)
    placement, last, tasks = JobPlacement(job), {0: None, 1: None}, []
    for i, key in enumerate(job.tasks()):             # DEVICE's placement, each copy as the scheduler prices it
        device = DEVICE[(key.step, key.shard)]
        load, writeback = job.host_copies(key, last[device] == key.shard)
        inbox = placement.task_inputs(key, device)
        placement.place(key, device)
        last[device] = key.shard
        tasks.append(ScheduledTask(0, key, device, float(i), i + 1.0, 0.0, inbox, load_bytes=load,
                                   writeback_bytes=writeback))
    kinds = {x.what.split(":")[0] for x in transfers(tasks)}
    assert kinds == {"host", "act", "grad"}           # no params message: the shards go through host memory
    host = {(0, s): f.clone() for s, f in enumerate(flat)}
    mailbox: dict[int, torch.Tensor] = {}
    maps = {r: message_maps(tasks, r) for r in ranks}
    executed = []
    for t in tasks:
        executed += run_tasks(ranks[t.device], [t], maps[t.device], lambda buf, src, tag: buf.copy_(mailbox.pop(tag)),
                              lambda x, dst, tag: mailbox.__setitem__(tag, x.clone()), lambda: 0.0, host)
    assert [tuple(e[6:8]) for e in executed] == [(t.load_bytes, t.writeback_bytes) for t in tasks]
    p0, p1 = job.param_bytes                          # a task after the same shard on its device does not load
    assert [t.load_bytes for t in tasks] == [p0, p1, 0, 0, p0, p1, 0, 0]
    assert [t.writeback_bytes for t in tasks] == [0, 0, p1, p0, 0, 0, p1, p0]
    alone, trained = train_alone(JOB, 2)
    assert [ranks[1][0].losses[0], ranks[0][0].losses[1]] == pytest.approx(alone, rel=1e-5)
    # host memory holds the trained weights after the last write-backs
    final = dict(trained.named_parameters(remove_duplicate=False))
    for s in range(model.shards):
        want = torch.cat([final[model.fqns[n]].detach().reshape(-1) for n in model.own[s]])
        assert torch.allclose(host[(0, s)], want, rtol=1e-5, atol=1e-7)
