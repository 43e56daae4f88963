"""Streaming generation (--max-staleness K, --partial-rollout; megarl/streaming.py) in the separate placement: every
token's version tag is the policy that sampled it, the staleness bound holds, a resume with responses in flight
continues bit for bit, and what is not built is refused in one line."""

import pytest
import torch

from helpers import ROUNDING_LEVEL, assert_signal_alive, read_json, scalars, torchrun

SEPARATE = ["--config", "examples/quickstart_grpo_separate.yaml"]
# 4 prompts x 4 samples a step, lengths forced from 8 to 48 tokens (a long tail at this scale), 6 groups in flight:
# each batch is cut with 2 groups still running, whose responses cross the sync
STREAM = ["--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "48", "--min-new-tokens-tail",
          "8", "48", "--micro-batch-size", "16", "--lr", "1e-3", "--rollout-kv-cache-gb", "1", "--stream-groups", "6"]
COMPARED = ("reward_mean", "loss", "grad_norm", "entropy", "response_length_mean", "mismatch", "staleness",
            "staleness_mean", "token_staleness_mean", "partial_fraction", "stream_responses_resumed",
            "stream_groups_filtered", "dapo_reward_all_mean")


def _parse(*flags, world_size=2):
    from megarl.arguments import parse_args

    return parse_args([*map(str, flags)], world_size=world_size)


@pytest.mark.parametrize("flags,words", [
    (["--config", "examples/quickstart_grpo.yaml", "--max-staleness", 2], ["--max-staleness 2 needs the separate"]),
    ([*SEPARATE, "--max-staleness", 0], ["--max-staleness 0", "K >= 1"]),
    ([*SEPARATE, "--partial-rollout"], ["--partial-rollout", "set --max-staleness"]),
    ([*SEPARATE, "--max-staleness", 2, "--rollout-backend", "hf"], ["does not support --rollout-backend hf"]),
    ([*SEPARATE, "--max-staleness", 2, "--prompts-per-step", 3, "--micro-batch-size", 8, "--rollout-gpus", 2,
      "--train-gpus", 1],
     ["prompts_per_step=3", "2 rollout engines"]),
    ([*SEPARATE, "--min-new-tokens-tail", 8, 99], ["--min-new-tokens-tail 8 99", "--max-new-tokens"]),
])
def test_what_is_not_built_is_refused_in_one_line(flags, words, tiny_model):
    from megarl.errors import ConfigError

    world = 3 if "--rollout-gpus" in flags else 2
    with pytest.raises(ConfigError) as error:
        _parse(*flags, "--model", tiny_model, world_size=world)
    message = str(error.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_routing_replay_streams_without_partial_rollout_only(random_moe_policy):
    """An MoE policy: routing replay's auto stays on while streaming without --partial-rollout (each response one
    request of one version) and turns off with it; on with --partial-rollout is refused in one line."""
    from megarl.errors import ConfigError

    flags = [*SEPARATE, "--model", random_moe_policy, "--max-staleness", 2]
    assert _parse(*flags).routing_replay == "on" and _parse(*flags, "--partial-rollout").routing_replay == "off"
    with pytest.raises(ConfigError) as error:
        _parse(*flags, "--partial-rollout", "--routing-replay", "on")
    assert "\n" not in str(error.value) and "--partial-rollout" in str(error.value), error.value
    assert _parse(*flags, "--stop", "}").routing_replay == "off"  # streaming aborts a request at a stop string
    with pytest.raises(ConfigError) as error:
        _parse(*flags, "--stop", "}", "--routing-replay", "on")
    assert "\n" not in str(error.value) and "--stop" in str(error.value), error.value


def test_the_long_tail_is_a_function_of_the_prompt():
    """--min-new-tokens-tail: each prompt's forced length, keyed by its place in the prompt stream, spans the
    range with a median near LOW * (HIGH / LOW)^(1/4) and a tail towards HIGH."""
    from types import SimpleNamespace

    from megarl.generation import forced_min_tokens

    args = SimpleNamespace(min_new_tokens_tail=[16, 1024], min_new_tokens=16, seed=3)
    lengths = sorted(forced_min_tokens(args, step, position) for step in range(50) for position in range(40))
    assert lengths == sorted(forced_min_tokens(args, step, position) for step in range(50) for position in range(40))
    assert lengths[0] == 16 and 200 < lengths[int(0.97 * len(lengths))] <= 1024, lengths[::100]
    assert 35 < lengths[len(lengths) // 2] < 60, lengths[len(lengths) // 2]  # 16 * 64^(1/4) = 45
    assert forced_min_tokens(args, 1, 2) != forced_min_tokens(SimpleNamespace(**{**vars(args), "seed": 4}), 1, 2) \
        or forced_min_tokens(args, 1, 3) != forced_min_tokens(SimpleNamespace(**{**vars(args), "seed": 4}), 1, 3)


@pytest.mark.slow
@pytest.mark.parametrize("staleness,partial,extra", [
    (2, True, ["--stop", "}"]), (1, False, []),
    (2, True, ["--lora-rank", "8", "--lora-sync", "adapter", "--lr", "5e-3"]),
    (2, False, ["moe", "--routing-replay", "on"]),
    # the tiny model writes no tool call: the probe plugin's parser reads every turn as one (tests/test_multiturn.py);
    # no answer follows a probe's message (every reward 0, advantages 0), so an entropy bonus moves the weights
    # between versions (what tells a wrong tag)
    (2, True, ["tools", "--external-plugins", "tests/plugins/probe_tools.py", "--tools", "probe", "--tool-parser",
               "always_probe", "--max-turns", "2", "--max-new-tokens", "96", "--entropy-coef", "0.05"])],
    ids=["K2-partial-stop", "K1", "K2-lora", "K2-moe-r3", "K2-tools"])
def test_every_token_is_the_sample_of_the_version_it_is_tagged_with(staleness, partial, extra, tiny_model,
                                                                    random_moe_policy, tmp_path):
    """tests/workers/streaming_worker.py: 5 steps, the trainer's policy kept at every version. For each batch and
    each version v its tokens carry, the trainer's logprobs recomputed under v equal the engine's on the tokens
    tagged v at rounding level, also after a response crossed a sync (its prefix re-read by the new weights), and
    differ on the tokens tagged otherwise (a wrong tag would be seen). No batch trains a token more than K versions
    after it was sampled; with K = 2 and --partial-rollout responses do cross syncs and reach the bound; with K = 1
    (abort) every batch is one version's. The same with LoRA adapters synced as adapters (vLLM's LoRA serves each
    version's adapter to the requests resubmitted after its sync), and with an MoE policy under routing replay
    without partial rollout (the trainer replays each response's recorded routes). And with multi-turn tool
    episodes (the probe plugin's tool on every turn): episodes go on across syncs with tool messages between their
    turns, and the tools' tokens are no version's samples (left out of the check, as out of the loss). The K2
    partial run also stops at a --stop string, which the stream matches itself (also across a resubmission)."""
    out = tmp_path / "report.json"
    model = random_moe_policy if extra[:1] == ["moe"] else tiny_model
    tools = extra[:1] == ["tools"]
    extra = [flag for flag in extra if flag not in ("moe", "tools")]
    stream = list(STREAM)
    if tools:  # an episode's first turn is its tool call: a forced length would break the call's format
        tail = stream.index("--min-new-tokens-tail")
        del stream[tail:tail + 3]
    torchrun("streaming_worker.py", out, *SEPARATE, "--model", model, *stream, "--train-steps", "5",
             "--max-staleness", staleness, *(["--partial-rollout"] if partial else []), *extra, "--log-dir", "",
             timeout=900)
    report = read_json(out)
    assert len(report) == 5
    if tools:  # tools were called, and some episode took turns under two versions
        masks = [(mask, tags) for entry in report for mask, tags in zip(entry["policy_masks"], entry["token_versions"])]
        assert sum(0 in mask for mask, _ in masks) >= len(masks) // 4, [mask.count(0) for mask, _ in masks]
        assert any(0 in mask and len({v for v, m in zip(tags, mask) if m}) > 1 for mask, tags in masks)
    if "--stop" in extra:
        _assert_stopped_at_the_string(model, "}", [text for entry in report for text in entry["texts"]])
    routed = "--routing-replay" in extra  # every sample carries the routes of all the tokens it fed, or none does
    assert all(all(entry["routed"]) if routed else not any(entry["routed"]) for entry in report), report
    lags, spanning, wrong_tag_gaps = [], 0, []
    for entry in report:
        versions = [v for tags in entry["token_versions"] for v in tags]
        lags.append(entry["trained_at"] - min(versions))
        spanning += sum(len(set(tags)) > 1 for tags in entry["token_versions"])
        for version, check in entry["versions"].items():
            mean, largest, count = check["tagged"]
            assert count > 0 and mean <= ROUNDING_LEVEL and largest <= 1e-4, (entry["step"], version, check)
            if check["untagged"][0] is not None:
                wrong_tag_gaps.append(check["untagged"][0])
    assert max(lags) <= staleness, lags
    if partial:
        assert max(lags) == staleness and spanning > 0, (lags, spanning)
        # (a step whose update barely moved the policy leaves two versions close: the median, not every one)
        assert wrong_tag_gaps and sorted(wrong_tag_gaps)[len(wrong_tag_gaps) // 2] > 100 * ROUNDING_LEVEL, \
            wrong_tag_gaps
    elif staleness == 1:
        assert spanning == 0 and lags[1:] == [1] * 4, (lags, spanning)
    else:  # K = 2 without partial rollout: finished responses wait for their group across a sync
        assert spanning == 0 and max(lags) == 2, (lags, spanning)


def _assert_stopped_at_the_string(model, stop, samples):
    """--stop as vLLM matches it: no response goes on past a stop string completed after its min_tokens-th token
    (the string is looked for in the text its later tokens write), a response it ended keeps the token that
    completed it, and its text ends before the string; some responses did stop there."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    stopped = 0
    for ids, text, forced in samples:
        def decoded(end, start=0):
            return tokenizer.decode(ids[start:end], skip_special_tokens=True)

        before_min = len(decoded(forced))
        assert stop not in decoded(len(ids) - 1)[before_min:], (ids, text)  # nothing generated past a match
        if stop in decoded(len(ids))[before_min:]:  # the last token completed it: the text stops before it
            stopped += 1
            assert decoded(len(ids))[len(text):].startswith(stop) and decoded(len(ids)).startswith(text), (ids, text)
        else:
            assert stop not in text[before_min:], (ids, text)
    assert stopped >= len(samples) // 10, (stopped, len(samples))


@pytest.mark.slow
def test_a_resume_with_responses_in_flight_continues_bit_for_bit(tiny_model, tmp_path):
    """K = 2 with --partial-rollout and DAPO's dynamic sampling through megarl/train.py, 4 steps, a checkpoint after
    step 2: the checkpoint holds step 3's batch and the stream's groups in flight with their tokens, logprobs and
    versions; resumed from it, steps 3 and 4 are the uninterrupted run's exactly (every metric, the partial share,
    the staleness and the groups DAPO gave up included). The training signal is live (non-zero gradients,
    responses resumed across syncs); DAPO gives up groups as they finish, and every batch still has its groups.
    The prompts come from a dataset file, whose draw order only moves forward: the stream reads it ahead of the
    steps and back (its groups in flight span batches), before and after the resume."""
    from test_data_e2e import _dataset

    data = _dataset(tmp_path / "train.jsonl", seed=1, count=40)
    flags = [*SEPARATE, "--model", tiny_model, *STREAM, "--train-steps", "4", "--max-staleness", "2",
             "--partial-rollout", "--dynamic-sampling", "0", "1", "--train-data", data, "--reward", "boxed",
             "--system-prompt", ""]
    torchrun("../../megarl/train.py", *flags, "--save-dir", tmp_path / "ckpt", "--save-interval", "2",
             "--log-dir", tmp_path / "run", timeout=900)
    torchrun("../../megarl/train.py", *flags, "--resume", tmp_path / "ckpt" / "step_00000002",
             "--log-dir", tmp_path / "resumed", timeout=900)
    run, resumed = scalars(tmp_path / "run", COMPARED), scalars(tmp_path / "resumed", COMPARED)
    for tag in COMPARED:
        assert resumed[tag] == {step: run[tag][step] for step in (2, 3)}, (tag, run[tag], resumed[tag])
    assert max(run["partial_fraction"].values()) > 0 and max(run["stream_responses_resumed"].values()) > 0, run
    assert sum(run["stream_groups_filtered"].values()) > 0 and len(run["dapo_reward_all_mean"]) == 4, run
    shares = scalars(tmp_path / "run", [f"token_staleness_share/{lag}" for lag in range(3)])
    for step in range(4):  # the histogram of token lags: its mean is token_staleness_mean
        assert abs(sum(shares[f"token_staleness_share/{lag}"][step] for lag in range(3)) - 1) < 1e-6  # (TensorBoard keeps float32)
        assert abs(sum(lag * shares[f"token_staleness_share/{lag}"][step] for lag in range(3)) -
                   run["token_staleness_mean"][step]) < 1e-6
    assert_signal_alive(tmp_path / "run", what="streaming")
    saved = torch.load(tmp_path / "ckpt" / "step_00000002" / "in_flight.pt", weights_only=False)
    stream = saved["streams"][0]
    started = [r for group in stream["running"] for r in group["responses"]
               if r["response_ids"] and r["finish"] is None]
    assert started and all(len(r["response_ids"]) == len(r["logprobs"]) == len(r["versions"]) for r in started), \
        stream
    assert (saved["step"], len(saved["samples"])) == (2, 16)


# The final reward (mean of the last 10 steps) of examples/quickstart_grpo_separate.yaml, 200 steps, over seeds
# 1234, 1, 2 (tools/learning_bars.py separate-200 stream-K2-partial --window 10; docs/testing.md, "Learning bars"):
# sync 0.643 / 0.620 / 0.651, FINAL_SYNC = (mean, spread); streaming (K = 2, partial, token TIS) read 0.632 / 0.628 /
# 0.604 (mean 0.621: 0.017 below sync's, within its spread). The test holds the sync mean less twice its spread.
FINAL_SYNC = (0.638, 0.031)


@pytest.mark.slow
@pytest.mark.learning  # 200 steps, about 4 minutes on 2 CPU ranks
def test_streaming_learns_as_sync_does(tiny_model, tmp_path):
    """The separate quickstart with K = 2 and --partial-rollout (token TIS on the engine's logprobs) ends at the
    reward the synchronous quickstart ends at, within the synchronous runs' seed-to-seed spread, for the same
    number of samples (issue 55)."""
    mean, spread = FINAL_SYNC
    torchrun("../../megarl/train.py", *SEPARATE, "--model", tiny_model, "--max-staleness", "2", "--partial-rollout",
             "--tis-level", "token", "--log-dir", tmp_path / "tb", timeout=3600)
    rewards = scalars(tmp_path / "tb", ["reward_mean"])["reward_mean"]
    final = sum(rewards[step] for step in sorted(rewards)[-10:]) / 10
    assert len(rewards) == 200 and final >= mean - 2 * spread, (final, FINAL_SYNC)


@pytest.mark.slow
def test_a_standalone_teacher_scores_streamed_samples(tiny_model, tiny_teacher, tmp_path):
    """GKD with the teacher on its own vLLM rank (3 ranks: train, rollout, teacher) and K = 3 with partial rollout:
    the teacher scores each batch's finished samples, whatever versions sampled them; the distillation term is
    live (finite teacher_kl, non-zero gradients) and responses do cross syncs. With --gkd-lmbda 0.5 --seq-kd the
    steps drawn for the teacher's responses have the teacher's ranks generate them in the step (on_policy 0) while
    the stream waits (its responses in flight age a version per such step: K = 3 lets them through), the others
    train on the stream's."""
    from megarl.arguments import parse_args
    from megarl.generation import response_source

    flags = ["--config", "examples/gkd/rollout_colocate_teacher_standalone.yaml", "--colocate-groups", "[]",
             "--model", tiny_model, "--standalone-teacher-model", tiny_teacher, *STREAM, "--train-steps", "5",
             "--max-staleness", "3", "--partial-rollout", "--gkd-lmbda", "0.5", "--seq-kd"]
    torchrun("../../megarl/train.py", *flags, "--log-dir", tmp_path / "tb", nproc=3, timeout=900)
    series = scalars(tmp_path / "tb", ["teacher_kl", "grad_norm", "partial_fraction", "on_policy"])
    seed = parse_args(flags, world_size=3).seed
    drawn = {step: float(response_source(0.5, True, seed, step) == "student") for step in range(5)}
    assert series["on_policy"] == drawn and set(drawn.values()) == {0.0, 1.0}, (series["on_policy"], drawn)
    assert len(series["teacher_kl"]) == 5 and all(abs(kl) < 100 for kl in series["teacher_kl"].values()), series
    assert all(norm > 0 for norm in series["grad_norm"].values()) and max(series["partial_fraction"].values()) > 0
