"""A TrainerConfig as torchtitan job-config TOML, and back.

Every section and key below is torchtitan's own, checked against its source:

    pytorch/torchtitan, torchtitan/config/job_config.py at commit e347b1e5e6b6941d789d16d340145294d82dc71e
    (2026-02-15): classes Training, Parallelism and ActivationCheckpoint, the sections [training],
    [parallelism] and [activation_checkpoint] of a job TOML. That is the last version that reads TOML
    job configs (``--job.config_file``); #2386 then moved configurations to Python functions whose
    ``ParallelismConfig`` / ``TrainingConfig`` fields keep the names of [parallelism] and
    [training] (torchtitan/config/configs.py), and the same names are its ``--section.option`` flags.
    Its docs at that commit use the same keys (docs/debugging.md, docs/converging.md).
    Semantics used here (same file, and torchtitan/distributed/activation_checkpoint.py,
    torchtitan/models/llama3/infra/parallelize.py at that commit):
    - local_batch_size is per data-parallel rank; global_batch_size -1 means local x dp degree, a larger
      one is reached by gradient accumulation; with pipeline_parallel_degree > 1, local_batch_size is
      split into micro-batches of pipeline_parallel_microbatch_size.
    - data_parallel_shard_degree -1 takes the ranks the other degrees leave (FSDP); with
      data_parallel_replicate_degree > 1 too it is HSDP.
    - tensor parallel always applies SequenceParallel to the norms (apply_tp), so tp > 1 is sequence parallel.
    - mixed_precision_param is "bfloat16" | "float32"; mixed_precision_reduce only "float32".
    - activation_checkpoint.mode "selective" with selective_ac_option "op" is the per-op policy (save
      matmul outputs but every second mm); a number n checkpoints every n-th layer in full (``_layer_sac_count % n == 0``).
"""

from __future__ import annotations

import tomllib

from autoddl.trainers import TrainerConfig, TrainerConfigError, check_devices, leftover, positive_int

SOURCE = ("pytorch/torchtitan torchtitan/config/job_config.py @ e347b1e5e6b6941d789d16d340145294d82dc71e "
          "(the last TOML job config; the names live on in torchtitan/config/configs.py)")

KEYS: dict[tuple[str, str], object] = {         # (section, key) -> torchtitan's default (job_config.py)
    ("training", "local_batch_size"): 8,
    ("training", "global_batch_size"): -1,
    ("training", "seq_len"): 2048,
    ("training", "dtype"): "float32",
    ("training", "mixed_precision_param"): "bfloat16",
    ("training", "mixed_precision_reduce"): "float32",
    ("parallelism", "data_parallel_replicate_degree"): 1,
    ("parallelism", "data_parallel_shard_degree"): -1,
    ("parallelism", "tensor_parallel_degree"): 1,
    ("parallelism", "pipeline_parallel_degree"): 1,
    ("parallelism", "pipeline_parallel_schedule"): "1F1B",
    ("parallelism", "pipeline_parallel_layers_per_stage"): None,
    ("parallelism", "pipeline_parallel_microbatch_size"): 1,
    ("parallelism", "context_parallel_degree"): 1,
    ("parallelism", "expert_parallel_degree"): 1,
    ("activation_checkpoint", "mode"): "selective",
    ("activation_checkpoint", "selective_ac_option"): "2",
}
MUST_BE_DEFAULT = {                              # keys autoddl cannot price away from their default
    ("training", "dtype"): "training in bfloat16 without float32 master weights",
    ("parallelism", "context_parallel_degree"): "context parallelism",
    ("parallelism", "expert_parallel_degree"): "expert parallelism",
}
DTYPE = {"fp32": "float32", "bf16": "bfloat16"}   # mixed_precision_param's Literal; fp16 has none
AC_MODES = ("none", "selective", "full")          # and "memory_budget" (compiler-chosen): not priced


def to_torchtitan(config: TrainerConfig, header: list[str] = ()) -> str:
    """The [training], [parallelism] and [activation_checkpoint] sections of a job TOML, ``header``
    lines first as comments. Raises TrainerConfigError for what torchtitan cannot express."""
    _check_expressible(config)
    training: dict[str, object] = {}
    if config.pp > 1:         # one step's samples per dp rank, split into pipeline micro-batches
        if config.micro_batch_size is not None:
            training["local_batch_size"] = config.micro_batch_size * config.micro_steps()
    elif config.micro_batch_size is not None:
        training["local_batch_size"] = config.micro_batch_size
    if config.global_batch_size is not None:
        training["global_batch_size"] = config.global_batch_size
    if config.seq_len is not None:
        training["seq_len"] = config.seq_len
    training["mixed_precision_param"] = DTYPE[config.precision]
    training["mixed_precision_reduce"] = "float32"
    parallelism: dict[str, object] = {"data_parallel_replicate_degree": config.dp,
                                      "data_parallel_shard_degree": config.fsdp,
                                      "tensor_parallel_degree": config.tp, "pipeline_parallel_degree": config.pp}
    if config.pp > 1:
        parallelism["pipeline_parallel_schedule"] = config.schedule
        if config.micro_batch_size is not None:
            parallelism["pipeline_parallel_microbatch_size"] = config.micro_batch_size
        if config.virtual_stages > 1:
            parallelism["pipeline_parallel_layers_per_stage"] = _layers_per_stage(config)
    ac: dict[str, object] = {"mode": config.recompute}
    if config.recompute == "selective":
        ac["selective_ac_option"] = "op"
    elif config.recompute == "full" and config.recompute_every > 1:
        ac = {"mode": "selective", "selective_ac_option": str(config.recompute_every)}
    lines = [f"# {h}" for h in header]
    for name, section in (("training", training), ("parallelism", parallelism), ("activation_checkpoint", ac)):
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in section.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


def _check_expressible(config: TrainerConfig) -> None:
    why = []
    if config.zero:
        why.append(f"ZeRO-{config.zero} over replicated data parallel (torchtitan shards with FSDP: "
                   "data_parallel_shard_degree)")
    if config.precision not in DTYPE:
        why.append(f"precision {config.precision} (mixed_precision_param is bfloat16 or float32)")
    if config.reduce_dtype != "fp32":
        why.append(f"gradients reduced in {config.reduce_dtype} (mixed_precision_reduce is float32 only)")
    if config.tp > 1 and not config.sequence_parallel:
        why.append("tensor parallel without sequence parallel (torchtitan's tensor parallel always applies it)")
    if why:
        raise TrainerConfigError(f"torchtitan cannot express {config.describe()}: " + "; ".join(why))


def _layers_per_stage(config: TrainerConfig) -> int:
    stages = config.pp * config.virtual_stages
    if config.num_layers is None or config.num_layers % stages:
        raise TrainerConfigError(f"pipeline_parallel_layers_per_stage: {config.virtual_stages} virtual stages "
                                 f"on {config.pp} ranks need a layer count that {stages} divides "
                                 f"(the model has {config.num_layers})")
    return config.num_layers // stages


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def from_torchtitan(text: str, *, devices: int | None = None, num_layers: int | None = None,
                    source: str = "job.toml") -> TrainerConfig:
    """The TrainerConfig of a torchtitan job TOML (missing keys take torchtitan's defaults, KEYS).
    ``devices`` resolves data_parallel_shard_degree -1; ``num_layers`` resolves
    pipeline_parallel_layers_per_stage. Errors name the section and key."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TrainerConfigError(f"{source}: not valid TOML: {exc}") from None

    def get(section: str, key: str):
        table = doc.get(section, {})
        if not isinstance(table, dict):
            raise TrainerConfigError(f"{source}: [{section}] must be a table")
        return table.get(key, KEYS[(section, key)])

    for (section, key), what in MUST_BE_DEFAULT.items():
        if get(section, key) != KEYS[(section, key)]:
            raise TrainerConfigError(f"{source}: {section}.{key} = {get(section, key)!r}: autoddl does not price "
                                     f"{what}; set it to {KEYS[(section, key)]!r} to price the rest")
    degrees = _degrees(get, devices, source)
    pp = degrees["pp"]
    local = positive_int(get("training", "local_batch_size"), "training.local_batch_size", source)
    global_batch = get("training", "global_batch_size")
    global_batch = None if global_batch == -1 else positive_int(global_batch, "training.global_batch_size", source)
    micro = local
    if pp > 1:
        micro = positive_int(get("parallelism", "pipeline_parallel_microbatch_size"),
                             "parallelism.pipeline_parallel_microbatch_size", source)
        global_batch = global_batch or local * degrees["dp"] * degrees["fsdp"]
    recompute, every = _recompute(get, source)
    config = TrainerConfig(**degrees, sequence_parallel=degrees["tp"] > 1, precision=_precision(get, source),
                           reduce_dtype="fp32", recompute=recompute, recompute_every=every,
                           micro_batch_size=micro, global_batch_size=global_batch,
                           seq_len=positive_int(get("training", "seq_len"), "training.seq_len", source),
                           num_layers=num_layers, **_pipeline(get, pp, num_layers, source))
    check_devices(config, devices, source)
    return config


def _degrees(get, devices: int | None, source: str) -> dict[str, int]:
    names = {"dp": "data_parallel_replicate_degree", "tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree"}
    out = {role: positive_int(get("parallelism", key), f"parallelism.{key}", source) for role, key in names.items()}
    shard = get("parallelism", "data_parallel_shard_degree")
    others = " x ".join(f"{names[r]} {out[r]}" for r in names)
    out["fsdp"] = (leftover(devices, out["dp"] * out["tp"] * out["pp"], "parallelism.data_parallel_shard_degree = -1",
                            source, others) if shard == -1 else
                   positive_int(shard, "parallelism.data_parallel_shard_degree", source))
    return out


def _precision(get, source: str) -> str:
    param = get("training", "mixed_precision_param")
    reduce = get("training", "mixed_precision_reduce")
    by_dtype = {v: k for k, v in DTYPE.items()}
    if param not in by_dtype:
        raise TrainerConfigError(f"{source}: training.mixed_precision_param = {param!r}: torchtitan takes "
                                 f"{sorted(by_dtype)}")
    if reduce != "float32":
        raise TrainerConfigError(f"{source}: training.mixed_precision_reduce = {reduce!r}: torchtitan takes 'float32'")
    return by_dtype[param]


def _recompute(get, source: str) -> tuple[str, int]:
    mode = get("activation_checkpoint", "mode")
    if mode not in AC_MODES:
        raise TrainerConfigError(f"{source}: activation_checkpoint.mode = {mode!r}: autoddl prices "
                                 f"{list(AC_MODES)} (memory_budget leaves the choice to the compiler)")
    if mode != "selective":
        return mode, 1
    option = str(get("activation_checkpoint", "selective_ac_option"))
    if option == "op":
        return "selective", 1
    if not option.isdigit():
        raise TrainerConfigError(f"{source}: activation_checkpoint.selective_ac_option = {option!r}: 'op' or a "
                                 "layer frequency n (every n-th layer checkpointed in full)")
    n = int(option)
    return ("full", 1) if n <= 1 else ("full", n)     # 0 or 1: every layer (torchtitan: `not ac_freq or ...`)


def _pipeline(get, pp: int, num_layers: int | None, source: str) -> dict[str, object]:
    if pp == 1:
        return {}
    schedule = get("parallelism", "pipeline_parallel_schedule")
    per_stage = get("parallelism", "pipeline_parallel_layers_per_stage")
    virtual = 1
    if per_stage is not None:
        per_stage = positive_int(per_stage, "parallelism.pipeline_parallel_layers_per_stage", source)
        if num_layers is None or num_layers % (per_stage * pp):
            raise TrainerConfigError(f"{source}: parallelism.pipeline_parallel_layers_per_stage = {per_stage} on "
                                     f"{pp} ranks: the model's {num_layers} layers do not make whole stages per rank")
        virtual = num_layers // (per_stage * pp)
    elif schedule not in ("1F1B", "GPipe"):
        raise TrainerConfigError(f"{source}: parallelism.pipeline_parallel_schedule = {schedule!r} runs several "
                                 "stages per rank: give parallelism.pipeline_parallel_layers_per_stage too")
    return {"schedule": schedule, "virtual_stages": virtual}
