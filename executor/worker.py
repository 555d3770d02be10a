"""One torchrun rank: load a model file and a plan, train N steps as planned, write a JSON result.

    torchrun --nproc-per-node 2 -m executor.worker --plan plan.json --model examples/x.py \\
        --steps 3 --check --out result.json

Every rank builds the model on CPU from the same seed (so parameters and the batch agree
everywhere), traces it, builds the mesh and places parameters by the plan. ``--check`` trains
``--steps`` steps next to a single-process reference and reports max relative errors of the
loss, every gradient and every updated parameter. Without it, the steps are timed. Either way
one more step runs under the collective audit. Rank 0 writes ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from autoddl.loader import load_model_file
from autoddl.plan import Plan
from autoddl.trace import trace
from executor.audit import summarize
from executor.runtime import DistributedModel, audit_step, build_optimizer, init_mesh, run_check, train_step

CHECK_RTOL = 1e-4  # fp32


def _overrides(pairs: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set {pair!r}: expected KEY=VALUE, e.g. --set preset=tiny")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m executor.worker", description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, help="plan JSON written by `autoddl plan`")
    p.add_argument("--model", required=True, help="model file defining build_model / example_inputs")
    p.add_argument("--steps", type=int, default=1, help="training steps (default 1)")
    p.add_argument("--check", action="store_true", help="compare with a single-process run")
    p.add_argument("--out", default="", help="JSON result path (written by rank 0)")
    p.add_argument("--optimizer", default="", help="sgd | adamw (default: the plan's)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="model size override passed to build_model / example_inputs")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = Plan.load(args.plan)
    torch.manual_seed(args.seed)
    mf = load_model_file(args.model, device="cpu", **_overrides(args.set))
    graph = trace(mf.model, mf.example_inputs, mf.loss_fn, name=mf.name)
    mesh = init_mesh(plan, args.device)
    optimizer = args.optimizer or plan.optimizer
    result: dict[str, Any] = {
        "plan": plan.name, "model": mf.name, "mesh": list(plan.mesh.shape), "world_size": dist.get_world_size(),
        "optimizer": optimizer, "steps": args.steps, "backend": dist.get_backend(),
    }
    if args.check:
        errors = run_check(mf.model, mf.example_inputs, mf.loss_fn, graph, plan, mesh,
                           optimizer=optimizer, lr=args.lr, steps=args.steps)
        result["check"] = {"rtol": CHECK_RTOL, "ok": all(v <= CHECK_RTOL for v in errors.values()),
                           "max_rel_error": errors}
    dmodel = DistributedModel(mf.model, graph, plan, mesh)
    opt = build_optimizer(optimizer, dmodel.parameters(), args.lr)
    if not args.check:
        losses, times = [], []
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            losses.append(train_step(dmodel, mf.example_inputs, opt))
            times.append(time.perf_counter() - t0)
        result.update(losses=losses, step_time_s=times)
    records = audit_step(dmodel, mf.example_inputs, opt)
    result["collectives"] = [r.to_dict() for r in records]
    result["collectives_summary"] = summarize(records)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
        if dist.get_rank() == 0:
            text = json.dumps(result, indent=1)
            if args.out:
                out = Path(args.out)
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp = out.with_suffix(out.suffix + ".tmp")
                tmp.write_text(text)
                os.replace(tmp, out)
            else:
                print(text)
        return 0 if result.get("check", {}).get("ok", True) else 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
