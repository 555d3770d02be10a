"""Pricing trainer configurations, and the best plan a trainer can express.

A ``TrainerConfig`` (autoddl/trainers) is priced as the expert configuration of its degrees
(``price_config``: the one call into ``search.planner.price_degrees``). ``structured_configs``
lists a trainer's structured space on a cluster: every split of the devices into pipeline stages
(outermost, at most one per repeated block; 1F1B, or interleaved 1F1B with 2 stages per rank), a
data-parallel part (replicated, sharded, both, with the trainer's ZeRO stages) and a tensor-parallel
degree that stays inside a node, with and without sequence parallel as the trainer allows
(search/meshes.py ``role_splits``); ``best_config`` prices each and keeps the fastest that fits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from autoddl.cluster import Cluster
from autoddl.graph import OpGraph
from autoddl.trainers import TrainerConfig, TrainerConfigError
from autoddl.training import RECOMPUTE_POLICIES, Training
from search.meshes import divisors, inner_axis_in_node, role_splits
from search.planner import PlanningError, Scheme, price_degrees, recompute_blocks

TRAINERS = ("torchtitan", "megatron")
# torch.distributed.pipelining's schedule names (as the trainers take them) -> the schedules autoddl prices
PRICED_SCHEDULES = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved"}
# the schedules the structured space tries (search/pipeline_search.py's reason: GPipe has 1F1B's bubble
# and holds more micro-batches in flight, never better), with their virtual stages per rank
PIPELINE_SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2))


def price_config(graph: OpGraph, cluster: Cluster, config: TrainerConfig, *, base: Training | None = None,
                 name: str = "", memory_gb: float | None = None, optimizer: str = "adamw") -> Scheme:
    """``config`` priced by the full cost model as its ``--degrees`` expert plan, under its precision
    and recompute; ``base`` gives the rest (micro-steps, buckets). ``graph`` is traced at the
    configuration's micro-step batch and precision. The scheme is named ``name``."""
    check_priceable(config)
    base = base or Training()
    training = dataclasses.replace(config.training(recompute_blocks(graph), bucket_mb=base.bucket_mb),
                                   micro_batches=base.micro_batches)
    scheme = price_degrees(graph, cluster, config.degrees(), model_name=graph.model_name, memory_gb=memory_gb,
                           optimizer=optimizer, training=training, zero=config.zero,
                           schedule=PRICED_SCHEDULES.get(config.schedule, "1f1b"),
                           virtual_stages=config.virtual_stages)
    if name:
        scheme.plan.notes = [n.replace("the configuration given by --degrees", f"{name}, as --degrees")
                             for n in scheme.plan.notes]
        scheme.name = name
    return scheme


def check_priceable(config: TrainerConfig) -> None:
    """Raises PlanningError for what ``price_config`` cannot price (pipeline schedules autoddl has not)."""
    if config.pp > 1 and config.schedule not in PRICED_SCHEDULES:
        raise PlanningError(f"{config.describe()}: pipeline schedule {config.schedule} is not one autoddl prices; "
                            f"use one of {', '.join(PRICED_SCHEDULES)}")


def structured_configs(trainer: str, cluster: Cluster, settings: TrainerConfig,
                       max_pp: int = 1) -> list[TrainerConfig]:
    """``trainer``'s structured configurations on ``cluster`` (module docstring), each with
    ``settings``'s precision, recompute and batch sizes (its degrees are ignored); pipeline degrees
    up to ``max_pp`` (the model's repeated blocks: at most one stage per block)."""
    if trainer not in TRAINERS:
        raise ValueError(f"trainer {trainer!r}: choose one of {list(TRAINERS)}")
    per_node = cluster.devices_per_node
    out = []
    for pp, data, tp in role_splits(cluster.num_devices, per_node, max_pp):
        for dp in divisors(data):
            if not inner_axis_in_node((pp, dp, data // dp, tp), per_node):
                continue                               # replicated outside sharded: the inner one in a node
            for zero in _zero_stages(trainer, dp, data // dp):
                for sp in _sequence_parallel(trainer, tp):
                    for schedule, v in PIPELINE_SCHEDULES if pp > 1 else ((None, 1),):
                        out.append(dataclasses.replace(settings, dp=dp, fsdp=data // dp, tp=tp, pp=pp, zero=zero,
                                                       sequence_parallel=sp, schedule=schedule, virtual_stages=v))
    return out


def _zero_stages(trainer: str, dp: int, fsdp: int) -> tuple[int, ...]:
    if trainer == "torchtitan" or dp == 1:
        return (0,)                                    # torchtitan shards with FSDP only
    return (0, 1, 2) if fsdp == 1 else ()              # Megatron: no replicated x sharded (HSDP) flags


def _sequence_parallel(trainer: str, tp: int) -> tuple[bool, ...]:
    if tp == 1:
        return (False,)
    return (True,) if trainer == "torchtitan" else (False, True)


def recompute_variants(config: TrainerConfig, recompute: str) -> list[TrainerConfig]:
    """``config`` under ``recompute``, or under each policy for ``auto`` (a trainer takes one)."""
    policies = RECOMPUTE_POLICIES if recompute == "auto" else (recompute,)
    return [dataclasses.replace(config, recompute=p, recompute_every=1) for p in policies]


@dataclass
class Priced:
    config: TrainerConfig
    scheme: Scheme | None
    reason: str = ""                                   # why it was not priced


def best_config(configs: list[TrainerConfig], price: Callable[[TrainerConfig], Scheme],
                expressible: Callable[[TrainerConfig], object]) -> tuple[Priced | None, list[Priced]]:
    """(the fastest configuration that fits, else the fastest; every one tried). A configuration
    ``expressible`` rejects (TrainerConfigError) or that does not apply (PlanningError) is kept
    with the reason."""
    tried = []
    for config in configs:
        try:
            expressible(config)
            tried.append(Priced(config, price(config)))
        except (TrainerConfigError, PlanningError) as exc:
            tried.append(Priced(config, None, str(exc)))
    priced = [p for p in tried if p.scheme is not None]
    fitting = [p for p in priced if p.scheme.breakdown.fits_memory] or priced
    best = min(fitting, key=lambda p: p.scheme.step_time_s, default=None)
    return best, tried


def same_plan(a, b) -> bool:
    """Two plans with the same mesh, signatures and storages (ZeRO ones included)."""
    return (a.mesh.shape == b.mesh.shape and a.signatures == b.signatures and a.param_storage == b.param_storage
            and a.optimizer_storage == b.optimizer_storage and a.grad_storage == b.grad_storage)


def slower(config_s: float, found_s: float) -> float:
    return config_s / found_s if found_s > 0 else math.inf
