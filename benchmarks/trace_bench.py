"""Time and memory of tracing every example model preset on the meta device.

Each (model, preset) is traced in a fresh child process, so the peak resident
memory it reports (ru_maxrss of that child) belongs to that model alone. The
child builds the model and one step's inputs under ``torch.device("meta")`` and
runs ``autoddl.trace(model, inputs, loss_fn)``; nothing of weight size is
allocated, which is what lets a 175B model plan on a laptop.

    python benchmarks/trace_bench.py                       # all presets -> results/trace.csv
    python benchmarks/trace_bench.py --only gpt:gpt3-175b llama:llama3-70b --out /tmp/t.csv

Columns of the CSV: model, preset, status ("ok" or the child's error),
model_params (unique nn.Module parameters), graph_params (parameter elements
in the traced graph), n_ops (aten op nodes), n_nodes (all graph nodes),
forward_gflops (forward pass incl. loss, one step's batch), build_s (model and
inputs on meta), trace_s (autoddl.trace; wall clock), cpu_s (CPU time of
build + trace, steadier than wall clock on a shared machine), import_rss_mb (peak RSS after
importing torch + autoddl), peak_rss_mb (peak RSS of the child), torch.
"""

import argparse
import csv
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MODELS = ("mlp", "resnet", "vgg", "gpt", "llama")
COLUMNS = ("model", "preset", "status", "model_params", "graph_params", "n_ops", "n_nodes",
           "forward_gflops", "build_s", "trace_s", "cpu_s", "import_rss_mb", "peak_rss_mb", "torch")


def load_example(name: str):
    """Import examples/<name>.py by path (registered in sys.modules so dataclasses work)."""
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"autoddl_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def child(model: str, preset: str) -> dict:
    """Trace one preset in this (fresh) process and return its row."""
    import torch
    import autoddl
    mod = load_example(model)
    import_rss = peak_rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.device("meta"):
        net = mod.build_model(preset)
        inputs = mod.example_inputs(preset)
    t1 = time.perf_counter()
    graph = autoddl.trace(net, inputs, getattr(mod, "loss_fn", None), name=f"{model}:{preset}")
    t2, c2 = time.perf_counter(), time.process_time()
    return dict(model=model, preset=preset, status="ok",
                model_params=sum(p.numel() for p in net.parameters()),
                graph_params=graph.parameter_count, n_ops=len(graph.ops()), n_nodes=len(graph),
                forward_gflops=round(graph.total_flops / 1e9, 3), build_s=round(t1 - t0, 3),
                trace_s=round(t2 - t1, 3), cpu_s=round(c2 - c0, 3), import_rss_mb=round(import_rss, 1),
                peak_rss_mb=round(peak_rss_mb(), 1), torch=torch.__version__)


def run_one(model: str, preset: str, timeout_s: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", model, preset]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return dict(model=model, preset=preset, status=f"timeout after {timeout_s:.0f} s")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(model=model, preset=preset, status=f"failed (exit {proc.returncode}): {err[:200]}")
    return json.loads(lines[-1])


def human(n: float) -> str:
    """175222972416 -> '175.2B'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def write_csv_atomic(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise


def all_presets() -> list[tuple[str, str]]:
    return [(m, p) for m in MODELS for p in load_example(m).PRESETS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "trace.csv")
    parser.add_argument("--only", nargs="*", metavar="MODEL:PRESET", help="trace just these presets")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per preset")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "PRESET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    known = all_presets()
    todo = known
    if args.only:
        todo = [tuple(s.split(":", 1)) for s in args.only]
        bad = [f"{m}:{p}" for m, p in todo if (m, p) not in known]
        if bad:
            parser.error(f"unknown preset(s) {bad}; known: {[f'{m}:{p}' for m, p in known]}")
    rows = []
    for i, (model, preset) in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {model}:{preset} ...", end=" ", flush=True)
        row = run_one(model, preset, args.timeout_s)
        rows.append(row)
        if row["status"] == "ok":
            print(f"trace {row['trace_s']:.1f} s (cpu {row['cpu_s']:.1f} s), "
                  f"{row['peak_rss_mb']:.0f} MB peak, {row['n_ops']} ops, "
                  f"{human(row['graph_params'])} params, {row['forward_gflops']:.3g} GFLOP", flush=True)
        else:
            print(row["status"], flush=True)
        write_csv_atomic(rows, args.out)  # after every preset: a partial run still leaves a table
    print(f"wrote {args.out}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
