"""Gym-style environments (--gym-env NAME; ms-swift's `multi_turn_scheduler: gym_scheduler` with `gym_env`).

An environment plays a multi-turn episode with the policy: it opens it (its first observation is the prompt's
user message, after its system prompt), answers every assistant turn with an observation and a reward, and says
when the episode is over. The episode's reward is the sum of its step rewards (`--reward gym`).

An environment is a class registered under a name (`@register_environment(name)`; plugins register more the same
way) with:
  __init__(env_config: dict)    the dataset row's `env_config` ({} when it has none): e.g. a seed;
  reset() -> (observation, system_prompt | None)
  step(assistant_text) -> (observation, reward, done)
It must be a function of its env_config and the actions it is given (seed any randomness from env_config's
`seed`; a row without one is given one, fixed per row by --seed): megarl does not keep an environment object per
episode. It rebuilds the state at each turn by a reset and a
replay of the episode's earlier assistant turns, on the tool worker thread that answers (so an episode survives a
weight sync, a streaming restart or a checkpoint without any environment state to save).

How it runs: `--gym-env NAME` is the interaction `gym:NAME` (megarl/tools/interactions.py): after an assistant turn
that calls no tool, the environment steps on the turn's text; the step's reward is recorded on that turn
(`env_reward`, read by the `gym` reward), its observation appended as the user's message (policy mask 0), and the
episode ends when the environment is done, at --max-turns, or at the token budget. The rows' prompts are the
environment's opening (`opening`): what the row's messages held (ms-swift's frozen_lake data has a placeholder)
is replaced.

Built in: `frozen_lake` (ms-swift's examples/megatron/grpo/multi_turn/frozen_lake_plugin.py, from ROLL's text
FrozenLake: a random solvable map per env_config seed, one move per turn inside <action>...</action>; written
here from its description).
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass

from megarl.registry import Registry
from megarl.rewards import RewardOutput, register_reward
from megarl.tools.interactions import last_answer, register_interaction

ENVIRONMENTS = Registry("gym environment")  # name -> class(env_config)


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to a turn (a reply type of an interaction): the step's reward, and the observation
    the user then says, or None when the episode is over."""
    observation: str | None
    reward: float


def register_environment(name: str):
    """Decorator: register an environment class as `name` (--gym-env) and as the interaction `gym:<name>`."""
    def wrap(cls):
        ENVIRONMENTS.add(name, cls)
        register_interaction(f"gym:{name}")(lambda reward: _respond(cls))
        return cls
    return wrap


def env_config(row: dict) -> dict:
    config = row.get("env_config") or {}
    if not isinstance(config, dict):
        raise ValueError(f"gym environment: the row's env_config must be a mapping, got {type(config).__name__}")
    return config


def seeded(row: dict, key: str) -> dict:
    """The row's env_config with a `seed` (the convention every environment draws its randomness from): its own,
    else one derived from `key` (stable across processes and runs, unlike Python's hash)."""
    config = env_config(row)
    return config if config.get("seed") is not None else {**config, "seed": zlib.crc32(key.encode())}


def opening(name: str, row: dict) -> list[dict]:
    """The prompt's messages of an episode of environment `name` on dataset row `row` (its env_config): the
    environment's system prompt, if any, and its first observation as the user's message."""
    observation, system = ENVIRONMENTS[name](env_config(row)).reset()
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": observation}]


def _respond(cls):
    def respond(turns: list[dict], context) -> EnvStep:
        env = cls(env_config(context.row))
        env.reset()
        actions = [m["content"] for m in turns if m["role"] == "assistant"]
        for action in actions[:-1]:  # the state before this turn: the episode so far, replayed
            env.step(action)
        observation, reward, done = env.step(last_answer(turns))
        return EnvStep(None if done else observation, float(reward))
    return respond


@register_reward("gym", system_prompt="")
def gym_reward(response: str, row: dict) -> RewardOutput:
    """The episode's return: the sum of the step rewards its environment gave (each assistant turn's
    `env_reward`; ms-swift's gym scheduler's total_reward)."""
    rewards = [m["env_reward"] for m in row.get("conversation") or [] if "env_reward" in m]
    if not rewards:
        return RewardOutput(0.0, "no environment step")
    return RewardOutput(float(sum(rewards)), f"{len(rewards)} steps")


# ------------------------------------------------------------------------------------------- frozen_lake ----

FROZEN_LAKE_SYSTEM = (
    "You are playing FrozenLake. You see a grid where:\n"
    "  P = your current position, S = start, G = goal, H = hole, F = safe ice.\n"
    "Move one cell per turn. Reach G to win (+1 reward). Stepping into H ends the episode with 0 reward. "
    "Moves that would go off the grid leave you in place.\n\n"
    "On every turn, output your move inside <action>...</action>. "
    "The action must be exactly one of: up, down, left, right.\n\n"
    "Example: <action>down</action>")
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_TAGGED_MOVE = re.compile(r"<action>\s*(up|down|left|right)\s*</action>", re.IGNORECASE)
_ANY_MOVE = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)


def lake_map(size: int, frozen: float, seed) -> list[str]:
    """A size x size map (rows of S, G, F, H) with a path from S to G: each cell safe ice with probability
    `frozen`, S and G at random distinct cells, drawn again until G is reachable; the same for the same seed."""
    rng = random.Random(seed)
    while True:
        grid = [["F" if rng.random() < frozen else "H" for _ in range(size)] for _ in range(size)]
        start, goal = divmod(rng.randrange(size * size), size), divmod(rng.randrange(size * size), size)
        if start == goal:
            continue
        grid[start[0]][start[1]], grid[goal[0]][goal[1]] = "S", "G"
        if _reachable(grid, start):
            return ["".join(row) for row in grid]


def _reachable(grid: list[list[str]], start: tuple[int, int]) -> bool:
    size, seen, todo = len(grid), set(), [start]
    while todo:
        r, c = todo.pop()
        if (r, c) in seen:
            continue
        seen.add((r, c))
        for dr, dc in MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < size and 0 <= nc < size and grid[nr][nc] != "H":
                if grid[nr][nc] == "G":
                    return True
                todo.append((nr, nc))
    return False


@register_environment("frozen_lake")
class FrozenLake:
    """env_config: seed (the map), size (4), p (0.8: the share of safe ice). Reward 1 on reaching G; a hole ends
    the episode at 0; a reply without a move keeps the player in place and says so."""

    def __init__(self, env_config: dict):
        self.size, self.frozen = int(env_config.get("size", 4)), float(env_config.get("p", 0.8))
        self.seed = env_config.get("seed")
        self.grid, self.row, self.col, self.steps = [], 0, 0, 0

    def reset(self) -> tuple[str, str]:
        self.grid = lake_map(self.size, self.frozen, self.seed)
        self.row = next(r for r, line in enumerate(self.grid) if "S" in line)
        self.col, self.steps = self.grid[self.row].index("S"), 0
        return (f"FrozenLake {self.size}x{self.size}:\n{self._board()}\n\n"
                f"You are at row {self.row}, col {self.col}. Output your first move.", FROZEN_LAKE_SYSTEM)

    def step(self, text: str) -> tuple[str, float, bool]:
        self.steps += 1
        tagged, loose = _TAGGED_MOVE.search(text), _ANY_MOVE.findall(text)
        move = tagged.group(1).lower() if tagged else (loose[-1].lower() if loose else None)
        if move is None:
            return (f"Invalid response: could not find a move. Reply with <action>up|down|left|right</action>.\n\n"
                    f"{self._board()}", 0.0, False)
        dr, dc = MOVES[move]
        self.row = min(max(self.row + dr, 0), self.size - 1)
        self.col = min(max(self.col + dc, 0), self.size - 1)
        cell = self.grid[self.row][self.col]
        if cell == "G":
            return f"You moved {move} and reached the goal!\n{self._board()}", 1.0, True
        if cell == "H":
            return f"You moved {move} and fell into a hole. Episode over.\n{self._board()}", 0.0, True
        return (f"You moved {move}. Now at row {self.row}, col {self.col} (step {self.steps}).\n{self._board()}\n"
                f"Output your next move.", 0.0, False)

    def _board(self) -> str:
        """The grid with the player as P (* on the goal), cells spaced."""
        rows = []
        for r, line in enumerate(self.grid):
            cells = list(line)
            if r == self.row:
                cells[self.col] = "*" if cells[self.col] == "G" else "P"
            rows.append(" ".join(cells))
        return "\n".join(rows)
