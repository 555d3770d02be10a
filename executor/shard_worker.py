"""A torchrun rank of ``autoddl schedule --run``: run the shard tasks the schedule gave this device.

``python -m executor.shard_worker --spec SPEC_JSON --out-dir DIR`` (one rank per device, gloo).
SPEC_JSON holds the jobs (model file, arguments, seed, learning rate, shard cuts and the names of
their flows as the planner saw them) and every scheduled task with its inbox. Each rank builds
every job (executor/shard_runner.py) and warms each up (one untimed forward and backward of every
shard, no update, as ``autoddl run`` times steps after warm-up), then runs its own tasks in start
order: before a task it receives the task's messages (``autoddl.shard_program.transfers``: one tag
per message, the same numbering on every rank) and loads a spilled shard from host memory (the
task's ``load_bytes``), after it writes a spilled backward's shard back to host memory and sends the
messages the task produced (non-blocking, so that a rank never waits on a peer that is computing).
Host memory is one file per spilled shard in SPEC_JSON's ``host_dir`` that every rank maps
(``torch.from_file(shared=True)``), filled with the initial weights by rank 0 before the first
barrier. The makespan is timed between two barriers; each
rank writes ``DIR/rank<R>.json``: the tasks it ran in order with their start and end, and the
losses of the steps whose last shard it ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from autoddl.atomic import write_text_atomic
from autoddl.loader import load_model_file
from autoddl.shard_program import FORWARD, ScheduledTask, device_order, task_from_dict, transfers
from executor.launch import record_fatal_signals
from executor.shard_runner import ShardedModel
from executor.worker import _report_failure


def build_job(job: dict[str, Any]) -> ShardedModel:
    """The job's model with real weights and its example batch, both after ``torch.manual_seed(seed)``
    (the same calls as the job trained alone), run shard by shard."""
    torch.manual_seed(job["seed"])
    mf = load_model_file(job["model"], device="cpu", **job["args"])
    model = ShardedModel(mf, mf.trace(), tuple(job["cuts"]), job["lr"])
    mine = [f.tensor for f in model.flows]
    if job.get("flows") is not None and mine != job["flows"]:
        raise RuntimeError(f"job {job['name']!r}: this rank cut the model into flows {mine}, the schedule was "
                           f"priced with {job['flows']}; the model file changed between planning and running")
    return model


def message_maps(tasks: Sequence[ScheduledTask], rank: int) -> tuple[dict, dict]:
    """(job, task) -> the transfers this rank receives before it / sends after it."""
    receives, sends = defaultdict(list), defaultdict(list)
    for x in transfers(tasks):
        if x.dst == rank:
            receives[(x.job, x.before)].append(x)
        if x.src == rank:
            sends[(x.job, x.after)].append(x)
    return receives, sends


def run_tasks(models: list[ShardedModel], mine: Sequence[ScheduledTask], maps: tuple[dict, dict], recv: Callable,
              send: Callable, clock: Callable[[], float], host: dict | None = None) -> list[list]:
    """Run ``mine`` in order: receive each task's messages (``recv(buf, src, tag)``), load its shard from
    ``host`` ((job, shard) -> flat tensor) when spilled, run it, write the shard back when spilled, send
    what it produced (``send(tensor, dst, tag)``); ``maps``: :func:`message_maps` of this rank. Returns
    [job, step, shard, kind, start, end, bytes loaded, bytes written back] per task."""
    receives, sends = maps
    executed = []
    for t in mine:
        model, key = models[t.job], t.key
        model.forget_before(key.step)
        for x in receives[(t.job, key)]:
            buf = model.buffer(x.what, key.shard)
            recv(buf, x.src, x.tag)
            model.accept(key.step, x.what, key.shard, buf)
        loaded = model.load(key.shard, host[(t.job, key.shard)]) if t.load_bytes else 0
        start = clock()
        (model.forward if key.kind == FORWARD else model.backward)(key.step, key.shard)
        end = clock()
        written = model.write_back(key.shard, host[(t.job, key.shard)]) if t.writeback_bytes else 0
        executed.append([t.job, key.step, key.shard, key.kind, start, end, loaded, written])
        for x in sends[(t.job, key)]:
            send(model.payload(key.step, x.what, key.shard), x.dst, x.tag)
    return executed


def host_memory(spec: dict[str, Any], models: list[ShardedModel], rank: int) -> dict[tuple[int, int], torch.Tensor]:
    """(job, shard) -> the spilled shard's flat float32 tensor in host memory, mapped from its file
    (module docstring); rank 0 writes the initial weights (a barrier must follow)."""
    host = {}
    for j, (job, model) in enumerate(zip(spec["jobs"], models)):
        for s in range(model.shards) if job.get("spill") else ():
            flat = model.payload(0, "params", s)
            host[(j, s)] = torch.from_file(host_file(spec["host_dir"], j, s), shared=True, size=flat.numel(),
                                           dtype=flat.dtype)
            if rank == 0:
                host[(j, s)].copy_(flat)
    return host


def host_file(host_dir: str, job: int, shard: int) -> str:
    return str(Path(host_dir) / f"host-job{job}-shard{shard}.bin")


def run(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    models = [build_job(job) for job in spec["jobs"]]
    for model in models:
        model.warm_up()
    host = host_memory(spec, models, rank)
    tasks = [task_from_dict(t) for t in spec["tasks"]]
    pending = []

    def send(tensor: torch.Tensor, dst: int, tag: int) -> None:      # kept alive until it is sent
        pending.append((dist.isend(tensor, dst=dst, tag=tag), tensor))

    dist.barrier()
    t0 = time.perf_counter()
    executed = run_tasks(models, device_order(tasks, rank), message_maps(tasks, rank),
                         lambda buf, src, tag: dist.recv(buf, src=src, tag=tag), send, lambda: time.perf_counter() - t0,
                         host)
    for handle, _ in pending:
        handle.wait()
    dist.barrier()
    makespan = time.perf_counter() - t0
    losses = {str(j): {str(s): v for s, v in m.losses.items()} for j, m in enumerate(models)}
    return {"rank": rank, "makespan_s": makespan, "executed": executed, "losses": losses}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m executor.shard_worker")
    p.add_argument("--spec", required=True, help="the schedule and its jobs (JSON)")
    p.add_argument("--out-dir", required=True, help="each rank writes rank<R>.json here")
    p.add_argument("--error-dir", default="", help="a failing rank writes rank<R>.json with its traceback here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    record_fatal_signals(args.error_dir)
    try:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        result = run(json.loads(Path(args.spec).read_text()), rank)
        write_text_atomic(Path(args.out_dir) / f"rank{rank}.json", json.dumps(result))
    except BaseException as exc:
        _report_failure(args, exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())


def train_alone(job: dict[str, Any], steps: int) -> tuple[list[float], torch.nn.Module]:
    """The job trained alone in this process, eagerly (``mf.step_loss``, ``loss.backward()``, then
    ``p -= lr * grad`` for every parameter): the loss of each step and the trained model, the reference
    of a sharded run."""
    torch.manual_seed(job["seed"])
    mf = load_model_file(job["model"], device="cpu", **job["args"])
    losses = []
    for _ in range(steps):
        loss = mf.step_loss()
        loss.backward()
        with torch.no_grad():
            for p in mf.model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-job["lr"])
                p.grad = None
        losses.append(float(loss.detach()))
    return losses, mf.model
