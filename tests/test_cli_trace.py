"""`autoddl trace`: the op table, totals, --preset/--set/--top, and one-line errors with exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from autoddl import cli

MODEL = """
import torch
from torch import nn
import torch.nn.functional as F

PRESETS = {"small": 8, "large": 64}

class Net(nn.Module):
    def __init__(self, d, depth):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.layers = nn.ModuleList(nn.Linear(4 * d, 4 * d) for _ in range(depth))
        self.out = nn.Linear(4 * d, 10, bias=False)

    def forward(self, x, y):
        h = F.relu(self.fc(x))          # (B, 4d)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)              # (B, 10)

def build_model(preset="small", depth=1):
    return Net(PRESETS[preset], depth)

def example_inputs(preset="small", batch=4):
    return torch.randn(batch, PRESETS[preset]), torch.randint(0, 10, (batch,))

def loss_fn(logits, x, y):
    return F.cross_entropy(logits, y)
"""

DATA_DEPENDENT = """
import torch
from torch import nn

class Gate(nn.Module):
    def forward(self, x):
        if x.mean() > 0:
            return x * 2
        return x

def build_model():
    return Gate()

def example_inputs():
    return (torch.randn(3),)
"""


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_trace_prints_table_and_totals(write_model, capsys):
    code, out, err = run(["trace", str(write_model(MODEL, "net.py"))], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["op", "target", "output", "shape", "GFLOPs", "MB", "parameters"]
    fc = next(line for line in lines if line.startswith("linear "))
    d, batch = 8, 4
    assert fc.split() == ["linear", "linear", "4x32", f"{(2 * batch * 4 * d * d + batch * 4 * d) / 1e9:.6f}",
                          f"{((batch * d + 4 * d * d + 4 * d) * 4 + batch * 4 * d * 4) / 1e6:.3f}",
                          "fc.weight,fc.bias"]
    assert any(line.startswith("cross_entropy_loss ") for line in lines)
    assert "ops:        5" in out                       # linear, relu, linear, linear(out), loss
    params = 8 * 32 + 32 + 32 * 32 + 32 + 32 * 10
    assert f"parameters: {params:,}" in out
    assert "GFLOPs:" in out and "forward" in out and "trace:" in out and " s" in out


def test_preset_set_and_top(write_model, capsys):
    code, out, err = run(["trace", str(write_model(MODEL)), "--preset", "large", "--set", "depth=3",
                          "--set", "batch=2", "--top", "2"], capsys)
    assert code == 0, err
    rows = [line for line in out.splitlines()[2:] if line and not line.startswith("(")][:2]
    assert [r.split()[0] for r in rows] == ["linear_1", "linear_2"]   # 256x256 layers: the largest, first in order
    assert rows[0].split()[2] == "2x256"
    assert "(top 2 of 7 ops by FLOPs)" in out


def test_missing_file_is_one_line_exit_2(capsys):
    code, out, err = run(["trace", "/no/such/net.py"], capsys)
    assert code == 2 and out == ""
    assert err.splitlines() == ["autoddl: error: model file '/no/such/net.py' does not exist"]


def test_trace_error_is_one_line_without_traceback(write_model, capsys):
    code, _, err = run(["trace", str(write_model(DATA_DEPENDENT, "gate.py"))], capsys)
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoddl: error: cannot trace gate")
    assert "data-dependent control flow" in lines[0] and "if x.mean() > 0:" in lines[0]
    assert "Traceback" not in err


def test_debug_prints_traceback(write_model, capsys):
    code, _, err = run(["trace", str(write_model(DATA_DEPENDENT)), "--debug"], capsys)
    assert code == 2
    assert "Traceback" in err and "GuardOnDataDependentSymNode" in err
    assert err.splitlines()[-1].startswith("autoddl: error: cannot trace")


def test_model_file_error_exit_2(write_model, capsys):
    code, _, err = run(["trace", str(write_model(MODEL)), "--preset", "huge"], capsys)
    assert code == 2
    assert err.strip().endswith("build_model(preset='huge') raised KeyError: 'huge'")
    code, _, err = run(["trace", str(write_model(MODEL)), "--set", "dept=2"], capsys)
    assert code == 2 and "takes 'dept'" in err


@pytest.mark.parametrize("argv, match", [
    (["--set", "depth"], "--set 'depth': expected KEY=VALUE"),
    (["--top", "0"], "--top must be a positive number"),
])
def test_bad_options_exit_2(write_model, capsys, argv, match):
    code, _, err = run(["trace", str(write_model(MODEL)), *argv], capsys)
    assert code == 2 and match in err and len(err.splitlines()) == 1


def test_usage_errors_and_help(capsys):
    assert cli.main([]) == 2                                   # no subcommand: argparse usage error
    assert "usage: autoddl" in capsys.readouterr().err
    assert cli.main(["trace", "--help"]) == 0
    assert "--preset NAME" in capsys.readouterr().out


def test_set_before_the_model_file_does_not_swallow_it(write_model, capsys):
    """One KEY=VALUE per --set: `--set depth=3 MODEL_PY` keeps MODEL_PY as the positional argument."""
    model = str(write_model(MODEL))
    code, out, err = run(["trace", "--set", "depth=3", "--preset", "large", model, "--set", "batch=2"], capsys)
    assert code == 0, err
    assert "(top" not in out and "ops:        7" in out and "2x256" in out
    code, _, err = run(["trace", "--set", "depth=3", "batch=2", model], capsys)   # two pairs need two --set
    assert code == 2 and "unrecognized arguments" in err


def test_registry_accepts_new_subcommands(capsys, monkeypatch):
    monkeypatch.setattr(cli, "SUBCOMMANDS", dict(cli.SUBCOMMANDS))

    def add_hello(subparsers):
        p = subparsers.add_parser("hello", parents=[cli.common_options()])
        p.add_argument("--name", default="world")
        p.set_defaults(func=lambda args: print(f"hello {args.name}") or 3)

    cli.register(add_hello)
    assert cli.main(["hello", "--name", "sbp"]) == 3
    assert capsys.readouterr().out == "hello sbp\n"


def test_python_dash_m(write_model):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "autoddl", "trace", str(write_model(MODEL)), "--top", "1"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "(top 1 of 5 ops by FLOPs)" in proc.stdout


UNRULED_MODEL = """
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.trace(self.fc(x))


def build_model():
    return M()


def example_inputs():
    return (torch.randn(4, 8),)
"""


def test_trace_and_plan_warn_about_ops_they_only_approximate(write_model, capsys):
    """An op without an SBP rule (trace: a matrix trace) is named with its count by trace and by plan."""
    path = str(write_model(UNRULED_MODEL, "cums.py"))
    code, out, err = run(["trace", path], capsys)
    assert code == 0, err
    assert "warning:    1 ops without an SBP rule (planned replicated, all-B): aten.trace.default x1" in out
    code, out, err = run(["plan", path, "--devices", "2", "--out", os.devnull], capsys)
    assert code == 0, err
    assert "warning: 1 ops without an SBP rule (planned replicated, all-B): aten.trace.default x1" in out
