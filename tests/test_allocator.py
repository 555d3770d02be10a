"""executor/allocator.py: with the heap kept, a step's freed tensors serve the next step without the
kernel mapping their pages in again (counted as the process's minor page faults)."""

import subprocess
import sys
import textwrap

import pytest

from executor.allocator import keep_freed_memory

# A step of mlp's shape (4 weights 512 x 512 and their biases; AdamW with foreach, whose temporaries
# are lists of 1 MB tensors), measured over steps 3-5 in a fresh process, default heap or kept.
STEPS = textwrap.dedent("""
    import resource, sys
    import torch
    from executor.allocator import keep_freed_memory
    if sys.argv[1] == "kept":
        assert keep_freed_memory()
    torch.manual_seed(0)
    params = [torch.randn(512, 512) for _ in range(4)] + [torch.randn(512) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, foreach=True)
    x = torch.randn(64, 512)                        # (B, C)
    def step():
        y = x
        for w in params[:4]:
            y = torch.relu(y @ w)
        optimizer.step()
    step(); step()                                  # the first steps map their pages in either way
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
""")


def _faults_of_three_steps(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux") or not keep_freed_memory(), reason="glibc only")
def test_kept_heap_serves_the_next_steps_without_page_faults():
    default, kept = _faults_of_three_steps("default"), _faults_of_three_steps("kept")
    assert default > 3 * 256, f"glibc's default heap: {default} page faults in three steps, expected a 1 MB " \
                              f"temporary's 256 pages or more a step (the pattern no longer shows the effect)"
    assert kept < default / 20, f"heap kept: {kept} page faults in three steps (default {default})"
