"""Measure on one CUDA GPU what the GPU cluster files assume, and one Llama-3-8B block end to end.

The GPU cluster files (configs/h100-4x8.yaml and the others) price every op by a roofline over
datasheet peaks times efficiencies, plus a per-op launch overhead. This script measures those
components on the GPU it runs on (configs/h100-4x8.yaml holds what it measured on an H100; the other
files cite published measurements), with plain PyTorch (no autoddl code on the timed path but the
selective recompute policy), and writes one CSV row per measurement (p10 / p90 interpolated as
``executor.measure.StepStats``; the committed rows of 2026-11-28 took the nearest sample):

- ``matmul``: bf16 / fp16 / fp32 (TF32 off) products, square sizes 512-16384 (the curve of
  efficiency against FLOPs per product, as ``compute_curve`` reads it) and Llama-3-8B's seven block
  linears and its output layer at 8192 tokens (micro-batch 1 x sequence 8192), each as its forward
  (``x @ W.T``), grad-input (``dY @ W``) and grad-weight (``dY.T @ x``) product.
- ``attention``: ``scaled_dot_product_attention`` forward and forward + backward, causal, bf16,
  batch 1, 32 heads of 128, sequences 2048-8192, per backend (default choice, flash, cuDNN), in
  FlashAttention-2's FLOP count (forward 4 S^2 D H, halved causal; backward 2.5 x forward), the count
  ``efficiency.attention`` is read in (costmodel/compute.py ``attention_time_s``).
- ``memory``: a 1 GiB float32 copy, add, in-place scale and sum, bytes read + written.
- ``launch``: back-to-back tiny in-place ops (host launch rate), and a chain of small autograd ops
  forward + backward (eager dispatch + launch per op, forward and backward: ``op_overhead_us``).
- ``optimizer``: ``torch.optim.AdamW`` (foreach and fused) over 1.0e9 float32 parameters (one
  GPU's eighth of Llama-3-8B under FSDP over 8).
- ``block``: examples/llama.py's Llama-3-8B (bf16 parameters and activations, float32 logits for the
  loss, as TorchTitan) at micro-batch 1 x 8192 with 1 and 3 layers, forward + loss + backward, under
  recompute none / selective (executor/recompute.py's torchtitan policy) / full; one block's time and
  activation memory are the difference of the two sizes over 2.
- ``fsdp``: the same models trained as TorchTitan trains them, on a 1-rank process group: FSDP2
  per block and root, bf16 parameters with float32 reduction over float32 masters, selective
  recompute, AdamW stepped each step; one block's share again by difference.

``--sdpa flash|cudnn`` pins the attention backend inside the model steps (TorchTitan pins flash on
H100: torchtitan PR #1196); by default torch chooses.

    python benchmarks/gpu_components.py --out DIR        # on a CUDA machine, ~1 min
    python benchmarks/gpu_components.py --out DIR --only block fsdp --sdpa flash
    python benchmarks/gpu_components.py --out DIR --smoke  # shrunken shapes, on CPU: checks the script

Rows are appended to DIR/gpu_components.csv as each is measured (a crash keeps the earlier ones);
DIR/gpu_device.json says which GPU, driver, power limit and clocks. Times are medians of CUDA-event
(or synchronized wall-clock) samples after warm-up, with p10 and p90.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import json
import math
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from costmodel.compute import ATTENTION_BACKWARD_FACTOR  # noqa: E402  (FlashAttention-2's count, as priced)
from executor.measure import StepStats  # noqa: E402
COLUMNS = ("section", "name", "dtype", "shape", "flops", "bytes", "samples", "p10_us", "median_us", "p90_us",
           "tflops", "gbps", "peak_mem_gb", "note")

LLAMA3_8B_TOKENS = 8192                     # micro-batch 1 x sequence 8192 (TorchTitan's setting)
LLAMA3_8B_LINEARS = (                       # (name, in, out) of one block's linears, and the output layer
    ("wq", 4096, 4096), ("wk", 4096, 1024), ("wv", 4096, 1024), ("wo", 4096, 4096),
    ("w1", 4096, 14336), ("w3", 4096, 14336), ("w2", 14336, 4096), ("output", 4096, 128256))
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Recorder:
    """Appends each row to the CSV at once (flushed), and keeps them for the closing table."""

    def __init__(self, path: Path):
        self.path, self.rows = path, []
        new = not path.exists()
        self.file = path.open("a", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=COLUMNS, restval="")
        if new:
            self.writer.writeheader()

    def add(self, **row) -> None:
        for key in ("p10_us", "median_us", "p90_us"):
            if key in row:
                row[key] = round(row[key], 2)
        median_s = row.get("median_us", 0) / 1e6
        if row.get("flops") and median_s:
            row["tflops"] = round(row["flops"] / median_s / 1e12, 2)
        if row.get("bytes") and median_s:
            row["gbps"] = round(row["bytes"] / median_s / 1e9, 1)
        self.writer.writerow(row)
        self.file.flush()
        self.rows.append(row)
        print(f"{row['section']:9} {row['name']:34} {row.get('dtype', ''):9} {row['median_us']:>12.1f} us"
              f"  {row.get('tflops', ''):>8} TFLOP/s  {row.get('gbps', ''):>7} GB/s  {row.get('note', '')}",
              flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentiles(samples_s: list[float]) -> dict:
    """p10 / median / p90 of seconds (executor.measure ``StepStats``), as microseconds."""
    stats = StepStats.of(samples_s)
    return {"samples": stats.steps, "p10_us": stats.p10_s * 1e6, "median_us": stats.median_s * 1e6,
            "p90_us": stats.p90_s * 1e6}


def time_op(fn: Callable[[int], object], device: torch.device, samples: int = 15, warmup: int = 3,
            target_s: float = 2e-3) -> dict:
    """Seconds of one ``fn(i)`` call: each sample brackets ``inner`` back-to-back calls (enough for
    ``target_s``, so short kernels are not timed by their launch gaps) with CUDA events."""
    for i in range(warmup):
        fn(i)
    sync(device)
    t0 = time.perf_counter()
    fn(0)
    sync(device)
    inner = max(1, min(200, int(target_s / max(time.perf_counter() - t0, 1e-7))))
    out = []
    for s in range(samples):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(inner):
                fn(s * inner + i)
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for i in range(inner):
                fn(s * inner + i)
            out.append((time.perf_counter() - t0) / inner)
    return percentiles(out)


def operand_sets(shape_a, shape_b, dtype, device, min_bytes: int = 256 << 20) -> list:
    """Enough random operand pairs to cycle through more than the L2 cache (50-60 MB on Hopper)."""
    one = (math.prod(shape_a) + math.prod(shape_b)) * torch.finfo(dtype).bits // 8
    count = max(1, min(16, min_bytes // max(one, 1)))
    return [(torch.randn(shape_a, dtype=dtype, device=device), torch.randn(shape_b, dtype=dtype, device=device))
            for _ in range(count)]


def measure_matmuls(rec: Recorder, device: torch.device, smoke: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False          # float32 at the plain-FP32 peak the files give
    squares = {"bfloat16": (512, 1024, 2048, 4096, 8192, 16384), "float16": (8192,), "float32": (1024, 4096, 8192)}
    for dtype_name, sizes in squares.items():
        for n in ((64, 128) if smoke else sizes):
            sets = operand_sets((n, n), (n, n), DTYPES[dtype_name], device)
            t = time_op(lambda i: torch.mm(*sets[i % len(sets)]), device)
            rec.add(section="matmul", name=f"square {n}", dtype=dtype_name, shape=f"{n}x{n}x{n}",
                    flops=2 * n ** 3, **t)
            del sets
    tokens = 64 if smoke else LLAMA3_8B_TOKENS
    for name, d_in, d_out in LLAMA3_8B_LINEARS:
        if smoke:
            d_in, d_out = max(8, d_in // 128), max(8, d_out // 128)
        products = {   # (m, k) @ (k, n) as the three products of a linear's forward and backward
            "forward x@W.T": ((tokens, d_in), (d_out, d_in), lambda a, b: F.linear(a, b)),
            "grad input dY@W": ((tokens, d_out), (d_out, d_in), lambda a, b: torch.mm(a, b)),
            "grad weight dY.T@x": ((tokens, d_out), (tokens, d_in), lambda a, b: torch.mm(a.t(), b)),
        }
        for label, (sa, sb, op) in products.items():
            sets = operand_sets(sa, sb, torch.bfloat16, device)
            t = time_op(lambda i: op(*sets[i % len(sets)]), device)
            rec.add(section="matmul", name=f"llama3-8b {name} {label}", dtype="bfloat16",
                    shape=f"{tokens}x{d_in}x{d_out}", flops=2 * tokens * d_in * d_out, **t)
            del sets


def attention_flops(seq: int, heads: int, head_dim: int, causal: bool) -> float:
    """FlashAttention-2's forward count (arXiv:2307.08691, 4.1): 4 S^2 D H, halved when causal."""
    return 4 * seq * seq * head_dim * heads / (2 if causal else 1)


def measure_attention(rec: Recorder, device: torch.device, smoke: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = {"default": None}
    if device.type == "cuda":
        backends.update(flash=SDPBackend.FLASH_ATTENTION, cudnn=SDPBackend.CUDNN_ATTENTION)
    heads, head_dim = (4, 32) if smoke else (32, 128)
    for seq in ((128,) if smoke else (2048, 4096, 8192)):
        q, k, v = (torch.randn(1, heads, seq, head_dim, dtype=torch.bfloat16, device=device, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(1, heads, seq, head_dim, dtype=torch.bfloat16, device=device)
        fwd_flops = attention_flops(seq, heads, head_dim, causal=True)
        for backend_name, backend in backends.items():
            if backend_name != "default" and seq != (128 if smoke else 8192):
                continue
            def ctx(backend=backend):
                return sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()

            def forward(i):
                with ctx():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def forward_backward(i):
                with ctx():
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.backward(grad)

            shape = f"1x{heads}x{seq}x{head_dim}"
            try:
                t_f = time_op(forward, device, samples=11)
                t_fb = time_op(forward_backward, device, samples=11)
            except RuntimeError as e:        # a backend this GPU or build does not have
                rec.add(section="attention", name=f"sdpa {backend_name} causal", dtype="bfloat16", shape=shape,
                        samples=0, median_us=0.0, note=f"unavailable: {str(e).splitlines()[0][:120]}")
                continue
            rec.add(section="attention", name=f"sdpa {backend_name} causal forward", dtype="bfloat16",
                    shape=shape, flops=fwd_flops, **t_f)
            rec.add(section="attention", name=f"sdpa {backend_name} causal forward+backward", dtype="bfloat16",
                    shape=shape, flops=(1 + ATTENTION_BACKWARD_FACTOR) * fwd_flops, **t_fb)
        del q, k, v, grad


def measure_memory(rec: Recorder, device: torch.device, smoke: bool) -> None:
    n = (1 << 20) if smoke else (1 << 28)            # float32 elements: 1 GiB on the GPU
    a, b, c = (torch.randn(n, device=device) for _ in range(3))
    w = 4 * n
    cases = {"copy": (lambda i: c.copy_(a), 2 * w), "add a+b->c": (lambda i: torch.add(a, b, out=c), 3 * w),
             "scale in place": (lambda i: c.mul_(1.0001), 2 * w), "sum": (lambda i: a.sum(), w)}
    for name, (fn, nbytes) in cases.items():
        rec.add(section="memory", name=name, dtype="float32", shape=str(n), bytes=nbytes,
                **time_op(fn, device, samples=21))
    del a, b, c


def measure_launch(rec: Recorder, device: torch.device, smoke: bool) -> None:
    """Per-op host costs: tiny in-place ops back to back, and a small autograd chain's forward + backward."""
    x = torch.ones(1, device=device)
    n = 2000

    def burst():
        for _ in range(n):
            x.add_(1.0)

    rec.add(section="launch", name="tiny add_ back to back", dtype="float32", shape="1",
            note="wall-clock per op, synchronized", **wall_per(burst, n, device))
    y0 = torch.randn(256, device=device, requires_grad=True)
    ops_per_link, links = 3, 100

    def chain():
        y = y0
        for _ in range(links):
            y = torch.relu(y * 1.0001 + 0.5)           # 3 ops with a backward each
        y.sum().backward()

    rec.add(section="launch", name="autograd chain forward+backward", dtype="float32", shape="256",
            note=f"wall-clock per op ({ops_per_link * links} ops), forward + backward",
            **wall_per(chain, ops_per_link * links, device))


def wall_per(fn: Callable[[], object], ops: int, device: torch.device, samples: int = 11) -> dict:
    fn()
    sync(device)
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append((time.perf_counter() - t0) / ops)
    return percentiles(out)


def measure_optimizer(rec: Recorder, device: torch.device, smoke: bool) -> None:
    total = (1 << 16) if smoke else 1_000_000_000
    tensors = 32
    params = [torch.nn.Parameter(torch.randn(total // tensors, device=device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    for variant in ("foreach", "fused"):
        if variant == "fused" and device.type != "cuda":
            continue
        opt = torch.optim.AdamW(params, lr=1e-4, **{variant: True})
        t = wall_per(opt.step, 1, device, samples=7)
        # bytes: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq (float32 each)
        rec.add(section="optimizer", name=f"adamw {variant}", dtype="float32", shape=f"{tensors}x{total // tensors}",
                bytes=7 * 4 * total, **t)
        del opt
    del params
    if device.type == "cuda":
        torch.cuda.empty_cache()


def load_llama():
    spec = importlib.util.spec_from_file_location("autoddl_example_llama", ROOT / "examples" / "llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Recomputed(torch.nn.Module):
    """One block under non-reentrant checkpoint: ``full`` saves its inputs only, ``selective`` runs
    executor/recompute.py's torchtitan policy (the one autoddl's executor runs)."""

    def __init__(self, block: torch.nn.Module, policy: str):
        super().__init__()
        self.block, self.kwargs = block, {}
        if policy == "selective":
            from executor.recompute import selective_context
            self.kwargs["context_fn"] = selective_context

    def forward(self, x, cos, sin):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.block, x, cos, sin, use_reentrant=False, **self.kwargs)


def measure_blocks(rec: Recorder, device: torch.device, smoke: bool, sdpa: str = "default") -> None:
    """One block's forward + backward under each recompute policy: (3 layers - 1 layer) / 2."""
    measure_model_steps(rec, device, smoke, sdpa, fsdp=False)


def measure_fsdp_steps(rec: Recorder, device: torch.device, smoke: bool, sdpa: str = "default") -> None:
    """TorchTitan's recipe on one GPU (a 1-rank process group): FSDP2 ``fully_shard`` per block and
    at the root with ``MixedPrecisionPolicy(bf16 parameters, float32 reduction)``, float32 masters,
    selective recompute, ``AdamW`` (foreach, torch's default) stepped every step."""
    import os
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        measure_model_steps(rec, device, smoke, sdpa, fsdp=True)
    finally:
        dist.destroy_process_group()


def measure_model_steps(rec: Recorder, device: torch.device, smoke: bool, sdpa: str, fsdp: bool) -> None:
    llama = load_llama()
    sizes = {"n_layers": None, "batch_size": 1, "seq_len": LLAMA3_8B_TOKENS, "float_logits": True}
    preset = "tiny" if smoke else "llama3-8b"
    if smoke:
        sizes.update(seq_len=32)
    section = "fsdp" if fsdp else "block"
    what = ("FSDP2 1 rank, bf16 / fp32 reduce, fp32 masters, AdamW foreach: forward + float32 loss + backward + step"
            if fsdp else "bf16 model: forward + float32 loss + backward")
    times, peaks = {}, {}
    for policy in (("selective",) if fsdp else ("none", "selective", "full")):
        label = f"recompute {policy}, sdpa {sdpa}"
        for layers in (1, 3):
            try:
                t, peak = model_step(llama, preset, dict(sizes, n_layers=layers), policy, device, sdpa, fsdp)
            except Exception as e:  # noqa: BLE001  (record why and go on to the next variant)
                rec.add(section=section, name=f"llama3-8b {layers} layers, {label}", samples=0,
                        median_us=0.0, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
                traceback.print_exc()
                continue
            times[policy, layers], peaks[policy, layers] = t, peak
            rec.add(section=section, name=f"llama3-8b {layers} layers, {label}", dtype="bfloat16",
                    shape=f"1x{sizes['seq_len']}", peak_mem_gb=round(peak / 1e9, 3),
                    note=f"{what}, wall-clock synchronized", **t)
        if (policy, 1) in times and (policy, 3) in times:
            one = {k: (times[policy, 3][k] - times[policy, 1][k]) / 2 for k in ("p10_us", "median_us", "p90_us")}
            rec.add(section=section, name=f"llama3-8b one block, {label}", dtype="bfloat16",
                    shape=f"1x{sizes['seq_len']}", samples=times[policy, 3]["samples"],
                    peak_mem_gb=round((peaks[policy, 3] - peaks[policy, 1]) / 2 / 1e9, 3),
                    note="(3 layers - 1 layer) / 2 of each statistic: time and peak memory", **one)


def model_step(llama, preset: str, sizes: dict, policy: str, device: torch.device, sdpa: str,
               fsdp: bool) -> tuple[dict, int]:
    """Median seconds of one training step of the model, and its peak allocated bytes beyond the
    parameters (and, with ``fsdp``, the optimizer states)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with torch.device(device):
        model = llama.build_model(preset, **sizes)
    if not fsdp:
        model = model.to(torch.bfloat16)
    if policy != "none":
        for i, block in enumerate(model.layers):
            model.layers[i] = Recomputed(block, policy)
    optimizer = None
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for i, block in enumerate(model.layers):      # torchtitan: the last block stays gathered
            fully_shard(block, mp_policy=mp, reshard_after_forward=i < len(model.layers) - 1)
        fully_shard(model, mp_policy=mp)
        optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4, weight_decay=0.1, foreach=True)
    tokens, targets = (t.to(device) for t in llama.example_inputs(preset, **sizes))
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}

    def step():
        with sdpa_kernel(backends[sdpa]) if sdpa in backends else contextlib.nullcontext():
            logits = model(tokens)
            llama.loss_fn(logits, tokens, targets).backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)

    step()
    step()
    sync(device)
    base = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t = wall_per(step, 1, device, samples=9)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return t, peak


def device_info(device: torch.device) -> dict:
    info = {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
            "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, multiprocessors=props.multi_processor_count,
                    memory_gb=round(props.total_memory / 1e9, 1), cuda=torch.version.cuda)
        info["nvidia_smi"] = nvidia_smi()
    return info


def nvidia_smi() -> str:
    fields = "name,driver_version,power.limit,power.default_limit,power.max_limit,power.draw,clocks.sm,clocks.max.sm,clocks.mem,memory.total"
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv"], capture_output=True,
                              text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi failed: {e}"


SECTIONS = {"matmul": measure_matmuls, "attention": measure_attention, "memory": measure_memory,
            "launch": measure_launch, "optimizer": measure_optimizer, "block": measure_blocks,
            "fsdp": measure_fsdp_steps}
MODEL_SECTIONS = ("block", "fsdp")      # sections that take --sdpa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu_components.csv and gpu_device.json")
    parser.add_argument("--smoke", action="store_true", help="shrunken shapes (runs on CPU too)")
    parser.add_argument("--only", nargs="*", choices=sorted(SECTIONS), help="sections to run (default all)")
    parser.add_argument("--sdpa", choices=("default", "flash", "cudnn"), default="default",
                        help="attention backend inside the model steps (block, fsdp); default: torch's choice")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        sys.exit("gpu_components.py: no CUDA device here; run it on a GPU machine (or pass --smoke to check it)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = device_info(device)
    print(json.dumps(info, indent=1), flush=True)
    rec = Recorder(out / "gpu_components.csv")
    torch.manual_seed(0)
    for name in args.only or SECTIONS:
        try:
            extra = {"sdpa": args.sdpa} if name in MODEL_SECTIONS else {}
            SECTIONS[name](rec, device, args.smoke, **extra)
        except Exception:  # noqa: BLE001  (a section that fails must not cost the others' figures)
            traceback.print_exc()
        if name == "matmul" and device.type == "cuda":
            info["nvidia_smi_after_matmuls"] = nvidia_smi()
    (out / "gpu_device.json").write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    main()
