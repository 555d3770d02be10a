"""Plans in torchtitan's and Megatron-LM's terms (issue 15): TrainerConfig written as torchtitan job
TOML and Megatron-LM flags and read back, the emitted names against the projects' documented ones,
the structured space, and ``autoddl plan --emit / --from-torchtitan / --from-megatron`` on tiny gpt."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from autoddl.cli import main
from autoddl.trainers import TrainerConfig, TrainerConfigError
from autoddl.trainers.formats import read_config, write_config
from autoddl.trainers.megatron import FLAGS, from_megatron, megatron_flags
from autoddl.trainers.torchtitan import KEYS, from_torchtitan
from search.expressible import price_config, structured_configs
from search.planner import PlanningError
from clusters import CPU_CLUSTER_PATH

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"
LOCAL = CPU_CLUSTER_PATH

# the names as torchtitan's job_config.py (e347b1e5e) and Megatron-LM's sources (d98e8a64d) spell them,
# copied here by hand so that a typo in the code's tables fails
TORCHTITAN_DOCUMENTED = {
    "training": {"local_batch_size", "global_batch_size", "seq_len", "dtype", "mixed_precision_param",
                 "mixed_precision_reduce"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                    "pipeline_parallel_degree", "pipeline_parallel_schedule", "pipeline_parallel_layers_per_stage",
                    "pipeline_parallel_microbatch_size", "context_parallel_degree", "expert_parallel_degree"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
}
MEGATRON_DOCUMENTED = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank", "--sequence-parallel", "--micro-batch-size", "--global-batch-size",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-activations", "--bf16",
    "--fp16", "--use-distributed-optimizer", "--use-megatron-fsdp", "--use-torch-fsdp2",
    "--data-parallel-sharding-strategy", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32",
    "--seq-length", "--num-layers", "--context-parallel-size", "--expert-model-parallel-size",
}

BOTH = [   # configurations both trainers express
    TrainerConfig(dp=8, micro_batch_size=2, global_batch_size=64, seq_len=1024, num_layers=12),
    TrainerConfig(fsdp=8, precision="bf16", reduce_dtype="fp32", recompute="selective", micro_batch_size=1,
                  global_batch_size=8, seq_len=8192, num_layers=32),
    TrainerConfig(fsdp=4, tp=2, sequence_parallel=True, precision="bf16", reduce_dtype="fp32", recompute="full",
                  micro_batch_size=2, global_batch_size=32, seq_len=2048, num_layers=24),
    TrainerConfig(pp=2, fsdp=2, tp=2, sequence_parallel=True, precision="bf16", reduce_dtype="fp32",
                  micro_batch_size=1, global_batch_size=16, seq_len=2048, num_layers=8, virtual_stages=2),
    TrainerConfig(pp=4, dp=2, micro_batch_size=1, global_batch_size=32, seq_len=512, num_layers=8),
]
TORCHTITAN_ONLY = [
    TrainerConfig(dp=2, fsdp=4, precision="bf16", reduce_dtype="fp32", recompute="full", recompute_every=2,
                  micro_batch_size=4, global_batch_size=32, seq_len=4096, num_layers=16),
    TrainerConfig(pp=2, fsdp=4, schedule="GPipe", micro_batch_size=2, global_batch_size=64, seq_len=2048,
                  num_layers=4),
]
MEGATRON_ONLY = [
    TrainerConfig(dp=4, tp=2, zero=1, precision="fp16", reduce_dtype="fp16", recompute="selective",
                  micro_batch_size=1, global_batch_size=16, seq_len=2048, num_layers=24),
    TrainerConfig(dp=4, tp=2, zero=2, precision="bf16", reduce_dtype="bf16", micro_batch_size=2,
                  global_batch_size=8, seq_len=1024, num_layers=24),
    TrainerConfig(dp=2, tp=4, precision="fp16", reduce_dtype="fp32", micro_batch_size=1, global_batch_size=2,
                  seq_len=1024, num_layers=24),
]


# -- round trips -----------------------------------------------------------------------------------

@pytest.mark.parametrize("config", BOTH + TORCHTITAN_ONLY, ids=lambda c: c.describe())
def test_torchtitan_round_trip(config):
    text = write_config("torchtitan", config, ["a header line"])
    assert text.startswith("# a header line\n")
    back, ignored = read_config("torchtitan", text, devices=config.devices, num_layers=config.num_layers)
    assert back == config and ignored == []


@pytest.mark.parametrize("config", BOTH + MEGATRON_ONLY, ids=lambda c: c.describe())
def test_megatron_round_trip(config):
    text = write_config("megatron", config, ["a header line"])
    back, ignored = read_config("megatron", text, devices=config.devices)
    assert back == config and ignored == []


@pytest.mark.parametrize("config, why", [
    (MEGATRON_ONLY[0], "ZeRO-1 over replicated data parallel"),
    (MEGATRON_ONLY[0], "precision fp16"),
    (MEGATRON_ONLY[1], "gradients reduced in bf16"),
    (TrainerConfig(dp=2, tp=4), "tensor parallel without sequence parallel"),
])
def test_torchtitan_refuses_what_it_cannot_express(config, why):
    with pytest.raises(TrainerConfigError, match=re.escape(why)):
        write_config("torchtitan", config)


@pytest.mark.parametrize("config, why", [
    (TORCHTITAN_ONLY[0], "replicated and sharded data parallel at once"),
    (TORCHTITAN_ONLY[1], "pipeline schedule GPipe"),
    (TrainerConfig(dp=8, recompute="full", recompute_every=3), "every 3-th layer"),
])
def test_megatron_refuses_what_it_cannot_express(config, why):
    with pytest.raises(TrainerConfigError, match=re.escape(why)):
        write_config("megatron", config)


# -- the documented names ----------------------------------------------------------------------------

def test_emitted_torchtitan_keys_are_torchtitans():
    assert {(s, k) for s, keys in TORCHTITAN_DOCUMENTED.items() for k in keys} == set(KEYS)
    for config in BOTH + TORCHTITAN_ONLY:
        doc = tomllib.loads(write_config("torchtitan", config))
        assert set(doc) <= set(TORCHTITAN_DOCUMENTED)
        for section, table in doc.items():
            assert set(table) <= TORCHTITAN_DOCUMENTED[section], section


def test_emitted_megatron_flags_are_megatrons():
    assert set(FLAGS) == MEGATRON_DOCUMENTED
    for config in BOTH + MEGATRON_ONLY:
        flags = [t for t in shlex.split(" ".join(megatron_flags(config))) if t.startswith("--")]
        assert set(flags) <= MEGATRON_DOCUMENTED


def test_torchtitan_sections_exactly():
    config = BOTH[2]
    doc = tomllib.loads(write_config("torchtitan", config))
    assert doc == {
        "training": {"local_batch_size": 2, "global_batch_size": 32, "seq_len": 2048,
                     "mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32"},
        "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 4,
                        "tensor_parallel_degree": 2, "pipeline_parallel_degree": 1},
        "activation_checkpoint": {"mode": "full"},
    }
    pipeline = tomllib.loads(write_config("torchtitan", BOTH[3]))
    assert pipeline["parallelism"]["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert pipeline["parallelism"]["pipeline_parallel_layers_per_stage"] == 2          # 8 layers / (2 x 2)
    assert pipeline["parallelism"]["pipeline_parallel_microbatch_size"] == 1
    assert pipeline["training"]["local_batch_size"] == 8                                # 16 / (dp 2)


def test_megatron_flags_exactly():
    assert megatron_flags(BOTH[3]) == [
        "--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2",
        "--num-layers-per-virtual-pipeline-stage 2", "--sequence-parallel", "--micro-batch-size 1",
        "--global-batch-size 16", "--seq-length 2048", "--num-layers 8", "--bf16", "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy optim_grads_params"]
    assert "--use-distributed-optimizer" in megatron_flags(MEGATRON_ONLY[0])


def _mirror_file(repo: str, commit: str, path: str) -> str:
    git = Path("/work/.mirror") / repo / "repo"
    if not git.is_dir():
        pytest.skip(f"no local copy of {repo} at {git} to check the names against")
    return subprocess.run(["git", "-C", str(git), "show", f"{commit}:{path}"], capture_output=True, text=True,
                          check=True).stdout


def test_torchtitan_names_are_in_its_source():
    """Each (section, key) is a field of the job_config.py class the code cites."""
    source = _mirror_file("pytorch+torchtitan", "e347b1e5e6b6941d789d16d340145294d82dc71e",
                          "torchtitan/config/job_config.py")
    classes = {"training": "Training", "parallelism": "Parallelism", "activation_checkpoint": "ActivationCheckpoint"}
    for section, key in KEYS:
        body = source.split(f"\nclass {classes[section]}:")[1].split("\nclass ")[0]
        assert re.search(rf"^    {key}: ", body, re.M), f"{section}.{key}"


def test_megatron_flags_are_in_its_source():
    """Each flag is an add_argument of arguments.py, or a field of the config dataclass the code cites
    (ArgumentGroupFactory makes --field-name of field_name)."""
    commit = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
    for flag, (where, _) in FLAGS.items():
        source = _mirror_file("NVIDIA+Megatron-LM", commit, where.split()[0])
        field = flag[2:].replace("-", "_")
        assert f"'{flag}'" in source or re.search(rf"^    {field}: ", source, re.M), flag


# -- reading users' configurations -----------------------------------------------------------------

def test_torchtitan_defaults_and_leftover_shard_degree():
    config = from_torchtitan("[training]\nmixed_precision_param = 'bfloat16'\n", devices=8)
    # torchtitan's defaults: shard -1 takes all 8, local batch 8, selective AC every 2nd layer, reduce float32
    assert (config.fsdp, config.dp, config.tp, config.micro_batch_size, config.global_batch_size) == (8, 1, 1, 8, None)
    assert (config.recompute, config.recompute_every, config.reduce_dtype, config.seq_len) == ("full", 2, "fp32", 2048)
    assert config.training(["h.0", "h.1", "h.2", "h.3"]).recompute_blocks == {"h.1": "full", "h.3": "full"}


def test_megatron_data_parallel_size_is_what_the_devices_leave():
    config, other = from_megatron("pretrain_gpt.py --tensor-model-parallel-size=4 --micro-batch-size 2 --bf16 "
                                  "--lr 3e-4 --use-distributed-optimizer --recompute-activations", devices=32)
    assert (config.dp, config.tp, config.zero, config.precision, config.reduce_dtype) == (8, 4, 1, "bf16", "fp32")
    assert config.recompute == "selective" and other == ["--lr"]
    fsdp, _ = from_megatron("--use-megatron-fsdp --grad-reduce-in-bf16 --bf16", devices=8)
    assert (fsdp.fsdp, fsdp.dp, fsdp.reduce_dtype) == (8, 1, "bf16")


@pytest.mark.parametrize("text, devices, words", [
    ("[parallelism]\ncontext_parallel_degree = 2\n", 8, "parallelism.context_parallel_degree = 2"),
    ("[training]\nmixed_precision_param = 'float16'\n", 8, "training.mixed_precision_param = 'float16'"),
    ("[activation_checkpoint]\nmode = 'memory_budget'\n", 8, "activation_checkpoint.mode = 'memory_budget'"),
    ("[parallelism]\ntensor_parallel_degree = 0\n", 8, "parallelism.tensor_parallel_degree = 0"),
    ("[parallelism]\ntensor_parallel_degree = 3\n", 8, "tensor_parallel_degree 3 x pipeline_parallel_degree 1 = 3 "
                                                         "does not divide the 8 devices"),
    ("[parallelism]\ndata_parallel_shard_degree = 2\n", 8, "= 2 devices, but the plan is for 8"),
    ("", None, "data_parallel_shard_degree = -1 is left to the device count"),
    ("[training\n", 8, "not valid TOML"),
])
def test_torchtitan_errors_name_the_key(text, devices, words):
    with pytest.raises(TrainerConfigError, match=re.escape(words)):
        from_torchtitan(text, devices=devices, source="job.toml")


@pytest.mark.parametrize("flags, words", [
    ("--context-parallel-size 2", "--context-parallel-size 2"),
    ("--micro-batch-size", "--micro-batch-size needs a value"),
    ("--recompute-granularity full", "needs --recompute-method uniform or block"),
    ("--bf16 --fp16", "--bf16 and --fp16 together"),
    ("--tensor-model-parallel-size 3", "does not divide the 8 devices"),
    ("--data-parallel-sharding-strategy zero9 --use-megatron-fsdp", "--data-parallel-sharding-strategy zero9"),
])
def test_megatron_errors_name_the_flag(flags, words):
    with pytest.raises(TrainerConfigError, match=re.escape(words)):
        from_megatron(flags, devices=8)


# -- the structured space and pricing --------------------------------------------------------------

def test_structured_space_on_one_node_of_four():
    cluster = SimpleNamespace(num_devices=4, devices_per_node=4)
    titan = structured_configs("torchtitan", cluster, TrainerConfig())
    assert sorted((c.dp, c.fsdp, c.tp) for c in titan) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1),
                                                             (4, 1, 1)]
    assert all(c.sequence_parallel == (c.tp > 1) and c.zero == 0 for c in titan)
    megatron = structured_configs("megatron", cluster, TrainerConfig())
    assert len(megatron) == 14          # tp 1: fsdp 4, dp 4 x ZeRO 0/1/2; tp 2: (fsdp 2, dp 2 x 3) x sp; tp 4: x sp
    assert not any(c.dp > 1 and c.fsdp > 1 for c in megatron)


def test_structured_space_with_pipeline_stages_on_two_nodes_of_four():
    """pp outermost and at most max_pp, tp inside a node, the innermost data-parallel degree too;
    each pipeline split under 1F1B and under interleaved 1F1B with 2 stages per rank."""
    cluster = SimpleNamespace(num_devices=8, devices_per_node=4)
    titan = structured_configs("torchtitan", cluster, TrainerConfig(), max_pp=4)
    staged = sorted((c.pp, c.dp, c.fsdp, c.tp, c.schedule, c.virtual_stages) for c in titan if c.pp > 1)
    splits = [(2, 1, 4, 1), (2, 2, 2, 1), (2, 4, 1, 1), (2, 1, 2, 2), (2, 2, 1, 2), (2, 1, 1, 4),
              (4, 1, 2, 1), (4, 2, 1, 1), (4, 1, 1, 2)]          # by hand: pp=8 > max_pp; pp=2 x tp=8 > 8 devices
    assert staged == sorted(s + sched for s in splits for sched in (("1F1B", 1), ("Interleaved1F1B", 2)))
    flat = sorted((c.dp, c.fsdp, c.tp) for c in titan if c.pp == 1)
    assert flat == [(1, 1, 8), (1, 2, 4), (1, 4, 2), (1, 8, 1), (2, 1, 4), (2, 2, 2), (2, 4, 1), (4, 1, 2),
                    (4, 2, 1), (8, 1, 1)]                        # tp=8: one axis over every device
    assert not any(c.pp > 1 for c in structured_configs("torchtitan", cluster, TrainerConfig()))


def test_cli_emit_finds_pipeline_stages_the_found_plan_did_not_try(tmp_path, capsys):
    """Four one-GPU nodes on 25 Gb/s Ethernet: the best Megatron-LM configuration is pp=4, priced as the
    same --degrees configuration, and said to beat the found plan (which did not search stages)."""
    flags, argv = tmp_path / "flags.txt", ["plan", str(GPT), "--preset", "tiny", "--set", "n_layer=4", "--set",
                                           "n_embd=768", "--cluster", str(ROOT / "configs" / "v100-16x1.yaml"),
                                           "--devices", "4", "--micro-batch-size", "1", "--global-batch-size", "16"]
    assert main(argv + ["--emit", "megatron", "--emit-out", str(flags), "--out", str(tmp_path / "a.json")]) == 0
    text = flags.read_text()
    emitted_ms = _ms(r"autoddl predicts ([\d.]+) ms per optimizer step", text)[0]
    found_ms = _ms(r"the found plan \(per-op signatures, finer than Megatron-LM expresses\): ([\d.]+) ms", text)[0]
    assert "which the found plan's search did not try: add --pipeline" in text and emitted_ms < found_ms
    config, _ = from_megatron(" ".join(ln.rstrip(" \\") for ln in text.splitlines() if not ln.startswith("#")),
                           devices=4)
    assert (config.pp, config.dp, config.tp, config.schedule) == (4, 1, 1, "1F1B")
    capsys.readouterr()
    assert main(argv + ["--degrees", "pp=4", "--schedule", "1f1b", "--no-search", "--out", "/dev/null"]) == 0
    assert _ms(r"given pp=4[^:]*: mesh \S+, predicted ([\d.]+) ms", capsys.readouterr().out) == [emitted_ms]


def test_a_pipeline_schedule_autoddl_does_not_price_is_refused():
    config = dataclasses.replace(BOTH[3], schedule="ZBVZeroBubble")
    with pytest.raises(PlanningError, match="schedule ZBVZeroBubble is not one autoddl prices"):
        price_config(None, None, config)


def test_cli_from_megatron_prices_pipeline_stages_as_degrees(capsys):
    """A user's Megatron pipeline configuration is priced as the same --degrees configuration
    (pp outermost, 1F1B, as many micro-steps as the global batch needs)."""
    flags = "--pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 8"
    assert main(PLAN + [f"--from-megatron={flags}", "--no-search", "--out", "/dev/null"]) == 0
    yours = _ms(r"your Megatron-LM flags \(pp=2,dp=2 \(1F1B\), fp32, recompute none, micro-batch 1, "
                r"global batch 8\): ([\d.]+) ms", capsys.readouterr().out)
    assert main(PLAN + ["--degrees", "pp=2,dp=2", "--schedule", "1f1b", "--micro-batch-size", "1",
                        "--global-batch-size", "8", "--no-search", "--out", "/dev/null"]) == 0
    given = _ms(r"given pp=2,dp=2[^:]*: mesh 2x2, predicted ([\d.]+) ms", capsys.readouterr().out)
    assert yours == given


# -- the command line ------------------------------------------------------------------------------

PLAN = ["plan", str(GPT), "--preset", "tiny", "--cluster", str(LOCAL), "--devices", "4"]


def _ms(pattern: str, text: str) -> list[float]:
    match = re.search(pattern, text)
    assert match, (pattern, text)
    return [float(g) for g in match.groups()]


def test_cli_emit_torchtitan_writes_the_best_expressible_configuration(tmp_path, capsys):
    toml = tmp_path / "job.toml"
    assert main(PLAN + ["--emit", "torchtitan", "--emit-out", str(toml), "--out", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    text = toml.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert header[0].startswith("# torchtitan settings from `autoddl plan` for gpt")
    best_ms = _ms(r"^torchtitan best\s+\S+\s+([\d.]+)", "\n".join(ln for ln in out.splitlines()
                                                                    if ln.startswith("torchtitan best")))[0]
    found_ms = _ms(r"found plan: mesh \S+, predicted ([\d.]+) ms", out)[0]
    assert _ms(r"autoddl predicts ([\d.]+) ms per optimizer step", text) == [best_ms]
    if "this is the found plan" in text:
        assert best_ms == found_ms
    else:
        assert "finer than torchtitan expresses" in text
        assert _ms(r"is predicted ([\d.]+)x its step time", text)[0] == pytest.approx(best_ms / found_ms, abs=0.006)
    config = from_torchtitan(text, devices=4)
    assert config.devices == 4 and config.seq_len == 32          # tiny gpt: sequence 32
    assert config.micro_batch_size * config.data_parallel_degree == 4 == config.global_batch_size  # its batch of 4


def test_cli_from_torchtitan_prices_it_beside_the_found_plan(tmp_path, capsys):
    toml = tmp_path / "job.toml"
    toml.write_text("[training]\nlocal_batch_size = 2\nglobal_batch_size = 8\nseq_len = 32\n"
                    "mixed_precision_param = 'float32'\n[parallelism]\ndata_parallel_shard_degree = 2\n"
                    "tensor_parallel_degree = 2\n[activation_checkpoint]\nmode = 'none'\n")
    assert main(PLAN + ["--from-torchtitan", str(toml), "--out", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    mine, found, ratio = _ms(r"your torchtitan job\.toml \(fsdp=2,sp=2, fp32, recompute none, micro-batch 2, "
                             r"global batch 8\): ([\d.]+) ms; found: ([\d.]+) ms \(([\d.]+)x\)", out)
    assert ratio == pytest.approx(mine / found, abs=0.006)
    assert _ms(r"^found\s+\S+\s+([\d.]+)", "\n".join(ln for ln in out.splitlines() if ln.startswith("found ")))[0] \
        == found
    # the search ran under the configuration's settings: the same global batch of 8, micro-batch 2 per rank
    assert "training: fp32, recompute none" in out and "micro-step batch 8 (all data-parallel ranks), 1 micro-step, " \
        "global batch 8" in out


def test_cli_emit_round_trips_through_from(tmp_path, capsys):
    """--degrees ... --emit megatron, then --from-megatron of that file: the same configuration, the same price."""
    flags = tmp_path / "flags.txt"
    assert main(PLAN + ["--degrees", "dp=2,tp=2", "--zero", "1", "--precision", "bf16", "--reduce-dtype", "fp32",
                        "--micro-batch-size", "1", "--global-batch-size", "4", "--no-search", "--emit", "megatron",
                        "--emit-out", str(flags), "--out", str(tmp_path / "a.json")]) == 0
    first = capsys.readouterr().out
    given_ms = _ms(r"given dp=2,tp=2 --zero 1: mesh 2x2, predicted ([\d.]+) ms", first)[0]
    assert "--use-distributed-optimizer" in flags.read_text() and "--bf16" in flags.read_text()
    assert main(PLAN + ["--from-megatron", str(flags), "--no-search", "--out", str(tmp_path / "b.json")]) == 0
    second = capsys.readouterr().out
    assert _ms(r"your Megatron-LM flags\.txt \(dp=2,tp=2 ZeRO-1, bf16 \(gradients reduced in fp32\), recompute none, "
               r"micro-batch 1, global batch 4\): ([\d.]+) ms", second) == [given_ms]


@pytest.mark.parametrize("argv, words", [
    (["--degrees", "dp=2,tp=2", "--no-search", "--emit", "torchtitan"], "tensor parallel without sequence parallel"),
    (["--from-megatron", "--tensor-model-parallel-size 3"], "--tensor-model-parallel-size 3 x "
                                                             "--pipeline-model-parallel-size 1 = 3 does not divide"),
    (["--from-torchtitan", "/nonexistent/job.toml"], "--from-torchtitan /nonexistent/job.toml: no such file"),
    (["--degrees", "dp=4", "--from-megatron", "--bf16 --tensor-model-parallel-size 1"], "give one configuration"),
    (["--emit-out", "x.toml"], "add --emit torchtitan or --emit megatron"),
])
def test_cli_errors(argv, words, capsys):
    assert main(PLAN + argv + ["--out", "/dev/null"]) == 2
    assert words in capsys.readouterr().err


def test_degrees_role_sp_is_tensor_parallel_with_sequence_parallel():
    from search.planner import degrees_spec, parse_degrees

    cluster = SimpleNamespace(num_devices=8, devices_per_node=4, name="two nodes")
    spec, shape = degrees_spec(parse_degrees("fsdp=2,sp=4"), cluster)
    assert (spec.name, spec.roles, shape) == ("fsdp_sp", ("zero", "sp"), (2, 4))
    assert TrainerConfig.from_degrees(parse_degrees("dp=2,sp=4")).degrees() == [("dp", 2), ("sp", 4)]
    with pytest.raises(PlanningError, match="tp .* and sp .* are one degree"):
        degrees_spec(parse_degrees("tp=2,sp=4"), cluster)
    with pytest.raises(PlanningError, match="sp must be the innermost"):
        degrees_spec(parse_degrees("sp=4,dp=2"), cluster)


def _scheme(ms: float, fits: bool = True):
    return SimpleNamespace(step_time_s=ms / 1e3, breakdown=SimpleNamespace(fits_memory=fits))


def test_best_config_keeps_the_fastest_that_fits_and_why_others_were_left():
    from search.expressible import best_config

    configs = [TrainerConfig(dp=4), TrainerConfig(fsdp=4), TrainerConfig(dp=2, tp=2), TrainerConfig(dp=2, fsdp=2)]
    times = {(4, 1, 1): (10.0, False), (1, 4, 1): (20.0, True), (2, 1, 2): (15.0, True)}

    def price(c):
        if c.dp == 2 and c.fsdp == 2:
            raise PlanningError("hsdp does not apply")
        return _scheme(*times[(c.dp, c.fsdp, c.tp)])

    def expressible(c):
        if c.tp > 1 and not c.sequence_parallel:
            raise TrainerConfigError("no tp without sp")
    best, tried = best_config(configs, price, expressible)
    assert best.config == TrainerConfig(fsdp=4)            # dp=4 is faster but does not fit
    assert [p.reason for p in tried] == ["", "", "no tp without sp", "hsdp does not apply"]
    nothing_fits, _ = best_config(configs[:1], price, expressible)
    assert nothing_fits.config == TrainerConfig(dp=4)      # none fits: the fastest, shown as not fitting


def test_same_plan_compares_mesh_signatures_and_storages():
    import dataclasses

    from autoddl.plan import Mesh, Plan
    from autoddl.sbp import B, NdSbp, S
    from search.expressible import same_plan

    plan = Plan(name="found", mesh=Mesh((4,), ("dp",)), signatures={}, param_storage={"w": NdSbp((B,))},
                graph_hash="h")
    assert same_plan(plan, dataclasses.replace(plan, name="dp"))
    assert not same_plan(plan, dataclasses.replace(plan, optimizer_storage={"w": NdSbp((S(0),))}))
    assert not same_plan(plan, dataclasses.replace(plan, param_storage={"w": NdSbp((S(0),))}))


def test_reads_torchtitans_own_llama3_8b_preset():
    """torchtitan's llama3_8b.toml (tests/data, verbatim): FSDP over every GPU, one sequence of 8192 per
    GPU, bf16 parameters with float32 reduction (torchtitan's defaults), per-op selective recompute."""
    text = (ROOT / "tests" / "data" / "torchtitan_llama3_8b.toml").read_text()
    config, ignored = read_config("torchtitan", text, devices=8)
    assert config == TrainerConfig(fsdp=8, precision="bf16", reduce_dtype="fp32", recompute="selective",
                                   micro_batch_size=1, seq_len=8192)
    assert ignored == [] and config.describe() == "fsdp=8, bf16 (gradients reduced in fp32), recompute selective, " \
        "micro-batch 1"
    assert read_config("torchtitan", text, devices=64)[0].fsdp == 64      # the preset's 64 A100s
