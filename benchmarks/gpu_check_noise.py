"""How far apart two identical bf16 training steps land on one GPU: the floor under ``--check`` there.

``autoddl run --check`` compares the plan's gradients with a single-process step under the same
precision policy, per tensor as max |a - e| / max |e| (executor/runtime.py ``max_rel_error``), and
fails above 2^-4 under bf16 (autoddl/precision.py). On CPU both steps run the same deterministic
kernels. On a GPU several backward kernels accumulate with atomics (FlashAttention-2's dQ, the
embedding's gradient, some reductions), so even the *same* eager step run twice differs. This runs
examples/gpt.py's gpt2-small (batch 16 x 1024) eagerly under the bf16 policy twice from the same
parameters (executor/runtime.py ``reference_loss``), with and without
``torch.use_deterministic_algorithms``, and writes per setting the largest gradient error and the
tensors over the bound to ``OUT/gpu_check_noise.csv``.

    python benchmarks/gpu_check_noise.py --out DIR       # on a CUDA machine, ~30 s
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")      # deterministic cuBLAS, when asked for
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from autoddl.loader import load_model_file  # noqa: E402
from executor.runtime import max_rel_error, reference_loss  # noqa: E402

BF16_CHECK_BOUND = 2 ** -4


def grads_of_one_step(mf, model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    m = copy.deepcopy(model)
    loss = reference_loss(m, mf.example_inputs, mf.loss_fn, "bfloat16")
    loss.backward()
    torch.cuda.synchronize()
    return float(loss.detach()), {k: p.grad.detach().clone() for k, p in m.named_parameters() if p.grad is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check_noise.py: no CUDA device here; run it on a GPU machine")
    torch.manual_seed(0)
    mf = load_model_file(ROOT / "examples" / "gpt.py", device="cuda")
    rows = []
    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        (loss_a, a), (loss_b, b) = grads_of_one_step(mf, mf.model), grads_of_one_step(mf, mf.model)
        errors = sorted(((max_rel_error(b[k], a[k]), k) for k in a), reverse=True)
        over = [f"{k} {e:.3g}" for e, k in errors if e > BF16_CHECK_BOUND]
        rows.append({"deterministic": deterministic, "loss_a": loss_a, "loss_b": loss_b,
                     "max_grad_error": errors[0][0], "worst_tensor": errors[0][1],
                     "tensors": len(errors), "over_bound": len(over), "over": "; ".join(over[:8]),
                     "median_grad_error": errors[len(errors) // 2][0]})
        print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "gpu_check_noise.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
