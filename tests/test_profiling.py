"""--profile-step: the chosen step's update is profiled on every rank (megarl/profiling.py), no other."""

from types import SimpleNamespace

import pytest
import torch

from megarl.profiling import profiled_update


def test_only_the_chosen_step_is_profiled_and_its_table_names_the_operators(tmp_path):
    args = SimpleNamespace(profile_step=2, profile_dir=None, log_dir=str(tmp_path))
    x = torch.randn(64, 64)
    for step in range(3):  # 0-based, as train.py's loop
        with profiled_update(args, step, rank=1):
            (x @ x).sum()
    written = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert written == ["rank1_step2_update.json", "rank1_step2_update.txt"]
    table = (tmp_path / "profile" / "rank1_step2_update.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table


def test_profile_step_is_checked_in_one_line():
    from megarl.arguments import parse_args
    from megarl.errors import ConfigError

    with pytest.raises(ConfigError, match="--profile-step must be >= 0"):
        parse_args(["--model", "artifacts/tiny-qwen2", "--profile-step", "-1"], world_size=1)
    assert parse_args(["--model", "artifacts/tiny-qwen2"], world_size=1).profile_step == 0
