"""A test plugin: the arithmetic reward, slowed down (MEGARL_TEST_REWARD_SLEEP seconds per sample), that
appends the name of the thread it ran on to MEGARL_TEST_REWARD_THREADS (one line per call)."""

import os
import threading
import time

from megarl.rewards import register_reward
from megarl.rewards.arithmetic import arithmetic_reward


@register_reward("slow_arithmetic")
def slow_arithmetic(response: str, row: dict):
    time.sleep(float(os.environ.get("MEGARL_TEST_REWARD_SLEEP", "0")))
    with open(os.environ["MEGARL_TEST_REWARD_THREADS"], "a") as f:
        f.write(threading.current_thread().name + "\n")
    return arithmetic_reward(response, row)
