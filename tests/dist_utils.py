"""Test helpers: for several gloo ranks on 127.0.0.1, the executor's own launcher, one step's batch of
micro-batches and the comparison of a rank's check and audit with one process and the program; and
the model file of repeated linear blocks that the pipeline and offload tests cut; the aten ops of a
training step."""

from __future__ import annotations

from collections import Counter

from executor.local_ranks import free_port, run_ranks

__all__ = ["free_port", "run_ranks", "step_batch", "check_and_audit_problems", "block_stack_source",
           "block_stack_file", "recorded_step"]


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


_BLOCK_STACK = """
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear({d}, {d})

        def forward(self, x):
            return torch.relu(self.fc(x))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            {root}
            self.{attr} = nn.ModuleList(Block() for _ in range({n}))

        def forward(self, x):
            {root_use}
            for block in self.{attr}:
                x = block(x)
            return x

    def build_model():
        return Stack()

    def example_inputs():
        return (torch.randn({rows}, {d}),)
"""

_FIRST_COLUMN_LOSS = """
    def loss_fn(out, x):
        return out[:, :1].sum()
"""


def block_stack_source(d: int, n: int, rows: int, attr: str = "h", root: bool = False, loss: bool = False) -> str:
    """A model file (source, to dedent): ``n`` repeated blocks ``{attr}.i`` of Linear(d, d) + ReLU,
    after a Linear(d, d) ``inp`` outside the blocks when ``root``; the example input ``rows`` x ``d``;
    with ``loss``, the first output column's sum as the loss (else the model file's default)."""
    return _BLOCK_STACK.format(d=d, n=n, rows=rows, attr=attr, root=f"self.inp = nn.Linear({d}, {d})" if root else "",
                               root_use="x = self.inp(x)" if root else "") + (_FIRST_COLUMN_LOSS if loss else "")


def block_stack_file(directory, d: int, rows: int):
    """``directory``/blocks.py: a root Linear(d, d) and 2 blocks, ``rows`` example rows, the first
    output column's sum as the loss (:func:`block_stack_source`)."""
    import textwrap
    from pathlib import Path

    path = Path(directory) / "blocks.py"
    path.write_text(textwrap.dedent(block_stack_source(d, 2, rows=rows, root=True, loss=True)))
    return path


def recorded_step(dmodel, batch, opt):
    """The ``executor.audit.OpRecorder`` of a second training step of ``dmodel`` (the first as every step)."""
    from executor.audit import OpRecorder
    from executor.runtime import train_step

    train_step(dmodel, batch, opt)
    rec = OpRecorder(dmodel.mesh, dmodel.boxer.groups)
    dmodel.recorder = rec
    with rec:
        train_step(dmodel, batch, opt)
    return rec
