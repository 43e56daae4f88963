"""Gym-style environments (--gym-env; megarl/tools/environments.py): the built-in frozen_lake's rules, the replay
that rebuilds an episode's state at each turn, the `gym` reward, one-line refusals, and a GRPO run whose episodes
the environment opens, answers and scores."""

import json

import pytest

from helpers import torchrun


def test_frozen_lake_plays_by_its_rules():
    """The map is a function of the seed with a path from S to G; a move off the grid stays, a reply without a
    move is told so, a hole ends at 0, the goal at 1."""
    from megarl.tools.environments import FrozenLake, lake_map

    assert lake_map(4, 0.8, 7) == lake_map(4, 0.8, 7) and lake_map(4, 0.8, 7) != lake_map(4, 0.8, 8)
    env = FrozenLake({"seed": 7})
    observation, system = env.reset()
    assert "<action>" in system and "row" in observation and "P" in observation
    env.grid, env.row, env.col = ["SFFH", "FHFF", "FFFF", "FFFG"], 0, 0
    assert env.step("<action>up</action>")[1:] == (0.0, False) and (env.row, env.col) == (0, 0)
    assert "Invalid response" in env.step("I think I shall wait")[0] and (env.row, env.col) == (0, 0)
    assert env.step("go <action>right</action>")[1:] == (0.0, False) and (env.row, env.col) == (0, 1)
    assert env.step("<action>down</action>")[1:] == (0.0, True)  # a hole
    env.row, env.col = 3, 2
    observation, reward, done = env.step("<action>right</action>")
    assert (reward, done) == (1.0, True) and "reached the goal" in observation


def test_an_episode_is_replayed_to_the_turn_it_answers():
    """gym:frozen_lake's respond rebuilds the state from the episode's earlier turns: the answer to turn k is the
    observation a live environment gives after the same k moves; the last step's reward, None at the end."""
    from megarl.tools import CallContext
    from megarl.tools.environments import EnvStep, FrozenLake
    from megarl.tools.interactions import INTERACTIONS

    respond = INTERACTIONS["gym:frozen_lake"](None)
    row = {"env_config": {"seed": 11}}
    live = FrozenLake(row["env_config"])
    live.reset()
    turns = []
    for k, move in enumerate(["right", "down", "left", "down", "right", "down"]):
        turns.append({"role": "assistant", "content": f"<action>{move}</action>"})
        expected, reward, done = live.step(turns[-1]["content"])
        answer = respond(turns, CallContext(row, 0, 0, k + 1))
        assert answer == EnvStep(None if done else expected, reward), (k, answer, expected)
        if done:
            break
        turns.append({"role": "user", "content": answer.observation})


def test_a_row_without_a_seed_gets_one_so_its_replay_sees_one_map(tmp_path):
    """A row whose env_config names no seed (ms-swift's own frozen_lake data can omit it) is given one per row,
    fixed by --seed: the opening's board and the board each replayed turn rebuilds are the same map (unseeded,
    every turn would draw another); other rows, or another --seed, get other maps."""
    from types import SimpleNamespace

    from megarl.data.datasets import load_rows
    from megarl.data.sources import with_environment
    from megarl.tools import CallContext
    from megarl.tools.environments import FrozenLake
    from megarl.tools.interactions import INTERACTIONS

    data = tmp_path / "lake.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "."}], **extra}) + "\n"
                            for extra in ({}, {"env_config": {"size": 4}}, {"env_config": {"seed": None}},
                                          {"env_config": {"seed": 5}})))

    def boards(seed):
        rows = with_environment(SimpleNamespace(gym_env="frozen_lake", seed=seed), load_rows([str(data)]))
        return rows, [row.messages[-1]["content"] for row in rows]

    rows, openings = boards(1)
    assert rows[3].extra["env_config"] == {"seed": 5}  # a row's own seed is kept
    assert all(row.extra["env_config"]["seed"] is not None for row in rows) and len(set(openings[:3])) == 3
    assert boards(1)[1] == openings and boards(2)[1][:3] != openings[:3]
    respond = INTERACTIONS["gym:frozen_lake"](None)
    for row, opening in zip(rows, openings):
        env = FrozenLake(row.extra["env_config"])
        assert env.reset()[0] == opening
        turns = []
        for k in range(3):  # moves into a wall where possible: the episode goes on, so each turn replays the map
            turns.append({"role": "assistant", "content": "<action>up</action>"})
            answer = respond(turns, CallContext(row.as_metadata(), 0, 0, k + 1))
            expected = env.step(turns[-1]["content"])
            assert answer.observation == (None if expected[2] else expected[0]), (row.origin, k)
            if expected[2]:
                break
            turns.append({"role": "user", "content": answer.observation})


def test_the_gym_reward_is_the_episode_return():
    from megarl.rewards import get_reward

    gym = get_reward("gym").fn
    turns = [{"role": "assistant", "content": "a", "env_reward": 0.0}, {"role": "user", "content": "o"},
             {"role": "assistant", "content": "b", "env_reward": 1.0}]
    assert gym("b", {"conversation": turns}).score == 1.0
    assert gym("b", {"conversation": turns[:1]}).score == 0.0
    assert gym("x", {}).reason == "no environment step"


@pytest.mark.parametrize("flags,words", [
    (["--gym-env", "frozen_lak"], ["--gym-env: frozen_lak not registered", "frozen_lake"]),
    (["--gym-env", "frozen_lake", "--interaction", "retry"], ["--interaction retry", "keep one"]),
    (["--gym-env", "frozen_lake", "no data"], ["--train-data", "env_config"]),
])
def test_bad_gym_input_is_one_line(flags, words, tiny_model, tmp_path):
    from megarl.arguments import parse_args
    from megarl.errors import ConfigError

    data = tmp_path / "lake.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "."}], "env_config": {"seed": 1}}) + "\n")
    data_flags = [] if "no data" in flags else ["--train-data", str(data)]
    with pytest.raises(ConfigError) as error:
        parse_args(["--config", "examples/quickstart_grpo.yaml", "--model", tiny_model, *data_flags,
                    *[flag for flag in flags if flag != "no data"]], world_size=2)
    assert "\n" not in str(error.value) and all(word in str(error.value) for word in words), error.value


@pytest.fixture(scope="module")
def long_context_policy(tiny_model, tmp_path_factory):
    """The tiny model with room for frozen_lake's prompt (its rules and board: ~550 of the tiny tokenizer's
    tokens) and a few turns: max_position_embeddings 2048."""
    from helpers import with_positions

    return with_positions(tiny_model, 2048, tmp_path_factory.mktemp("gym_policy"))


@pytest.mark.slow
def test_grpo_on_frozen_lake_episodes(long_context_policy, tmp_path):
    """2 GRPO steps on ms-swift's frozen_lake data layout (a placeholder message and an env_config per row):
    each prompt is the environment's opening for its seed, each episode's user turns are what a live
    environment says to its moves, every stepped turn carries its reward, and the sample's reward is their sum."""
    from megarl.tools.environments import FrozenLake, opening

    data = tmp_path / "frozen_lake.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "<placeholder>"}],
                                        "env_config": {"seed": seed}}) + "\n" for seed in range(8)))
    dumps = tmp_path / "dumps"
    torchrun("../../megarl/train.py", "--config", "examples/quickstart_grpo.yaml", "--model", long_context_policy,
             "--train-data", data, "--gym-env", "frozen_lake", "--max-turns", "3", "--max-new-tokens", "96",
             "--max-prompt-length", "640", "--train-steps", "2", "--prompts-per-step", "2", "--num-generations", "4",
             "--micro-batch-size", "4", "--log-dir", "", "--rollout-save-dir", dumps, timeout=900)
    records = [json.loads(line) for path in sorted(dumps.glob("train_step*.jsonl"))
               for line in path.read_text().splitlines()]
    assert len(records) == 16
    stepped = 0
    for record in records:
        seed = next(s for s in range(8) if opening("frozen_lake", {"env_config": {"seed": s}})[1]["content"] in
                    record["prompt"])
        live = FrozenLake({"seed": seed})
        live.reset()
        total, turns = 0.0, record["conversation"]
        for k, turn in enumerate(turns):
            if turn["role"] != "assistant" or "env_reward" not in turn:
                continue
            stepped += 1
            observation, reward, done = live.step(turn["content"])
            assert turn["env_reward"] == reward
            total += reward
            if not done and k + 1 < len(turns):
                assert turns[k + 1] == {"role": "user", "content": observation, "seconds": turns[k + 1]["seconds"]}
        assert record["reward"] == total, record
    assert stepped >= len(records)  # every episode's first turn was stepped (none ran out of tokens before it)
