"""A test plugin: rewards that hang or kill their process on some responses, else the arithmetic reward.

  hanging_arithmetic  sleeps for ever when the response contains "HANG" (or, with MEGARL_TEST_HANG_EVERY=k,
                      on every k-th call of the process);
  dying_arithmetic    os._exit(3) when the response contains "DIE";
  pid_arithmetic      the arithmetic reward, its reason the pid of the process that scored it.
"""

import os
import time

from megarl.rewards import RewardOutput, register_reward
from megarl.rewards.arithmetic import arithmetic_reward

_calls = 0


@register_reward("hanging_arithmetic")
def hanging_arithmetic(response: str, row: dict):
    global _calls
    _calls += 1
    every = int(os.environ.get("MEGARL_TEST_HANG_EVERY", "0"))
    if "HANG" in response or (every and _calls % every == 0):
        while True:
            time.sleep(3600)
    return arithmetic_reward(response, row)


@register_reward("dying_arithmetic")
def dying_arithmetic(response: str, row: dict):
    if "DIE" in response:
        os._exit(3)
    return arithmetic_reward(response, row)


@register_reward("pid_arithmetic")
def pid_arithmetic(response: str, row: dict):
    return RewardOutput(arithmetic_reward(response, row).score, str(os.getpid()))
