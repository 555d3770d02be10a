"""Load a model file: a Python file defining ``build_model`` and ``example_inputs``.

A model file is the unit every CLI command takes::

    def build_model(**sizes) -> nn.Module: ...            # sizes by keyword, e.g. preset="small"
    def example_inputs(**sizes) -> tuple[Tensor, ...] | dict[str, Tensor]: ...
                                                          # forward's inputs: model(*t) or model(**d)
    def example_targets(**sizes) -> tuple[Tensor, ...] | dict[str, Tensor]: ...
                                                          # optional: tensors only the loss takes
    def loss_fn(output, *targets) -> Tensor: ...          # optional; default_loss otherwise

Without ``example_targets`` the loss is ``loss_fn(output, *inputs)`` (``**inputs``
for a dict), the classic convention; with it, ``loss_fn(output, *targets)``
(``**targets`` for a dict). The file is imported by path under a unique module
name, and its functions run under ``torch.device(device)`` (``"meta"`` by
default) so a 175B-parameter model is built without allocating its weights.

The step's tensors are ``ModelFile.example_inputs``, a flat :class:`StepInputs`
in graph-input order (forward's positional inputs, its keyword inputs, the
targets): ``dmodel(*mf.example_inputs)`` feeds the traced graph and
``mf.step_loss(model, values)`` computes the same step's loss eagerly.

Inputs and targets are batch-first: ``mf.with_batch_size(n)`` is the same file with every one
of them repeated or cut to ``n`` along dim 0 (how the planner sets the micro-step's batch,
``--micro-batch-size`` x the data-parallel degree); ``load_for_plan(plan)`` loads the file a
plan was made for at the plan's batch (``Plan.batch_size``), to trace with
``mf.trace(plan.training.param_dtype)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from autoddl.graph import OpGraph
from autoddl.trace import StepInputs, step_inputs, trace

if TYPE_CHECKING:
    from autoddl.plan import Plan

_SIGNATURES = {
    "build_model": "def build_model(**sizes) -> torch.nn.Module",
    "example_inputs": "def example_inputs(**sizes) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]",
    "example_targets": "def example_targets(**sizes) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]",
}


class ModelFileError(ValueError):
    """A model file is missing, lacks a required function, or one of its functions failed."""


@dataclass
class ModelFile:
    path: str                     # absolute path of the file
    name: str                     # file stem, e.g. "gpt"
    model: nn.Module
    example_inputs: StepInputs    # flat, graph-input order: forward args, forward kwargs, targets
    loss_fn: Callable[..., torch.Tensor]

    @property
    def forward_args(self) -> tuple[torch.Tensor, ...]:
        """The tensors ``forward`` takes positionally."""
        return self.example_inputs.split()[0]

    @property
    def forward_kwargs(self) -> dict[str, torch.Tensor]:
        """The tensors ``forward`` takes by keyword (``example_inputs()`` returned a dict)."""
        return self.example_inputs.split()[1]

    @property
    def targets(self) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
        """The tensors only the loss takes (``example_targets()``); empty without it."""
        return self.example_inputs.split()[2]

    def step_loss(self, model: nn.Module | None = None, values: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """One eager training step's loss on ``model`` (default: the file's), single process.

        ``values`` is a flat sequence in ``example_inputs`` order (e.g. moved to a device
        or sharded on the batch dim); default: ``example_inputs`` themselves."""
        return self.example_inputs.step_loss(self.model if model is None else model, self.loss_fn, values)

    def trace(self, param_dtype: str = "float32", *, replicate: bool = False,
              say: Callable[[str], None] | None = None) -> OpGraph:
        """The whole training step's forward (loss included) as an OpGraph, traced under the
        mixed-precision policy ``param_dtype`` (a plan's ``training.param_dtype``); ``replicate``:
        a repeated stack of blocks exported cut and replicated, for planning (autoddl/trace.py)."""
        return trace(self.model, self.example_inputs, self.loss_fn, name=self.name, param_dtype=param_dtype,
                     replicate=replicate, say=say)

    @property
    def batch_size(self) -> int:
        """The example batch: dim 0 of the first input (see :meth:`with_batch_size` for the checks)."""
        return self._batch_dim()

    def _batch_dim(self) -> int:
        names = self.example_inputs.names(getattr(self.model, "forward", None))
        if not len(self.example_inputs):
            raise ModelFileError(f"{self.path}: example_inputs() returned no tensors, so there is no batch dim")
        sizes = []
        for name, t in zip(names, self.example_inputs):
            if t.dim() == 0:
                raise ModelFileError(f"{self.path}: input {name!r} is a 0-d tensor: it has no batch dim (dim 0), "
                                     "so the batch cannot be set; inputs and targets must be batch-first")
            sizes.append((name, int(t.shape[0])))
        first = sizes[0]
        odd = [f"{n!r} ({b})" for n, b in sizes[1:] if b != first[1]]
        if odd:
            raise ModelFileError(f"{self.path}: inputs must be batch-first with one batch size, but dim 0 of "
                                 f"{', '.join(odd)} differs from {first[0]!r} ({first[1]}); make every input "
                                 "and target batch-first")
        return first[1]

    def with_batch_size(self, batch: int) -> "ModelFile":
        """This file with every input and target of batch ``batch`` (dim 0): repeated or sliced
        along dim 0. A clear error names an input with no batch dim (a 0-d tensor) or whose dim 0
        differs from the others'."""
        if not (isinstance(batch, int) and batch >= 1):
            raise ValueError(f"batch size {batch!r} must be a positive integer")
        have = self._batch_dim()
        if batch == have:
            return self
        reps = -(-batch // have)
        values = [(t.repeat((reps,) + (1,) * (t.dim() - 1)) if reps > 1 else t)[:batch].contiguous()
                  for t in self.example_inputs]
        args, kwargs, targets = self.example_inputs.split(values)
        step = StepInputs(args, kwargs, targets if self.example_inputs.has_targets else None)
        return dataclasses.replace(self, example_inputs=step)


def default_loss(output: Any, *inputs: Any, **keyword_inputs: Any) -> torch.Tensor:
    """Mean of every floating-point tensor in ``output`` (a tensor, or a tuple/list/dict of them), summed."""
    tensors = [t for t in _flatten(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ModelFileError(f"default_loss: the model output ({type(output).__name__}) holds no floating-point "
                             "tensor to take a loss of; define loss_fn(output, *inputs) in the model file")
    loss = tensors[0].mean()
    for t in tensors[1:]:
        loss = loss + t.mean()
    return loss


def load_model_file(path: str | os.PathLike, *, device: str | torch.device = "meta", **overrides: Any) -> ModelFile:
    """Import the model file at ``path`` and build its model and example inputs on ``device``.

    ``overrides`` (e.g. ``preset="small"``, ``n_layer=2``) are passed by keyword to
    ``build_model`` and ``example_inputs``, each getting those its signature accepts.
    """
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ModelFileError(f"model file {str(path)!r} does not exist" if not file.exists()
                             else f"model file {str(path)!r} is not a file")
    module = _import(file)
    build = _required(module, file, "build_model")
    make_inputs = _required(module, file, "example_inputs")
    make_targets = _optional(module, file, "example_targets")
    _check_overrides(file, overrides, build, make_inputs, *([make_targets] if make_targets else []))
    with torch.device(device):
        model = _call(file, "build_model", build, overrides)
        inputs = _tensors(file, "example_inputs", _call(file, "example_inputs", make_inputs, overrides))
        targets = None if make_targets is None else \
            _tensors(file, "example_targets", _call(file, "example_targets", make_targets, overrides))
    if not isinstance(model, nn.Module):
        raise ModelFileError(f"{file}: build_model() returned {type(model).__name__}, expected an nn.Module "
                             f"({_SIGNATURES['build_model']})")
    loss_fn = getattr(module, "loss_fn", None)
    if loss_fn is not None and not callable(loss_fn):
        raise ModelFileError(f"{file}: loss_fn is a {type(loss_fn).__name__}, expected a function "
                             f"def loss_fn(output, *{'targets' if make_targets else 'inputs'}) -> torch.Tensor")
    step = step_inputs(inputs, targets)
    names = step.names(getattr(model, "forward", None))
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ModelFileError(f"{file}: example_targets() uses the name(s) {clash} of forward inputs; "
                             "rename the targets (keys of the dict it returns)")
    return ModelFile(path=str(file), name=file.stem, model=model, example_inputs=step,
                     loss_fn=loss_fn or default_loss)


def _tensors(file: Path, fn_name: str, value: Any) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
    """``value`` as a tuple of tensors or a dict of str -> tensor; a ModelFileError naming what it held."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, dict):
        bad = {k: type(v).__name__ for k, v in value.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)}
        if bad or not value:
            got = "an empty dict" if not value else "a dict holding " + ", ".join(f"{k!r}: {t}" for k, t in bad.items())
            raise ModelFileError(f"{file}: {fn_name}() returned {got}, expected tensors by keyword name "
                                 f"({_SIGNATURES[fn_name]})")
        return dict(value)
    if isinstance(value, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in value):
        return tuple(value)
    got = type(value).__name__ if not isinstance(value, (tuple, list)) else \
        "a sequence holding " + ", ".join(sorted({type(t).__name__ for t in value}))
    raise ModelFileError(f"{file}: {fn_name}() returned {got}, expected a tuple of tensors or a dict of them "
                         f"({_SIGNATURES[fn_name]})")


def load_for_plan(plan: "Plan", *, device: str | torch.device = "meta", path: str | os.PathLike | None = None
                  ) -> ModelFile:
    """The model file ``plan`` was made for (``path``, default ``plan.model``), with the plan's model
    arguments and at its traced batch (``plan.batch_size``). Trace it with
    ``mf.trace(plan.training.param_dtype)`` to get the plan's graph."""
    source = path or plan.model
    if not source:
        raise ModelFileError(f"plan {plan.name!r} names no model file; pass the one it was made for")
    mf = load_model_file(source, device=device, **plan.model_args)
    return mf.with_batch_size(plan.batch_size) if plan.batch_size else mf


def trace_model_file(path: str | os.PathLike, **overrides: Any) -> tuple[ModelFile, OpGraph]:
    """Load ``path`` on the meta device and trace one training step's forward, loss included."""
    mf = load_model_file(path, **overrides)
    return mf, mf.trace()


def parse_overrides(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``["n_layer=2", "preset=tiny"]`` -> ``{"n_layer": 2, "preset": "tiny"}``: the ``--set KEY=VALUE`` pairs.

    A value is read as JSON (``2``, ``1e-3``, ``true``, ``[2, 2]``, ``"x"``), else kept as a string;
    Python's ``True`` / ``False`` / ``None`` are read as JSON's. The one parser of every ``--set``.
    """
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, raw = str(pair).partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"--set {pair!r}: expected KEY=VALUE with a Python identifier as KEY, "
                             f"e.g. --set n_layer=2 or --set preset=tiny")
        raw = _PY_LITERALS.get(raw, raw)
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


_PY_LITERALS = {"True": "true", "False": "false", "None": "null"}


def _import(file: Path) -> ModuleType:
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:10]
    module_name = f"autoddl_model_{_identifier(file.stem)}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"{file}: cannot be imported as a Python module (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ModelFileError(f"{file}: importing the file failed: {type(exc).__name__}: {exc}") from exc
    return module


def _optional(module: ModuleType, file: Path, name: str) -> Callable[..., Any] | None:
    fn = getattr(module, name, None)
    if fn is not None and not callable(fn):
        raise ModelFileError(f"{file}: {name} is a {type(fn).__name__}, expected a function `{_SIGNATURES[name]}`")
    return fn


def _identifier(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


def _required(module: ModuleType, file: Path, name: str) -> Callable[..., Any]:
    fn = getattr(module, name, None)
    if fn is None:
        raise ModelFileError(f"{file}: model file defines no {name}(); expected a function "
                             f"`{_SIGNATURES[name]}`")
    if not callable(fn):
        raise ModelFileError(f"{file}: {name} is a {type(fn).__name__}, expected a function "
                             f"`{_SIGNATURES[name]}`")
    return fn


def _accepted(fn: Callable[..., Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``overrides`` that ``fn`` takes by keyword (all of them with ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return dict(overrides)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(overrides)
    names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                   inspect.Parameter.KEYWORD_ONLY)}
    return {k: v for k, v in overrides.items() if k in names}


def _check_overrides(file: Path, overrides: dict[str, Any], *fns: Callable[..., Any]) -> None:
    """Every override must be taken by at least one of the functions, else it is a typo."""
    used = set().union(*(_accepted(fn, overrides) for fn in fns)) if fns else set()
    unknown = sorted(set(overrides) - used)
    if unknown:
        accepted = sorted({p for fn in fns for p in _parameter_names(fn)})
        names = [f"{getattr(fn, '__name__', 'function')}()" for fn in fns]
        which = " nor ".join(names) if len(names) <= 2 else f"none of {', '.join(names)}"
        raise ModelFileError(f"{file}: {'neither ' if len(names) == 2 else ''}{which} takes "
                             f"{', '.join(repr(k) for k in unknown)}; they accept: "
                             f"{', '.join(accepted) or 'no keyword arguments'}")


def _parameter_names(fn: Callable[..., Any]) -> list[str]:
    try:
        return [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        return []


def _call(file: Path, name: str, fn: Callable[..., Any], overrides: dict[str, Any]) -> Any:
    kwargs = _accepted(fn, overrides)
    try:
        return fn(**kwargs)
    except Exception as exc:
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ModelFileError(f"{file}: {name}({args}) raised {type(exc).__name__}: {exc}") from exc


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flatten(v)]
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flatten(v)]
    return [value]
