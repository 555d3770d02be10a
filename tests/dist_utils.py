"""Test helpers for several gloo ranks on 127.0.0.1: the executor's own launcher, one step's batch of
micro-batches, and the comparison of a rank's check and audit with one process and the program."""

from __future__ import annotations

from collections import Counter

from executor.local_ranks import free_port, run_ranks

__all__ = ["free_port", "run_ranks", "step_batch", "check_and_audit_problems"]


def step_batch(inputs, k: int):
    """One optimizer step's batch: ``k`` micro-batches of the traced batch, each the example batch
    rolled along its last dim by a different amount (token ids stay token ids)."""
    import torch

    from autoddl.trace import StepInputs

    if k == 1:
        return inputs
    grow = lambda t: torch.cat([t.roll(i, dims=-1) for i in range(k)])  # noqa: E731
    args, kwargs, targets = inputs.split([grow(t) for t in inputs])
    return StepInputs(args, kwargs, targets if inputs.has_targets else None)


def check_and_audit_problems(name: str, model, errors: dict, records: list, predicted: list, tol: float) -> list[str]:
    """What is wrong with one rank's run of a plan: a parameter whose error against one process is
    above ``tol``, a parameter of ``model`` not compared, or audited collectives ``records`` other than
    the ``predicted`` ones of the program (as multisets of (kind, axis, bytes, phase))."""
    problems = []
    compared = {k.split("/", 1)[1] for k in errors if k.startswith("param/")}
    bad = {k: v for k, v in errors.items() if not v <= tol}
    if bad or compared != {fqn for fqn, _ in model.named_parameters()}:
        problems.append(f"{name}: errors above {tol} {bad}, compared {len(compared)} parameters")
    got, want = Counter(records), Counter(predicted)
    if got != want:
        problems.append(f"{name}: ran, not predicted {sorted((got - want).items())}; "
                        f"predicted, not run {sorted((want - got).items())}")
    return problems
