"""Checkpoints that a crash cannot corrupt, and exact resumption.

Layout of --save-dir:

    step_00000010/            a complete checkpoint (after 10 training steps)
        dist/                 Megatron distributed checkpoint (torch_dist): policy and
                              critic models and optimizers, sharded by TP/PP; loads
                              at any other TP/PP size (Megatron reshards on load); the
                              distributed optimizer's states in the fully_reshardable
                              layout (shaped like the parameters), so they load at
                              another DP size too
        rng/rank_00000.pt     each rank's torch / Python / numpy RNG states
        in_flight.pt          --async-generation: the next step's samples, generated and
                              scored during this step by the rollout ranks (see below)
        hf_config/            the policy's HF config and tokenizer (for tools/export_hf.py)
        state.json            step, each role's state (LR schedule), the run's (KL
                              controller, data position, weight version), seeds; with
                              LoRA the adapters' shape and their base (`lora`); written last
    .partial_step_00000012/   a checkpoint being written

Publishing: every rank writes into `.partial_step_N`, all ranks meet, then rank 0
writes `state.json` and renames the directory to `step_N` (an atomic rename on one
file system). A run killed during a save leaves only a `.partial_*` directory,
which `--resume auto` never picks and the next save removes. After publishing,
all but the newest --save-keep checkpoints are deleted (renamed out of the step_N
names first, so a kill mid-delete never leaves a half-deleted step_N). A write that
fails (a full disk) fails on every rank after the same collectives, with one line
(CheckpointWriteError) naming the checkpoint; the previous ones are untouched.

What is not saved, because it is rebuilt exactly: the reference model (from
--ref-model), a LoRA policy's frozen base (from --model: dist/ holds its adapters and their
optimizer state; megarl/models/lora.py), the rollout engines (they receive the policy by a weight sync right
after loading, which is not a new weight version), sampling state (each generate
call reseeds from --seed and the step; see RolloutEngine.generate), and the prompts
(a function of --seed and the step, plus the data position saved here).

In flight (--async-generation): when step k is saved, the rollout ranks have already
generated and scored step k+1's samples with the weights of version k-1; resumed,
they would be regenerated with the loaded weights, one version newer, and the run
would not continue as it would have. So they are saved: every rank's part is gathered
(the rollout ranks hold them; generation.ShardSamples.state_dict) and rank 0 writes the
whole step's samples, each with its weight version, in one file. A resumed run with
--async-generation hands them all to its rank 0, whose share the generate phase then
gathers and orders by prompt as it gathers the engines' shares: the same samples in the
same order, at any placement or layout (the samples carry their weight version and
reward; nothing about the engines that made them is needed). The data position and
the RNG states saved with them are those after they were drawn, as in the run that
continued. A run
resumed without --async-generation ignores them and generates step k+1 with the loaded
weights, as a synchronous run does.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil

import numpy as np
import torch

from megarl import distributed

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_IN_FLIGHT = "in_flight.pt"


class CheckpointError(Exception):
    """Every rank raises it alike; rank 0 says it in one line, no traceback."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a quota, a file size limit)."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint cannot be resumed with these options (its optimizer states are laid out otherwise)."""


def step_dir_name(completed_steps: int) -> str:
    return f"step_{completed_steps:08d}"


def find_latest(save_dir: str) -> str | None:
    """The newest complete checkpoint under save_dir (a published step_N with its state.json), or None."""
    if not os.path.isdir(save_dir):
        return None
    complete = [name for name in os.listdir(save_dir)
                if _STEP_DIR.match(name) and os.path.isfile(os.path.join(save_dir, name, "state.json"))]
    return os.path.join(save_dir, max(complete)) if complete else None


def resolve_resume(resume: str | None, save_dir: str | None) -> str | None:
    """--resume: None/"none" -> start fresh; "auto" -> newest under --save-dir (fresh if none); else a path."""
    if resume in (None, "none"):
        return None
    if resume == "auto":
        return find_latest(save_dir) if save_dir else None
    if not os.path.isfile(os.path.join(resume, "state.json")):
        raise FileNotFoundError(f"--resume {resume}: not a complete megarl checkpoint (no state.json)")
    return resume


def _sharded_state_dict(run, is_loading: bool, optimizer: bool = True) -> dict:
    state = {}
    for name, role in run.trainables().items():
        state.update(role.sharded_state_dict(name, is_loading=is_loading, optimizer=optimizer))
    return state


def _use_in_process_results_queue() -> None:
    """Megatron's checkpoint writer reports its results through a queue served by a
    multiprocessing Manager started with spawn. That server process outlives the rank
    (nothing shuts it down) and keeps the rank's stdout/stderr open, so whoever
    waits on them (a launcher, a test) hangs. Saves here are synchronous: the queue
    is only used inside this process, so a plain queue does the same job."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save(run, completed_steps: int, save_dir: str, keep: int, in_flight=None) -> str:
    """Write a checkpoint of the run after `completed_steps` steps; collective over every rank.
    `in_flight`: --async-generation's generation.ShardSamples of the next step, already generated (every rank
    passes its own, or every rank None).

    A write that fails (a full disk, a quota, a file size limit) fails on every rank alike, after the same
    collectives: CheckpointWriteError, one line naming the checkpoint and the newest complete one, which
    is left as it was; the partial directory is removed."""
    from megatron.core import dist_checkpointing

    context, rank = run.context, run.context.rank
    in_flight = _gather_in_flight(run, in_flight, completed_steps) if in_flight is not None else None
    final = os.path.join(save_dir, step_dir_name(completed_steps))
    partial = os.path.join(save_dir, "." + step_dir_name(completed_steps).replace("step_", "partial_step_"))

    def make_directories():
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(os.path.join(partial, "rng"))
        os.makedirs(os.path.join(partial, "dist"))

    def write_parts():
        if run.trainables():
            _use_in_process_results_queue()
            # Collective over the train ranks (the train world); a failed write raises on each of them.
            dist_checkpointing.save(_sharded_state_dict(run, is_loading=False, optimizer=not run.args.no_save_optim),
                                    os.path.join(partial, "dist"))
        if not run.args.no_save_rng:  # without it a resumed run's RNGs start from --seed
            torch.save(_rng_state(), os.path.join(partial, "rng", f"rank_{rank:05d}.pt"))
        if rank == 0:
            _save_hf_config(run, os.path.join(partial, "hf_config"))
            if in_flight is not None:
                torch.save(in_flight, os.path.join(partial, _IN_FLIGHT))

    def publish():
        _write_json(os.path.join(partial, "state.json"), _run_state(run, completed_steps, in_flight))
        _replace(partial, final)

    # Each stage ends with every rank meeting and sharing its failure, if any: the directory exists for
    # everyone; every rank's part is on disk; rank 0 published the checkpoint.
    for stage, writer in ((make_directories, 0), (write_parts, None), (publish, 0)):
        failure = _write_failure(stage) if writer in (None, rank) else None
        failed = [f"rank {r}: {f}" for r, f in enumerate(distributed.all_gather_objects(failure, context)) if f]
        if failed:
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            latest = find_latest(save_dir)
            kept = (f"the newest complete checkpoint, {latest}, is intact: --resume auto resumes from it" if latest
                    else "there is no complete checkpoint yet")
            raise CheckpointWriteError(f"could not write checkpoint {final} (in {partial}): {failed[0]}; "
                                       f"{_free_space(save_dir)}; {kept}")
    if rank == 0:
        _prune(save_dir, keep)
    return final


def _gather_in_flight(run, shard, completed_steps: int) -> dict | None:
    """Collective: every rank's part of the in-flight step (generation.ShardSamples) -> the whole step on rank 0,
    the samples in launch-rank order (the generate phase orders them by prompt, stably), the slowest rank's
    seconds (what the generate phase would report); None elsewhere."""
    if shard.step != completed_steps:
        raise ValueError(f"in-flight samples of step {shard.step + 1} saved after step {completed_steps}")
    stream = getattr(run, "stream", None)
    stream = stream.state_dict() if stream is not None and run.rollout.is_leader else None
    parts = distributed.all_gather_objects({**shard.state_dict(), "stream": stream}, run.context)
    if run.context.rank != 0:
        return None
    stats = {}
    for part in parts:
        for name, count in part["stats"].items():
            stats[name] = stats.get(name, 0) + count
    streams = {part["stream"]["engine_index"]: part["stream"] for part in parts if part["stream"] is not None}
    return {**parts[0], "samples": [sample for part in parts for sample in part["samples"]],
            "reward_seconds": max(part["reward_seconds"] for part in parts),
            "seconds": max(part["seconds"] for part in parts), "stats": stats, "stream": None, "streams": streams}


def _write_failure(write) -> str | None:
    """Run write(); None, or what failed in one line. Failed writes surface as OSError (ENOSPC, EFBIG, EDQUOT),
    as RuntimeError from torch.save's stream writer, or as a CheckpointException (a BaseException) from
    Megatron's distributed save, which lists each rank's failure; the last line names the cause."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        write()
    except (OSError, RuntimeError, CheckpointException) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]
    return None


def _free_space(save_dir: str) -> str:
    """The file system's free space, and the file size limit (ulimit -f) when there is one."""
    import resource

    try:
        free = f"{shutil.disk_usage(save_dir).free / 2**20:.1f} MiB free on its file system"
    except OSError:
        free = "its file system's free space unknown"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return free if limit == resource.RLIM_INFINITY else f"{free}, file size limit {limit / 2**20:.1f} MiB"


def _replace(partial: str, final: str) -> None:
    """Publish `partial` as `final`. A re-save of the same step (e.g. preemption right after a save) moves the
    old one aside first: a kill in between leaves no half-deleted `final` that --resume auto could pick."""
    if os.path.exists(final):
        aside = os.path.join(os.path.dirname(final), ".replaced_" + os.path.basename(final))
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        os.rename(partial, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(partial, final)


def load(run, path: str) -> int:
    """Restore the run from checkpoint `path`; returns the number of completed steps."""
    from megatron.core import dist_checkpointing

    state = read_state(path)
    _check_optimizer_layout(state.get("parallel", {}), run.args, path)
    _check_lora(state.get("lora"), run, path)
    trainables = run.trainables()
    if trainables:
        saved = state["roles"]
        for name in trainables:
            if name not in saved:
                raise ValueError(f"{path}: the checkpoint has no {name} (was it saved by a run without one?)")
        # A checkpoint saved with --no-save-optim holds no optimizer states: Adam's moments start afresh.
        loaded = dist_checkpointing.load(_sharded_state_dict(run, is_loading=True,
                                                             optimizer=state.get("optimizer_saved", True)),
                                         os.path.join(path, "dist"))
        for name, role in trainables.items():
            role.load_sharded_state_dict(loaded, name)
            role.load_state_dict(saved[name])
    run.load_state_dict(state["run"])
    rng_file = os.path.join(path, "rng", f"rank_{run.context.rank:05d}.pt")
    if os.path.exists(rng_file):  # absent when resuming on more ranks than saved
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return int(state["completed_steps"])


def load_in_flight(run, path: str, completed_steps: int):
    """--async-generation: the next step's samples saved in checkpoint `path` (see the module docstring) as this
    rank's generation.ShardSamples: all of them on rank 0, none elsewhere. None without --async-generation or
    when the checkpoint has none (saved by a synchronous run, or after the last step)."""
    from megarl.generation import ShardSamples

    file = os.path.join(path, _IN_FLIGHT)
    if not run.args.async_generation or not os.path.exists(file):
        return None
    state = torch.load(file, weights_only=False)
    args = run.args
    expected = args.prompts_per_step * args.num_generations
    if state["step"] != completed_steps:  # save() writes only the next step's
        raise CheckpointError(f"--resume {path}: its in-flight samples are of step {state['step'] + 1}, "
                              f"not of the next step, {completed_steps + 1}")
    if state["expected"] != expected:
        raise CheckpointMismatchError(
            f"--resume {path}: its in-flight samples (--async-generation) are {state['expected']}, this run's step "
            f"has {expected} (prompts_per_step * num_generations): resume with the saved values or without "
            f"--async-generation")
    if getattr(run, "stream", None) is not None:  # --max-staleness: this engine's stream goes on from here
        saved = state.get("streams", {}).get(run.rollout.engine_index)
        if saved is None:
            raise CheckpointMismatchError(f"--resume {path}: it holds no streaming state of rollout engine "
                                          f"{run.rollout.engine_index} (saved without --max-staleness, or with "
                                          f"fewer engines): resume with the saved settings")
        try:
            run.stream.load_state_dict(saved)
        except ValueError as error:
            raise CheckpointMismatchError(f"--resume {path}: {error}: resume with the saved settings") from None
    if run.context.rank != 0:
        state = {**state, "samples": [], "reward_seconds": 0.0, "seconds": 0.0, "stats": {}}
    return ShardSamples.from_state_dict(state)


def _check_optimizer_layout(saved: dict, args, path: str) -> None:
    """--use-distributed-optimizer must match the saved run's: the two optimizers lay out their states
    differently (the distributed one adds fp32 main parameters and renames param-group keys), and
    Megatron-core 0.16.1 fails deep in its loader with a KeyError either way. TP, PP, CP and DP may
    change (resharded on load)."""
    saved_mode = saved.get("use_distributed_optimizer")
    if saved_mode is not None and saved_mode != args.use_distributed_optimizer:
        flag = "with --use-distributed-optimizer" if saved_mode else "without --use-distributed-optimizer"
        raise CheckpointMismatchError(
            f"--resume {path}: saved {flag}, and the two optimizers lay out their states differently: "
            f"resume {flag}")


def _check_lora(saved: dict | None, run, path: str) -> None:
    """A LoRA checkpoint holds adapters of one shape on one base (state.json's `lora`); a full one, every weight."""
    from megarl.models import lora

    config = lora.lora_config(run.args, run.hf_config) if run.args.lora_rank else None
    why = lora.checkpoint_mismatch(saved, run.args, config)
    if why:
        raise CheckpointMismatchError(f"--resume {path}: {why}")


def load_model_weights(module, path: str, name: str = "policy") -> None:
    """Only the weights of one model (`policy` or `critic`) from checkpoint `path`, into a
    GPTModel built at any TP/PP (the HF exporter's path; no optimizer needed). A LoRA checkpoint's
    adapters go into a model with its base loaded and adapters applied."""
    from megatron.core import dist_checkpointing

    from megarl.model_runner import load_model_checkpoint_state, model_checkpoint_state

    key = f"{name}_model"
    loaded = dist_checkpointing.load({key: model_checkpoint_state(module, name)}, os.path.join(path, "dist"))
    load_model_checkpoint_state(module, loaded[key], name)


def read_state(path: str) -> dict:
    """Checkpoint `path`'s state.json."""
    with open(os.path.join(path, "state.json")) as f:
        return json.load(f)


def _run_state(run, completed_steps: int, in_flight: dict | None) -> dict:
    """state.json: written by rank 0, which trains (train ranks come first), so it sees the roles."""
    args = run.args
    return {
        "completed_steps": completed_steps,
        "in_flight_samples": len(in_flight["samples"]) if in_flight is not None else 0,  # in in_flight.pt
        "roles": {name: role.state_dict() for name, role in run.trainables().items()},
        "run": run.state_dict(),
        "seed": args.seed,
        "optimizer_saved": not args.no_save_optim,
        "parallel": {"tensor_model_parallel_size": args.tensor_model_parallel_size,
                     "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
                     "context_parallel_size": args.context_parallel_size,
                     "use_distributed_optimizer": args.use_distributed_optimizer, "params_dtype": args.params_dtype,
                     "train_gpus": args.train_gpus, "rollout_gpus": args.rollout_gpus},
        **({"lora": _lora_record(run)} if args.lora_rank else {}),
    }


def _lora_record(run) -> dict:
    from megarl.models import lora

    return lora.checkpoint_record(run.args, lora.lora_config(run.args, run.hf_config))


def _save_hf_config(run, directory: str) -> None:
    run.hf_config.save_pretrained(directory)
    run.tokenizer.save_pretrained(directory)


def _write_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _prune(save_dir: str, keep: int) -> None:
    """Keep the newest `keep` checkpoints; remove partial ones left by a killed run. A checkpoint is renamed
    out of the step_N names before it is deleted: a kill mid-delete leaves no half-deleted step_N."""
    names = sorted(name for name in os.listdir(save_dir) if _STEP_DIR.match(name))
    for name in names[:-keep] if keep > 0 else []:
        os.rename(os.path.join(save_dir, name), os.path.join(save_dir, ".deleting_" + name))
    for name in os.listdir(save_dir):
        if name.startswith((".partial_step_", ".deleting_step_", ".replaced_step_")):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def save_hf(run, out_dir: str) -> None:
    """The current policy as an HF checkpoint (an export, not a resumable checkpoint), written by train
    rank 0; collective over the train ranks. With LoRA, what --lora-export asks for (export_policy)."""
    if run.actor is not None:
        export_policy(run.actor.model, run.args, run.hf_config, out_dir, run.tokenizer, run.is_main)


def export_policy(model, args, hf_config, out_dir: str, tokenizer, is_writer: bool, base_model: str | None = None):
    """--save-hf-dir's export of `model` (and tools/export_hf.py's): the HF checkpoint; with LoRA, per
    --lora-export, the PEFT adapter directory (`adapter`), the HF checkpoint with the adapters merged into the
    base (`merged`), or that with the adapter directory in its `adapter/` (`both`). `base_model`: the base's
    HF directory (default --model)."""
    from megarl.models import lora
    from megarl.models.convert import save_hf_checkpoint

    base_model = base_model or args.model
    mode = args.lora_export if args.lora_rank else "merged"
    if mode in ("merged", "both"):
        save_hf_checkpoint(model, hf_config, out_dir, tokenizer=tokenizer, is_writer=is_writer, source_dir=base_model)
    if mode in ("adapter", "both"):
        lora.save_peft_adapter(model, lora.lora_config(args, hf_config),
                               out_dir if mode == "adapter" else os.path.join(out_dir, "adapter"), base_model,
                               tokenizer=tokenizer, is_writer=is_writer)
