"""Which attention path each sequence length takes on a CPU rank (megarl/models/attention_paths.py): the
pieces built from the probed lengths' choices, the lookup by GEMM library, and the measurement kept per
machine, library and attention shape in --cpu-gemm's file."""

from __future__ import annotations

import json

import pytest
import torch

from megarl import cpu_gemm
from megarl.models import attention_paths
from megarl.models.attention_paths import (KEPT_MAX_TOKENS, SHORT_MAX_TOKENS, describe, path_for,
                                          pieces_from_choices)

LENGTHS = (64, 96, 128, 192, 256, 384, 512, 768, 1024)


@pytest.mark.parametrize("choices, pieces", [
    # a Zen 4-class host: flash up to the geometric mean of 384 and 512, the blocks above
    (["flash"] * 6 + ["blocked"] * 3, ((443, "flash"), (None, "blocked"))),
    # a Zen 5-class host: the short path from between 96 and 128 to between 512 and 768
    (["flash", "flash"] + ["short"] * 5 + ["blocked"] * 2, ((110, "flash"), (627, "short"), (None, "blocked"))),
    # alternating choices stay as measured
    (["short", "flash", "short", "flash", "flash", "blocked", "flash", "blocked", "blocked"],
     ((78, "short"), (110, "flash"), (156, "short"), (313, "flash"), (443, "blocked"), (627, "flash"),
      (None, "blocked"))),
])
def test_each_length_takes_the_nearest_probed_lengths_path(choices, pieces, monkeypatch):
    assert pieces_from_choices(LENGTHS, choices) == pieces
    monkeypatch.setattr(cpu_gemm, "_state", {"onednn": False})
    monkeypatch.setattr(attention_paths, "_measured", {("torch", 2, 1, 8): pieces})
    for length, path in zip(LENGTHS, choices):
        assert path_for(length, 2, 1, 8) == path, length
    assert path_for(5000, 2, 1, 8) == choices[-1]
    assert path_for(1, 2, 1, 8) == choices[0]
    assert path_for(100, 4, 1, 8) == "flash"  # another shape: torch's defaults
    cpu_gemm._state["onednn"] = True  # another library: its own pieces (here oneDNN's defaults)
    assert path_for(100, 2, 1, 8) == "short"


def test_the_short_path_ends_at_its_memory_bound():
    """Probing stopped at 512 (big heads) with the short path fastest there: it ends at SHORT_MAX_TOKENS."""
    pieces = pieces_from_choices(LENGTHS[:7], ["flash"] * 3 + ["short"] * 4)
    assert pieces == ((156, "flash"), (SHORT_MAX_TOKENS, "short"), (None, "blocked"))
    assert describe(pieces) == f"flash up to 156, short 157-{SHORT_MAX_TOKENS}, blocked above {SHORT_MAX_TOKENS} tokens"


def test_the_kept_blocks_end_at_their_memory_bound():
    """The kept blocks fastest up to the last probe (1024): blocks that recompute above KEPT_MAX_TOKENS."""
    pieces = pieces_from_choices(LENGTHS, ["flash"] * 4 + ["kept"] * 5)
    assert pieces == ((221, "flash"), (KEPT_MAX_TOKENS, "kept"), (None, "blocked"))
    assert describe(pieces) == f"flash up to 221, kept 222-{KEPT_MAX_TOKENS}, blocked above {KEPT_MAX_TOKENS} tokens"
    # and a measured path is never given a length past its bound, whatever the probes say
    assert attention_paths._probe_seconds("kept", KEPT_MAX_TOKENS + 1, 2, 1, 8) == float("inf")
    assert attention_paths._probe_seconds("short", SHORT_MAX_TOKENS + 1, 2, 1, 8) == float("inf")


def test_one_path_at_every_length():
    assert pieces_from_choices(LENGTHS, ["flash"] * 9) == ((None, "flash"),)
    assert describe(((None, "flash"),)) == "flash at every length"


def test_the_defaults_apply_where_nothing_was_measured(monkeypatch):
    """oneDNN's: the Zen 5-class host's windows; torch's GEMMs: the flash kernel."""
    monkeypatch.setattr(cpu_gemm, "_state", {"onednn": True})
    assert [path_for(n, 3, 3, 5) for n in (1, 99, 100, 511, 512, 10**6)] == [
        "flash", "flash", "short", "short", "blocked", "blocked"]
    cpu_gemm._state["onednn"] = False
    assert {path_for(n, 3, 3, 5) for n in (1, 99, 100, 511, 512, 10**6)} == {"flash"}


@pytest.mark.parametrize("library", ["torch", pytest.param("onednn", marks=pytest.mark.skipif(
    not cpu_gemm.onednn_available(), reason="torch built without oneDNN"))])
def test_the_measurement_is_kept_per_machine_library_and_shape(monkeypatch, tmp_path, library):
    """The first choice measures (the run's random state untouched) and keeps the pieces under this library and
    shape; the next takes them without measuring (forged pieces prove the file is read); an invalid kept value
    is measured over; another shape, and the same shape with the other library, are measured on their own."""
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(attention_paths, "_measured", {})
    monkeypatch.setattr(attention_paths, "PROBE_LENGTHS", (64, 128))
    monkeypatch.setattr(cpu_gemm, "_state", {"onednn": False})
    cpu_gemm.use(library)
    entry = f"{cpu_gemm.machine_key()} | attention with {library} GEMMs: 2 heads in 1 groups of 8"

    state = torch.get_rng_state()
    pieces, decided_by = attention_paths.choose(2, 1, 8)
    assert torch.equal(torch.get_rng_state(), state)
    assert decided_by == "measured at start-up"
    assert pieces[-1][0] is None and {path for _, path in pieces} <= set(attention_paths.PATHS)
    assert json.loads(cpu_gemm.cache_path().read_text())[entry] == [list(piece) for piece in pieces]

    cpu_gemm.keep(entry, [[70, "kept"], [None, "blocked"]])
    monkeypatch.setattr(attention_paths, "measure", lambda *args, **kwargs: pytest.fail("measured kept pieces"))
    pieces, decided_by = attention_paths.choose(2, 1, 8)
    assert pieces == ((70, "kept"), (None, "blocked")) and decided_by.startswith("measured on this machine before")
    assert [path_for(n, 2, 1, 8) for n in (10, 70, 71)] == ["kept", "kept", "blocked"]

    measured = []
    monkeypatch.setattr(attention_paths, "measure", lambda *args, **kwargs: measured.append(args) or
                        (((None, "flash"),)))
    for invalid in ([[None, "warp"]], [[10, "flash"]], "flash", [[None]]):
        cpu_gemm.keep(entry, invalid)
        assert attention_paths.choose(2, 1, 8) == (((None, "flash"),), "measured at start-up")
    assert attention_paths.choose(4, 2, 8)[1] == "measured at start-up"
    other = "torch" if library == "onednn" else "onednn"
    if cpu_gemm.onednn_available():
        cpu_gemm.use(other)
        assert attention_paths.choose(2, 1, 8)[1] == "measured at start-up"
    assert len(measured) == 5 + cpu_gemm.onednn_available()
    assert set(json.loads(cpu_gemm.cache_path().read_text())) == {
        entry, entry.replace("2 heads in 1", "4 heads in 2")} | (
        {entry.replace(f"with {library}", f"with {other}")} if cpu_gemm.onednn_available() else set())


def test_a_colocated_teacher_of_another_shape_gets_its_own_pieces(monkeypatch, tmp_path, tiny_model, capsys):
    """With packed rows a train rank chooses pieces for every attention shape it runs: the policy's and a
    colocated teacher's of another size (which would otherwise take the defaults), one log line each; a
    teacher of the policy's shape shares its pieces. Without packed rows nothing is measured."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from megarl import accelerator
    from megarl.arguments import parse_args
    from megarl.run import _choose_cpu_gemm

    if accelerator.ON_CUDA:
        pytest.skip("CPU ranks only: on GPU the GEMMs are cuBLAS's")
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(attention_paths, "_measured", {})
    monkeypatch.setattr(attention_paths, "PROBE_LENGTHS", (64, 128))
    monkeypatch.setattr(cpu_gemm, "_state", {"onednn": False, "decided_by": "--cpu-gemm"})
    policy = AutoConfig.from_pretrained(tiny_model)
    teacher = AutoConfig.from_pretrained(tiny_model)
    teacher.hidden_size, teacher.num_attention_heads = 2 * policy.hidden_size, 2 * policy.num_attention_heads
    teacher.save_pretrained(tmp_path / "teacher")
    rank0 = SimpleNamespace(rank=0)  # all _choose_cpu_gemm reads of the run's DistContext
    policy_shape = (policy.num_attention_heads, policy.num_key_value_heads,
                    policy.hidden_size // policy.num_attention_heads)
    teacher_shape = (2 * policy_shape[0], policy_shape[1], policy_shape[2])

    args = parse_args(["--model", tiny_model, "--teacher-model", str(tmp_path / "teacher"), "--cpu-gemm", "torch",
                       "--padding-free"], world_size=1)
    _choose_cpu_gemm(args, rank0, policy)
    said = [line for line in capsys.readouterr().out.splitlines() if "packed attention" in line]
    assert len(said) == 2, said
    assert said[0].startswith("megarl: packed attention on CPU: ") and said[0].endswith("(measured at start-up)")
    assert said[1].startswith(f"megarl: packed attention on CPU (teacher: {teacher_shape[0]} heads in "
                              f"{teacher_shape[1]} groups of {teacher_shape[2]}): ")
    assert set(attention_paths._measured) == {("torch", *policy_shape), ("torch", *teacher_shape)}
    kept = json.loads(cpu_gemm.cache_path().read_text())
    marker = " | attention with torch GEMMs: "
    assert {entry.split(marker)[1] for entry in kept if marker in entry} == {
        f"{h} heads in {g} groups of {d}" for h, g, d in (policy_shape, teacher_shape)}

    args = parse_args(["--model", tiny_model, "--teacher-model", tiny_model, "--cpu-gemm", "torch",
                       "--padding-free"], world_size=1)
    _choose_cpu_gemm(args, rank0, policy)
    said = [line for line in capsys.readouterr().out.splitlines() if "packed attention" in line]
    assert len(said) == 1 and said[0].endswith(f"(measured on this machine before, kept in {cpu_gemm.cache_path()})")

    monkeypatch.setattr(attention_paths, "_measured", {})
    _choose_cpu_gemm(parse_args(["--model", tiny_model, "--cpu-gemm", "torch"], world_size=1), rank0, policy)
    assert not [line for line in capsys.readouterr().out.splitlines() if "packed attention" in line]
    assert attention_paths._measured == {}


def test_the_blocks_that_recompute_are_timed_only_past_the_kept_blocks_bound(monkeypatch):
    """Where the kept blocks apply they do the recomputing blocks' work less a GEMM and an exponential per block:
    a probe that found the recomputing blocks faster there (a host's drift) is not asked; past the kept blocks'
    bound they are timed and taken."""
    timed = []

    def probe(path, length, *shape):
        timed.append((path, length))
        if length > attention_paths.LONGEST.get(path, length):
            return float("inf")
        return {"blocked": 0.001, "kept": 0.002, "short": 0.003, "flash": 0.004}[path]  # seconds

    monkeypatch.setattr(attention_paths, "_probe_seconds", probe)
    monkeypatch.setattr(attention_paths, "PROBE_LENGTHS", (128, 2 * KEPT_MAX_TOKENS))
    assert attention_paths.measure(2, 1, 8) == ((512, "kept"), (None, "blocked"))
    assert ("blocked", 128) not in timed and ("blocked", 2 * KEPT_MAX_TOKENS) in timed
