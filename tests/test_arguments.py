"""Arguments: YAML + flags precedence, role groups, and one-line errors for bad configurations."""

import subprocess
import sys

import pytest

from helpers import ROOT

from megarl.arguments import build_parser, load_yaml_config, parse_args
from megarl.errors import ConfigError


def _yaml(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_roles_and_flag_precedence(tmp_path):
    config = _yaml(tmp_path, "colocate-groups: [[train, rollout]]\nlr: 1e-6\ntemperature: 0.7\n"
                             "train: {gpus: 2, tensor_model_parallel_size: 2}\n"
                             "rollout: {gpus: 2, tensor_parallel_size: 1, engine_kwargs: {max_num_seqs: 4}}\n")
    args = parse_args(["--config", config, "--temperature", "0.9"], world_size=2)
    assert args.lr == 1e-6 and args.temperature == 0.9  # YAML, then the flag wins
    assert (args.train_gpus, args.rollout_gpus, args.tensor_model_parallel_size) == (2, 2, 2)
    assert args.rollout_tensor_parallel_size == 1 and args.rollout_engine_kwargs == {"max_num_seqs": 4}
    assert args.rollout_model == args.model and args.tokenizer == args.model


@pytest.mark.parametrize("tp,on", [(2, True), (1, False)])
def test_sequence_parallelism_is_off_at_tp_1_as_in_megatron(tp, on):
    """--sequence-parallel at TP 1 is a no-op (Megatron-LM's arguments turn it off there); at TP > 1 it
    reaches every train-rank model's config and pads each sequence to a multiple of TP."""
    from megarl.model_runner import sequence_multiple
    from megarl.models.megatron_gpt import model_config_overrides, trainer_config_overrides

    args = parse_args(["--tensor-model-parallel-size", str(tp), "--sequence-parallel"], world_size=tp)
    assert args.sequence_parallel is on and sequence_multiple(args) == (tp if on else 1)
    assert model_config_overrides(args)["sequence_parallel"] is on
    assert trainer_config_overrides(args)["sequence_parallel"] is on
    assert parse_args(["--tensor-model-parallel-size", str(tp)], world_size=tp).sequence_parallel is False


def test_separate_placement_fills_in_the_other_role(tmp_path):
    args = parse_args(["--config", _yaml(tmp_path, "colocate_groups: []\nrollout: {gpus: 1}\n")], world_size=3)
    assert (args.train_gpus, args.rollout_gpus, args.colocate_groups) == (2, 1, [])


BAD = [
    # (yaml or None, flags, world size, words the one-line message must contain)
    (None, ["--tensor-model-parallel-size", "3"], 2, ["train.gpus=2", "tensor_model_parallel_size"]),
    (None, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"], 2,
     ["not divisible", "pipeline_model_parallel_size"]),
    ("train: {gpus: 2}\nrollout: {gpus: 1}\n", [], 2, ["colocate_groups", "train.gpus=2", "rollout.gpus=1"]),
    ("colocate_groups: []\ntrain: {gpus: 2}\nrollout: {gpus: 1}\n", [], 2, ["needs 3 ranks", "2 were launched"]),
    (None, ["--train-gpus", "4"], 2, ["needs 4 ranks", "train.gpus=4"]),
    (None, ["--colocate-groups", "none", "--rollout-gpus", "1"], 3, []),  # valid: 2 train + 1 rollout
    ("temperture: 1.0\n", [], 1, ["temperture", "did you mean 'temperature'"]),
    ("rollout: {gpus: 1, tensor_paralel_size: 1}\n", [], 1, ["rollout.tensor_paralel_size",
                                                             "did you mean 'tensor_parallel_size'"]),
    ("train: {tensor_model_parallel_sise: 1}\n", [], 1, ["did you mean 'tensor_model_parallel_size'"]),
    ("lr: fast\n", [], 1, ["lr", "expected a number", "'fast'"]),
    ("num_generations: 2.5\n", [], 1, ["num_generations", "expected an integer"]),
    ("colocate_groups: train,rollout\n", [], 1, []),  # the flag's string form works in YAML too
    ("colocate_groups: [[train, rolout]]\n", [], 1, ["unknown role 'rolout'", "did you mean 'rollout'"]),
    ("lr_decay_style: cosin\n", [], 1, ["lr_decay_style", "one of"]),
    ("train: 2\n", [], 1, ["role group 'train' must be a mapping"]),
    ("lr: [1, 2\n", [], 1, ["line", "not valid YAML"]),
    (None, ["--rollout-tensor-parallel-size", "2"], 1, ["rollout.gpus=1", "rollout.tensor_parallel_size=2"]),
    (None, ["--lr", "x"], 1, ["--lr", "invalid float value"]),
    # batch geometry: 16 prompts x 8 generations = 128 samples per generated batch
    (None, ["--global-batch-size", "48"], 1, ["global_batch_size=48", "does not divide", "16 * 8 = 128"]),
    (None, ["--global-batch-size", "32", "--steps-per-generation", "2"], 1,
     ["steps_per_generation=2", "global_batch_size=32", "4 mini-batches"]),
    (None, ["--global-batch-size", "32", "--steps-per-generation", "4"], 1, []),  # consistent
    (None, ["--steps-per-generation", "3"], 1, ["steps_per_generation=3", "128"]),
    (None, ["--global-batch-size", "2", "--num-generations", "1", "--prompts-per-step", "4",
            "--micro-batch-size", "1"], 4, ["global_batch_size=2", "4 data-parallel ranks"]),
    (None, ["--global-batch-size", "64", "--micro-batch-size", "24"], 2,
     ["micro_batch_size=24", "32 samples", "global_batch_size=64"]),
    (None, ["--ppo-epochs", "0"], 1, ["--ppo-epochs must be >= 1"]),
    ("max_new_tokens: 16\nmin_new_tokens: 17\n", [], 1, ["--min-new-tokens must be in [0, --max-new-tokens=16]"]),
    (None, ["--max-new-tokens", "16", "--min-new-tokens", "16"], 1, []),  # every response exactly 16 tokens
    (None, ["--global-batch-size", "0"], 1, ["--global-batch-size must be >= 1"]),
    # KL control and the critic
    (None, ["--kl-placement", "reward"], 1, ["--kl-placement reward", "--kl-coef > 0"]),
    (None, ["--kl-coef", "0.1", "--kl-controller", "adaptive", "--kl-target", "0"], 1, ["--kl-target > 0"]),
    (None, ["--kl-coef", "-1"], 1, ["--kl-coef must be >= 0"]),
    (None, ["--critic-warmup", "3"], 1, ["--critic-warmup needs a critic", "gae"]),
    (None, ["--advantage-estimator", "gae", "--value-clip", "0"], 1, ["--value-clip"]),
    (None, ["--advantage-estimator", "gae", "--lam", "1.5"], 1, ["--lam", "[0, 1]"]),
    # activation recomputation (Megatron's rules) and context parallelism
    (None, ["--recompute-granularity", "full"], 1, ["--recompute-granularity full needs", "--recompute-method",
                                                    "--recompute-num-layers"]),
    (None, ["--recompute-granularity", "full", "--recompute-method", "block"], 1, ["--recompute-num-layers N"]),
    (None, ["--recompute-granularity", "selective", "--recompute-method", "uniform"], 1,
     ["selective takes no --recompute-method"]),
    (None, ["--recompute-num-layers", "1"], 1, ["--recompute-num-layers need --recompute-granularity full"]),
    (None, ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"], 1,
     ["--recompute-num-layers 3", "2 layers"]),  # the tiny model has 2 layers
    (None, ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"], 1, []),
    (None, ["--recompute-granularity", "selective"], 1, []),
    (None, ["--context-parallel-size", "2"], 2, ["--context-parallel-size 2 needs --padding-free"]),
    (None, ["--context-parallel-size", "2", "--padding-free"], 2, []),
    # full-vocabulary companions run at CP > 1 (tests/test_pipeline.py checks them against CP 1)
    (None, ["--context-parallel-size", "2", "--padding-free", "--kl-coef", "0.1", "--kl-estimator", "full"], 2, []),
    # mixed precision
    (None, ["--bf16", "--fp16"], 1, ["--bf16 and --fp16"]),
    (None, ["--bf16", "--params-dtype", "float16"], 1, ["--bf16 contradicts --params-dtype float16"]),
    (None, ["--loss-scale", "128"], 1, ["--loss-scale needs --fp16"]),
    (None, ["--fp16"], 1, ["--fp16", "GPU host", "--bf16"]),  # this CPU host
    (None, ["--bf16", "--params-dtype", "bfloat16"], 1, []),
    (None, ["--reward-model-max-length", "512"], 1, ["--reward-model-max-length needs --reward-model"]),
    (None, ["--reward-model-micro-batch-size", "0"], 1, ["--reward-model-micro-batch-size must be >= 1"]),
    # vLLM sleep and the waits (issue 23: findings 9 and 15)
    (None, ["--rollout-sleep-level", "2"], 1, []),  # the next sync brings the weights back (tests/test_sleep_level.py)
    (None, ["--rollout-sleep-level", "2", "--lora-rank", "4", "--lora-sync", "adapter"], 1,
     ["--rollout-sleep-level 2 with --lora-sync adapter", "base weights", "level 1"]),
    (None, ["--rollout-sleep-level", "2", "--lora-rank", "4"], 1, []),  # merged: the whole model each sync
    (None, ["--rollout-sleep-level", "2", "--rollout-backend", "hf"], 1, ["--rollout-sleep-level 2", "use level 1"]),
    (None, ["--rollout-sleep-level", "1"], 1, []),
    (None, ["--startup-timeout-minutes", "0"], 1, ["--startup-timeout-minutes must be > 0"]),
    (None, ["--distributed-timeout-minutes", "-1"], 1, ["--distributed-timeout-minutes", "must be > 0"]),
]


def test_bf16_is_the_params_dtype():
    args = parse_args(["--bf16"], world_size=1)
    assert (args.params_dtype, args.bf16, args.fp16) == ("bfloat16", True, False)
    assert parse_args(["--params-dtype", "bfloat16"], world_size=1).bf16


def test_batch_geometry_is_derived_from_either_option():
    args = parse_args(["--global-batch-size", "32"], world_size=2)
    assert (args.steps_per_generation, args.global_batch_size) == (4, 32)
    args = parse_args(["--steps-per-generation", "2"], world_size=2)
    assert (args.steps_per_generation, args.global_batch_size) == (2, 64)
    args = parse_args([], world_size=2)
    assert (args.steps_per_generation, args.global_batch_size, args.ppo_epochs) == (1, 128, 1)


@pytest.mark.parametrize("yaml_text,flags,world,words", BAD)
def test_invalid_configurations(tmp_path, yaml_text, flags, world, words):
    argv = (["--config", _yaml(tmp_path, yaml_text)] if yaml_text else []) + flags
    if not words:
        parse_args(argv, world_size=world)
        return
    with pytest.raises(ConfigError) as error:
        parse_args(argv, world_size=world)
    message = str(error.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)
    if yaml_text:
        assert "config.yaml" in message  # names the file


@pytest.mark.slow  # launches a command in a process of its own (python + torch start-up): the slow lane
def test_train_py_reports_a_bad_config_on_one_line(tmp_path):
    config = _yaml(tmp_path, "colocate_groups: [[train, rollout]]\nmax_new_tokns: 8\n")
    result = subprocess.run([sys.executable, "megarl/train.py", "--config", config], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "max_new_tokns" in lines[0] and "max_new_tokens" in lines[0], result.stderr


def test_help_lists_every_option_by_group_with_defaults():
    text = build_parser().format_help()
    for group in ("model", "parallelism", "placement", "rollout", "algorithm", "batch geometry", "critic", "data",
                  "reward", "optimizer", "checkpoint", "logging"):
        assert f"\n{group}" in text, group
    for action in build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.option_strings[0] in text
    assert "(default: 1)" in text


def test_configuration_reference_page_matches_the_parser():
    sys.path.insert(0, str(ROOT / "tools"))
    from config_reference import END, PAGE, START, reference

    page = PAGE.read_text()
    section = page.split(START, 1)[1].split(END, 1)[0]
    assert section.strip() == reference().strip(), "run: python tools/config_reference.py --write"


def test_external_plugin_registers_an_estimator(tmp_path):
    import torch

    from megarl.algorithms import ADVANTAGE_ESTIMATORS

    args = parse_args(["--external-plugins", "examples/plugins/my_algorithms.py",
                       "--advantage-estimator", "mean_baseline"], world_size=1)
    assert args.advantage_estimator == "mean_baseline"
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0], [0.0, 0.0]])
    mask = torch.ones(4, 2)
    advantages, _ = ADVANTAGE_ESTIMATORS["mean_baseline"](rewards, mask, 2)
    assert torch.allclose(advantages[:, 0], torch.tensor([0.5, -0.5, 1.5, -1.5]))


def test_bad_plugins_fail_on_one_line(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('needs a package this host lacks')\n")
    for path, words in ((str(tmp_path / "missing.py"), "no such file"), (str(broken), "ImportError: needs a package")):
        with pytest.raises(ConfigError) as error:
            parse_args(["--external-plugins", path], world_size=1)
        assert path in str(error.value) and words in str(error.value) and "\n" not in str(error.value)


def test_yaml_anchors_merge_and_override_but_a_repeated_key_is_an_error(tmp_path):
    config = _yaml(tmp_path, "rollout: &r {gpus: 2, kv_cache_gb: 2}\nteacher:\n  <<: *r\n  kv_cache_gb: 3\n")
    values = load_yaml_config(config, build_parser())
    assert (values["teacher_gpus"], values["teacher_kv_cache_gb"], values["rollout_kv_cache_gb"]) == (2, 3.0, 2.0)
    with pytest.raises(ConfigError, match=r"config.yaml line 2: not valid YAML \(the key 'lr' is given twice\)"):
        load_yaml_config(_yaml(tmp_path, "lr: 1e-6\nlr: 2e-6\n"), build_parser())
