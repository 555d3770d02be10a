"""A TrainerConfig as Megatron-LM command-line flags, and back.

Every flag below is Megatron-LM's own, checked against NVIDIA/Megatron-LM at commit
d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22). Many flags are generated from config dataclass
fields (``ArgumentGroupFactory``: ``--`` + the field name with ``_`` -> ``-``,
megatron/training/argument_utils.py); FLAGS says where each one is defined. The user documentation at
that commit uses the same flags: docs/user-guide/parallelism-guide.md (tensor, pipeline, virtual
pipeline, sequence parallel, batch sizes, --use-distributed-optimizer) and
docs/user-guide/features/megatron_fsdp.md (--use-megatron-fsdp, --data-parallel-sharding-strategy
no_shard / optim / optim_grads / optim_grads_params = DDP / ZeRO-1 / ZeRO-2 / ZeRO-3). Semantics used here:

- The data-parallel size is not a flag: it is the world size / (tensor x pipeline x context sizes).
- --global-batch-size defaults to micro-batch size x data-parallel size (one micro-batch per step);
  a larger one is gradient accumulation, and under pipeline parallelism the micro-batches are the
  pipeline's (megatron/training/config/training_config.py).
- --bf16 reduces gradients in fp32 unless --grad-reduce-in-bf16; --fp16 in fp16 unless
  --accumulate-allreduce-grads-in-fp32 (validate_args in megatron/training/arguments.py).
- --use-distributed-optimizer shards optimizer states over data-parallel ranks (ZeRO-1); Megatron-FSDP
  (--use-megatron-fsdp) shards by --data-parallel-sharding-strategy: optim (ZeRO-1), optim_grads (ZeRO-2),
  optim_grads_params (ZeRO-3, the default); --use-torch-fsdp2 is FSDP2 (ZeRO-3).
- --recompute-granularity selective recomputes the modules of --recompute-modules (default core_attn)
  where autoddl prices torchtitan's per-op policy (matmul outputs kept but every second mm); full with --recompute-method
  uniform recomputes every layer.
"""

from __future__ import annotations

import shlex

from autoddl.trainers import TrainerConfig, TrainerConfigError, check_devices, leftover, positive_int

REPO = "NVIDIA/Megatron-LM @ d98e8a64ddf34856e74b24714e3bedb2f5a39553"
_MPC = "megatron/core/model_parallel_config.py ModelParallelConfig (flags via ArgumentGroupFactory(TransformerConfig))"
_TC = "megatron/core/transformer/transformer_config.py TransformerConfig (flags via ArgumentGroupFactory)"
_TRAIN = "megatron/training/config/training_config.py TrainingConfig (flags via ArgumentGroupFactory)"
_ARGS = "megatron/training/arguments.py (group.add_argument)"
_COMMON = "megatron/training/config/common_config.py (flags via ArgumentGroupFactory)"
FLAGS: dict[str, tuple[str, bool]] = {     # flag -> (where Megatron-LM defines it, takes a value)
    "--tensor-model-parallel-size": (_MPC, True),
    "--pipeline-model-parallel-size": (_MPC, True),
    "--sequence-parallel": (_MPC, False),
    "--bf16": (_MPC, False),
    "--fp16": (_MPC, False),
    "--context-parallel-size": (_MPC, True),
    "--expert-model-parallel-size": (_MPC, True),
    "--recompute-granularity": (_TC, True),
    "--recompute-method": (_TC, True),
    "--recompute-num-layers": (_TC, True),
    "--num-layers": (_TC, True),
    "--micro-batch-size": (_TRAIN, True),
    "--global-batch-size": (_TRAIN, True),
    "--num-layers-per-virtual-pipeline-stage": (_ARGS, True),
    "--num-virtual-stages-per-pipeline-rank": (_ARGS, True),
    "--use-distributed-optimizer": (_ARGS, False),
    "--data-parallel-sharding-strategy": (_ARGS, True),
    "--grad-reduce-in-bf16": (_ARGS, False),
    "--accumulate-allreduce-grads-in-fp32": (_ARGS, False),
    "--recompute-activations": (_ARGS, False),
    "--seq-length": (_ARGS, True),
    "--use-megatron-fsdp": (_COMMON, False),
    "--use-torch-fsdp2": (_COMMON, False),
}
SHARDING = {"optim": 1, "optim_grads": 2}      # --data-parallel-sharding-strategy -> ZeRO stage over dp


def to_megatron(config: TrainerConfig, header: list[str] = ()) -> str:
    """The flags, one per line (a shell continuation between them), ``header`` lines first as comments."""
    flags = megatron_flags(config)
    lines = [f"# {h}" for h in header]
    return "\n".join(lines + [" \\\n".join(flags)]) + "\n"


def megatron_flags(config: TrainerConfig) -> list[str]:
    """The Megatron-LM flags of ``config``; TrainerConfigError for what Megatron cannot express."""
    if config.dp > 1 and config.fsdp > 1:
        raise TrainerConfigError(f"Megatron-LM flags cannot express {config.describe()}: replicated and sharded "
                                 "data parallel at once (HSDP)")
    out = [f"--tensor-model-parallel-size {config.tp}", f"--pipeline-model-parallel-size {config.pp}"]
    out += _pipeline_flags(config)
    out += ["--sequence-parallel"] if config.sequence_parallel else []
    if config.micro_batch_size is not None:
        out.append(f"--micro-batch-size {config.micro_batch_size}")
    if config.global_batch_size is not None:
        out.append(f"--global-batch-size {config.global_batch_size}")
    if config.seq_len is not None:
        out.append(f"--seq-length {config.seq_len}")
    if config.num_layers is not None:
        out.append(f"--num-layers {config.num_layers}")
    out += _precision_flags(config)
    if config.recompute_every > 1:
        raise TrainerConfigError(f"Megatron-LM flags cannot express full recompute of every "
                                 f"{config.recompute_every}-th layer (--recompute-method is uniform or block)")
    if config.recompute == "selective":
        out.append("--recompute-granularity selective")
    elif config.recompute == "full":
        out += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    if config.zero == 1:
        out.append("--use-distributed-optimizer")
    elif config.zero == 2:
        out += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads"]
    elif config.fsdp > 1:
        out += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params"]
    return out


def _pipeline_flags(config: TrainerConfig) -> list[str]:
    if config.pp == 1:
        return []
    if config.schedule not in ("1F1B", "Interleaved1F1B"):
        raise TrainerConfigError(f"Megatron-LM flags cannot express pipeline schedule {config.schedule}: it runs "
                                 "1F1B, interleaved with virtual stages")
    if config.virtual_stages == 1:
        return []
    if config.num_layers is not None and config.num_layers % (config.pp * config.virtual_stages) == 0:
        return [f"--num-layers-per-virtual-pipeline-stage {config.num_layers // (config.pp * config.virtual_stages)}"]
    return [f"--num-virtual-stages-per-pipeline-rank {config.virtual_stages}"]


def _precision_flags(config: TrainerConfig) -> list[str]:
    precision, reduce = config.precision, config.reduce_dtype
    if precision == "fp32":
        if reduce != "fp32":
            raise TrainerConfigError(f"Megatron-LM flags cannot express fp32 training with gradients reduced "
                                     f"in {reduce}")
        return []
    if reduce not in ("fp32", precision):
        raise TrainerConfigError(f"Megatron-LM flags cannot express {precision} with gradients reduced in {reduce}")
    if precision == "bf16":
        return ["--bf16"] + (["--grad-reduce-in-bf16"] if reduce == "bf16" else [])
    return ["--fp16"] + (["--accumulate-allreduce-grads-in-fp32"] if reduce == "fp32" else [])


def parse_flags(text: str, source: str = "--from-megatron") -> tuple[dict[str, str | bool], list[str]]:
    """(known flag -> value or True, the other flags, which do not bear on the plan) of a command line;
    ``#`` comment lines and shell continuations are skipped."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    try:
        tokens = shlex.split(" ".join(lines).replace("\\ ", " "))
    except ValueError as exc:
        raise TrainerConfigError(f"{source}: cannot split the flags: {exc}") from None
    known: dict[str, str | bool] = {}
    other: list[str] = []
    i = 0
    while i < len(tokens):
        flag, eq, value = tokens[i].partition("=")
        i += 1
        if not flag.startswith("--"):
            continue                                  # a script name or an unknown flag's value
        if flag not in FLAGS:
            other.append(flag)
            continue
        if not FLAGS[flag][1]:
            known[flag] = True
            continue
        if not eq:
            if i >= len(tokens) or tokens[i].startswith("--"):
                raise TrainerConfigError(f"{source}: {flag} needs a value")
            value, i = tokens[i], i + 1
        known[flag] = value
    return known, other


def from_megatron(text: str, *, devices: int | None = None, num_layers: int | None = None,
                  source: str = "--from-megatron") -> tuple[TrainerConfig, list[str]]:
    """(the TrainerConfig of Megatron-LM flags, the flags that were not read). ``devices`` gives the
    data-parallel size (world / (tp x pp)); errors name the flag."""
    f, other = parse_flags(text, source)

    def num(flag: str, default: int | None) -> int | None:
        return default if flag not in f else positive_int(f[flag], flag, source)

    for flag in ("--context-parallel-size", "--expert-model-parallel-size"):
        if num(flag, 1) != 1:
            raise TrainerConfigError(f"{source}: {flag} {f[flag]}: autoddl does not price context or expert "
                                     "parallelism; drop it to price the rest")
    tp, pp = num("--tensor-model-parallel-size", 1), num("--pipeline-model-parallel-size", 1)
    num_layers = num("--num-layers", num_layers)
    data = leftover(devices, tp * pp, "the data-parallel size (world / (tensor x pipeline sizes))", source,
                    f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}")
    sharding = _sharding(f, source)
    fsdp = data if sharding == 3 else 1
    config = TrainerConfig(dp=data // fsdp, fsdp=fsdp, tp=tp, pp=pp, zero=sharding if sharding in (1, 2) and data > 1
                           else 0, sequence_parallel=bool(f.get("--sequence-parallel")) and tp > 1,
                           **_precision(f, source), **_recompute(f, num_layers, pp, source),
                           micro_batch_size=num("--micro-batch-size", None),
                           global_batch_size=num("--global-batch-size", None), seq_len=num("--seq-length", None),
                           num_layers=num_layers, **_virtual(f, num, num_layers, pp, source))
    check_devices(config, devices, source)
    return config, other


def _sharding(f: dict, source: str) -> int:
    """ZeRO stage over the data-parallel ranks: 0, 1, 2 or 3 (parameters too)."""
    if f.get("--use-torch-fsdp2"):
        return 3
    if f.get("--use-megatron-fsdp"):
        strategy = f.get("--data-parallel-sharding-strategy", "optim_grads_params")
        stages = {"no_shard": 0, **SHARDING, "optim_grads_params": 3}
        if strategy not in stages:
            raise TrainerConfigError(f"{source}: --data-parallel-sharding-strategy {strategy}: Megatron takes "
                                     f"{list(stages)}")
        return stages[strategy]
    return 1 if f.get("--use-distributed-optimizer") else 0


def _precision(f: dict, source: str) -> dict[str, str]:
    if f.get("--bf16") and f.get("--fp16"):
        raise TrainerConfigError(f"{source}: --bf16 and --fp16 together; give one")
    if f.get("--bf16"):
        return {"precision": "bf16", "reduce_dtype": "bf16" if f.get("--grad-reduce-in-bf16") else "fp32"}
    if f.get("--fp16"):
        fp32 = f.get("--accumulate-allreduce-grads-in-fp32")
        return {"precision": "fp16", "reduce_dtype": "fp32" if fp32 else "fp16"}
    return {"precision": "fp32", "reduce_dtype": "fp32"}


def _recompute(f: dict, num_layers: int | None, pp: int, source: str) -> dict[str, str]:
    granularity = f.get("--recompute-granularity", "selective" if f.get("--recompute-activations") else None)
    if granularity is None:
        return {"recompute": "none"}
    if granularity not in ("selective", "full"):
        raise TrainerConfigError(f"{source}: --recompute-granularity {granularity}: Megatron takes selective or full")
    if granularity == "selective":
        return {"recompute": "selective"}
    method = f.get("--recompute-method")
    if method == "uniform":
        return {"recompute": "full"}
    if method == "block":
        layers = positive_int(f.get("--recompute-num-layers"), "--recompute-num-layers", source)
        if num_layers is not None and layers * pp >= num_layers:
            return {"recompute": "full"}
        raise TrainerConfigError(f"{source}: --recompute-method block --recompute-num-layers {layers}: recomputing "
                                 "only the first layers of each stage is not priced; use uniform")
    raise TrainerConfigError(f"{source}: --recompute-granularity full needs --recompute-method uniform or block")


def _virtual(f: dict, num, num_layers: int | None, pp: int, source: str) -> dict[str, object]:
    if pp == 1:
        return {}
    virtual = num("--num-virtual-stages-per-pipeline-rank", None)
    per_stage = num("--num-layers-per-virtual-pipeline-stage", None)
    if per_stage is not None:
        if num_layers is None or num_layers % (per_stage * pp):
            raise TrainerConfigError(f"{source}: --num-layers-per-virtual-pipeline-stage {per_stage} on {pp} "
                                     f"stages: the model's {num_layers} layers (--num-layers) do not make whole "
                                     "virtual stages per rank")
        virtual = num_layers // (per_stage * pp)
    virtual = virtual or 1
    return {"virtual_stages": virtual, "schedule": "Interleaved1F1B" if virtual > 1 else "1F1B"}
