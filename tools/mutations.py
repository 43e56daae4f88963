"""Mutation lane (issue 51, item 4): small realistic bugs, one at a time, where a silent bug costs most.

Each mutation is data (`MUTATIONS`): a file, the exact original text (it must occur exactly once in that
file at run time, else the row says so and the lane fails: the list cannot rot silently as the code
changes), its replacement, a one-line description, and the CI tests that cover it (node ids, fastest
first). For each mutation the tool applies it to a copy of the working tree, runs its covering tests there
with `-x`, and reports whether they caught it, and by which test (the first that failed).

    .venv/bin/python tools/mutations.py                 # every mutation; the markdown table at the end
    .venv/bin/python tools/mutations.py --only kl,TIS   # the mutations whose description or file has a word
    .venv/bin/python tools/mutations.py --check         # only check that every original text is found once
    bash run_tests.sh -m mutations -s                   # the lane: tests/test_mutations.py runs this tool

Never the checkout itself: the working tree (tracked files and untracked ones git does not ignore) is copied
once into a temporary directory, `artifacts/` and `.venv` linked from the checkout, and the tests run there
with PYTHONPATH set to the copy (checked: `import megarl` resolves into the copy). Before any mutation the
covering tests run on the unmutated copy and must all pass, so that "caught" means caught. Exit status:
0 when every mutation was caught, 1 when one survived (or its tests could not run), 2 when an original text
was not found exactly once, 3 when the unmutated copy fails its covering tests.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINKED = ("artifacts", ".venv")  # large or built: linked from the checkout, not copied
# Test files another change may or may not have added yet: their covers are used when the file exists.
OPTIONAL_TEST_FILES = {"tests/test_loss_terms.py"}


@dataclass(frozen=True)
class Mutation:
    file: str  # relative to the repository root
    original: str  # exact text, found exactly once in the file
    replacement: str
    description: str
    tests: tuple[str, ...]  # covering test node ids, fastest and most specific first


def mutation(file, original, replacement, description, *tests) -> Mutation:
    return Mutation(file, original, replacement, description, tests)


ALG, LOSS, RUNNER = "megarl/algorithms.py", "megarl/loss.py", "megarl/model_runner.py"
T_ALG = "tests/test_algorithms.py"
T_DISTILL = "tests/test_distill_losses.py"
T_GUARDS = "tests/test_mutation_guards.py"
T_TERMS = "tests/test_loss_terms.py"
T_TOOL_MASK = "tests/test_multiturn.py::test_tool_tokens_get_no_gradient_and_do_not_enter_loss_kl_or_mismatch"
T_LORA_RESUME = "tests/test_lora.py::test_a_checkpoint_holds_the_adapters_and_resumes_exactly"
T_LORA_MERGE = "tests/test_lora.py::test_merged_export_equals_base_plus_trained_adapters"
T_KERNELS = "tests/test_kernels.py"
# a resume with an LR warm-up and decay and the adaptive KL controller (both move at every step)
T_PP_RESUME = "tests/test_pipeline.py::test_grpo_at_two_stages_trains_syncs_and_resumes_at_one"
T_RUN_RESUME = "tests/test_checkpoint.py::test_lora_grpo_samples_from_the_merged_weights_resumes_exactly_and_exports"

MUTATIONS: list[Mutation] = [
    # ------------------------------------------------------------- advantages ----
    mutation(ALG, "std = groups.std(dim=1, keepdim=True) if group_size > 1",
             "std = groups.std(dim=1, keepdim=True, unbiased=False) if group_size > 1",
             "GRPO: the group std biased (no Bessel correction)", f"{T_ALG}::test_grpo"),
    mutation(ALG, "var = (centred ** 2).sum() / (count - 1).clamp(min=1)",
             "var = (centred ** 2).sum() / count.clamp(min=1)",
             "whitening: biased variance", f"{T_ALG}::test_masked_whiten_edges", f"{T_ALG}::test_reinforce_plus_plus",
             f"{T_ALG}::test_gae"),
    mutation(ALG, "delta + gamma * lam * next_advantage", "delta + gamma * next_advantage",
             "GAE: lambda ignored", f"{T_ALG}::test_gae"),
    mutation(ALG, "last = length - 1 - torch.argmax(mask.flip(dims=[1]), dim=1)", "last = torch.argmax(mask, dim=1)",
             "outcome reward placed at the first valid token, not the last",
             f"{T_ALG}::test_sequence_rewards_at_last_valid_token"),
    # ----------------------------------------------------------- policy losses ----
    mutation(ALG, "ratio = _ratio(logprobs - old_logprobs)\n    return _clipped_surrogate(",
             "ratio = _ratio(old_logprobs - logprobs)\n    return _clipped_surrogate(",
             "PPO-clip: importance ratio inverted (old - new)", f"{T_ALG}::test_ppo_clip"),
    mutation(ALG, "loss = torch.maximum(unclipped, clipped)", "loss = torch.minimum(unclipped, clipped)",
             "PPO-clip: min instead of max of the two surrogate losses", f"{T_ALG}::test_ppo_clip"),
    mutation(ALG, "torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)",
             "torch.clamp(ratio, 1.0 - clip_eps_high, 1.0 + clip_eps_low)",
             "PPO-clip: clip-higher bounds swapped", f"{T_ALG}::test_ppo_clip"),
    mutation(ALG, "torch.where(negative, torch.minimum(loss, floor), loss)",
             "torch.where(negative, torch.maximum(loss, floor), loss)",
             "dual clip: max instead of min with -A c", f"{T_ALG}::test_ppo_clip"),
    mutation(ALG, "log_ratio = seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()",
             "log_ratio = seq_log_ratio[:, None] + logprobs - logprobs.detach()",
             "GSPO: sequence ratio not detached (forgotten .detach())",
             f"{T_ALG}::test_gspo_token_equals_sequence_objective", f"{T_ALG}::test_gspo"),
    mutation(ALG, "mean_ratio = (ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)",
             "mean_ratio = ratio.mean(dim=-1)",
             "skip_threshold: padding counted in the sample's mean ratio", f"{T_ALG}::test_skip_threshold"),
    # -------------------------------------------------------- loss aggregation ----
    mutation(ALG, "return (token_loss * mask).sum(), mask.sum()", "return token_loss.sum(), mask.sum()",
             "token_level aggregation: mask dropped", f"{T_ALG}::test_loss_aggregation"),
    mutation(ALG, "return ((token_loss * mask).sum(dim=-1) / counts.clamp(min=1)).sum(), rows",
             "return ((token_loss * mask).sum(dim=-1) / counts.clamp(min=1)).mean(), rows",
             "sample_level aggregation: mean instead of sum over samples", f"{T_ALG}::test_loss_aggregation"),
    mutation(ALG, "return (token_loss * mask).sum() / max_len, rows",
             "return (token_loss * mask).sum() / mask.shape[-1], rows",
             "Dr. GRPO: normalised by the padded width, not max_len", f"{T_ALG}::test_loss_aggregation"),
    # ---------------------------------------------------------------------- KL ----
    mutation(ALG, "    return logprobs - ref_logprobs\n", "    return ref_logprobs - logprobs\n",
             "k1 KL estimator: sign flipped", f"{T_ALG}::test_kl_estimators"),
    mutation(ALG, "log_ratio = torch.clamp(ref_logprobs - logprobs, -LOG_RATIO_BOUND",
             "log_ratio = torch.clamp(logprobs - ref_logprobs, -LOG_RATIO_BOUND",
             "k3 (low_var_kl): arguments swapped", f"{T_ALG}::test_kl_estimators"),
    mutation(ALG, "return (token_rewards - coef * kl.detach())", "return (token_rewards + coef * kl.detach())",
             "KL in the reward: penalty becomes a bonus", f"{T_ALG}::test_kl_placement"),
    mutation(ALG, "return -coef * entropy", "return coef * entropy",
             "entropy bonus: sign flipped", f"{T_ALG}::test_entropy_bonus_lowers_the_loss_with_entropy"),
    # --------------------------------------------------------------------- TIS ----
    mutation(ALG, "weights, clipped, masked = torch.clamp(ratio, max=threshold), ",
             "weights, clipped, masked = ratio, ",
             "TIS: truncation threshold ignored", f"{T_ALG}::test_truncated_importance_weights"),
    mutation(ALG, "diff = (old_logprobs - rollout_logprobs) * mask", "diff = (rollout_logprobs - old_logprobs) * mask",
             "TIS: ratio inverted (rollout / trainer)", f"{T_ALG}::test_truncated_importance_weights"),
    # ------------------------------------------------------------ distillation ----
    mutation(ALG, "if beta == 0:\n        return _kl_terms(lt, ls)", "if beta == 0:\n        return _kl_terms(ls, lt)",
             "GKD: beta = 0 gives the reverse KL instead of the forward", T_DISTILL),
    mutation(ALG, "lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))",
             "lm = torch.logaddexp(ls + math.log(beta), lt + math.log1p(-beta))",
             "GKD: the JSD mixture's weights swapped", T_DISTILL),
    mutation(ALG, "return _floating(logprobs.detach()).clamp(min=LOGPROB_FLOOR)",
             "return _floating(logprobs).clamp(min=LOGPROB_FLOOR)",
             "GKD: the teacher's log-probs not detached (a gradient into the teacher)", T_DISTILL, T_GUARDS),
    mutation(ALG, "rewards = _floating(teacher_logprobs) - _floating(student_logprobs)",
             "rewards = _floating(student_logprobs) - _floating(teacher_logprobs)",
             "distillation reward: sign flipped", T_DISTILL, T_TERMS),
    # -------------------------------------------------------------------- DAPO ----
    mutation(ALG, "return (accuracy > low) & (accuracy < high)", "return (accuracy >= low) & (accuracy <= high)",
             "dynamic sampling: `<` vs `<=` keeps all-right / all-wrong groups", f"{T_ALG}::test_dynamic_sampling_keep"),
    # ---------------------------------------------------------------- the loss ----
    mutation(LOSS, "token_loss = token_loss * is_weights", "token_loss = token_loss",
             "ActorLoss: TIS weights not applied", T_TOOL_MASK, T_GUARDS, T_TERMS),
    mutation(LOSS, "old_logprobs = logprobs.detach()", "old_logprobs = logprobs",
             "on-policy shortcut: old logprobs not detached (ratio's gradient lost)", T_TOOL_MASK, T_GUARDS, T_TERMS),
    mutation(LOSS, "token_loss = token_loss + kl_penalty_in_loss(kl, terms.kl_coef)",
             "token_loss = token_loss - kl_penalty_in_loss(kl, terms.kl_coef)",
             "ActorLoss: KL in the loss with the wrong sign", T_TOOL_MASK, T_GUARDS, T_TERMS),
    mutation(LOSS, "token_loss = token_loss + entropy_bonus(entropy, args.entropy_coef)",
             "token_loss = token_loss - entropy_bonus(entropy, args.entropy_coef)",
             "ActorLoss: entropy bonus with the wrong sign", T_TOOL_MASK, T_GUARDS, T_TERMS),
    mutation(LOSS, "token_loss = token_loss + args.distill_coef * distill_loss",
             "token_loss = token_loss - args.distill_coef * distill_loss",
             "ActorLoss: distillation term with the wrong sign", T_GUARDS, T_TERMS),
    mutation(LOSS, "batch.response_aligned(mask),", "batch.response_aligned(torch.ones_like(mask)),",
             "ActorLoss: loss mask dropped in the aggregation", T_TOOL_MASK, T_GUARDS),
    # ------------------------------------------------------ micro-batch layout ----
    mutation(RUNNER, "labels[row, offset: offset + p + r - 1] = sequence[1:]",
             "labels[row, offset: offset + p + r - 1] = sequence[:-1]",
             "micro-batch labels not shifted (each position scores its own token)", T_TOOL_MASK, T_GUARDS),
    mutation(RUNNER, "return mask if self.policy is None else mask * self.policy", "return mask",
             "MicroBatch.response_mask: tool tokens in the mismatch and TIS", T_TOOL_MASK),
    # ---------------------------------------------- optimizer step and schedule ----
    mutation(RUNNER, "self.model.zero_grad_buffer()\n", "\n",
             "gradient buffers not zeroed between optimizer steps", T_LORA_RESUME, T_GUARDS),
    mutation(RUNNER, "clip_grad=args.clip_grad,", "clip_grad=0.0,",
             "gradient clipping off (--clip-grad ignored)", T_GUARDS, T_TERMS),
    mutation(RUNNER, "self.scheduler.step(increment=1)", "pass",
             "LR scheduler never stepped", T_GUARDS),
    # -------------------------------------------------------------- checkpoint ----
    mutation(RUNNER, "self.optimizer.load_state_dict(loaded[f\"{prefix}_optimizer\"])", "pass",
             "checkpoint load: Adam's moments not loaded", T_LORA_RESUME),
    mutation(RUNNER, "self.scheduler.load_state_dict(state[\"scheduler\"])", "pass",
             "checkpoint load: LR schedule not loaded", T_LORA_RESUME, T_GUARDS, T_PP_RESUME),
    mutation("megarl/checkpoint.py", "\"optimizer_saved\": not args.no_save_optim,", "\"optimizer_saved\": False,",
             "checkpoint: state.json says no optimizer state (a resume restarts Adam)", T_RUN_RESUME),
    mutation("megarl/checkpoint.py", "    run.load_state_dict(state[\"run\"])\n", "\n",
             "checkpoint load: the run's state (data position, KL controller) not restored", T_PP_RESUME),
    # ------------------------------------------------------------- weight sync ----
    mutation("megarl/weight_sync.py", "engine.load_weights(iter(stream))  # wakes",
             "list(stream)  # wakes",
             "colocated sync: the stream is gathered but never loaded into vLLM",
             "tests/test_weight_sync.py::test_sync_parity[colocate-dp2]"),
    mutation("megarl/weight_sync.py", "size = offset + tensor.numel() * tensor.element_size()",
             "size = offset + tensor.numel()",
             "broadcast sync: a bucket's offsets counted in elements, not bytes (its tensors overlap)",
             "tests/test_store_groups.py::test_weight_sync_group_is_named_and_warmed_up_at_build_then_carries_the_weights",
             "tests/test_weight_sync.py::test_sync_parity[separate]"),
    # ---------------------------------------------------------------- LoRA merge ----
    mutation("megarl/models/lora.py", "return self.scale * (self.B[name].float() @ self.A[name].float())",
             "return self.B[name].float() @ self.A[name].float()",
             "LoRA merge: scale (alpha / r) dropped for row-parallel linears", T_LORA_MERGE),
    mutation("megarl/models/convert.py", "return (param.detach().float() + delta()).to(param.dtype)",
             "return param.detach()",
             "LoRA: the sync / export sends the base without the adapters merged", T_LORA_MERGE),
    # ------------------------------------------------------------- the kernels ----
    mutation("megarl/kernels/torch_ops.py", "z = x.float() / temperature\n    picked, owned = _pick(z, labels[:, None])",
             "z = x.float()\n    picked, owned = _pick(z, labels[:, None])",
             "chunked logprobs: temperature ignored", f"{T_KERNELS}::test_from_logits_tp1"),
    mutation("megarl/kernels/torch_ops.py", "out.copy_(grad.div_(temperature))\n\n\ndef topk_stats",
             "out.copy_(grad)\n\n\ndef topk_stats",
             "chunked logprob gradient: the 1/T factor dropped", f"{T_KERNELS}::test_from_logits_tp1"),
    mutation("megarl/kernels/fused.py", "picked = torch.where(sums[:, 3] > 0, sums[:, 2], m)", "picked = sums[:, 2]",
             "fused logprobs: a label no shard owns scores 0, not M", f"{T_KERNELS}::test_one_output_and_unowned_labels"),
    mutation("megarl/kernels/torch_ops.py", "return lt.exp().mul_(lt - ls).sum(-1)",
             "return lt.exp().mul_(ls - lt).sum(-1)",
             "chunked full-vocabulary forward KL (beta 0): sign flipped",
             f"{T_KERNELS}::test_full_vocabulary_divergence_tp1"),
    mutation("megarl/kernels/naive.py", "return torch.log(sum_exp) + z_max - _weighted_vocab_sum(exp, z) / sum_exp",
             "return torch.log(sum_exp) - z_max - _weighted_vocab_sum(exp, z) / sum_exp",
             "naive entropy: the max shift with the wrong sign",
             "tests/test_min_new_tokens.py::test_kernels_against_a_float64_masked_reference",
             f"{T_KERNELS}::test_from_logits_tp1"),
    mutation("megarl/kernels/fused.py",
             "return None if held_back is None else _Constraint(held_back, start, width, temperature)", "return None",
             "fused kernels: --min-new-tokens' held-back ids ignored",
             "tests/test_min_new_tokens.py::test_kernels_against_a_float64_masked_reference"),
    # ---------------------------------------------------------- routing replay ----
    mutation("megarl/routing_replay.py", "chosen = torch.where(recorded, targets, own)", "chosen = own",
             "routing replay ignored: the router keeps its own top-k",
             "tests/test_routing_replay.py::test_replayed_experts_with_the_trainers_probabilities"),
    mutation("megarl/routing_replay.py", "targets = routes[:, :, layer].transpose(0, 1)  # [L, b, k]",
             "targets = routes[:, :, layer]  # [L, b, k]",
             "routing replay: routes in batch-major, not the router's sequence-major order",
             "tests/test_routing_replay.py::test_routes_in_the_routers_token_order"),
    mutation("megarl/routing_replay.py", "targets = self.replay_backward_list.pop(0)",
             "targets = self.replay_backward_list.pop()",
             "routing replay under recompute: the newest micro-batch's routes, not the oldest's",
             "tests/test_routing_replay.py::test_recomputed_forward_takes_its_own_micro_batchs_routes"),
    mutation("megarl/routing_replay.py", "out[row, offset: offset + len(s.routes)] = s.routes.long()",
             "out[row, offset + 1: offset + 1 + len(s.routes)] = s.routes.long()",
             "routing replay: each token gets the route of the token before it",
             "tests/test_routing_replay.py::test_replayed_experts_with_the_trainers_probabilities",
             "tests/test_routing_replay.py::test_recomputed_forward_takes_its_own_micro_batchs_routes", T_GUARDS),
    # ----------------------------------------------------- multi-turn tool mask ----
    mutation("megarl/multiturn.py", "self.policy_mask += [0 if logprobs is None else 1] * len(ids)",
             "self.policy_mask += [1] * len(ids)",
             "multi-turn: tool-result tokens marked as the policy's (trained on)",
             "tests/test_multiturn.py::test_episodes_on_the_engine"),
    mutation("megarl/batch.py", "    if policy is not None:\n        response_mask = response_mask * policy",
             "    if policy is not None:\n        response_mask = response_mask",
             "batch: the tool-token mask dropped from the response mask",
             "tests/test_multiturn.py::test_policy_mask_marks_the_policy_tokens_of_each_response", T_TOOL_MASK),
    # ------------------------------------------------------------------- batch ----
    mutation("megarl/batch.py", "batch.loss_mask = batch.loss_mask * (1.0 - masked)",
             "batch.loss_mask = batch.loss_mask * masked",
             "TIS mask mode: the rejected tokens kept, the accepted ones dropped",
             "tests/test_batch.py::test_importance_weights_in_mask_mode_take_rejected_tokens_out_of_the_loss"),
    mutation("megarl/batch.py", "loss_mask = loss_mask * keep[:, None].float()", "loss_mask = loss_mask",
             "--filter-truncated: truncated responses stay in the loss",
             "tests/test_batch.py::test_truncation_filter_masks_the_loss_but_keeps_the_score"),
    mutation("megarl/batch.py", "(args.kl_coef > 0, \"a reference model (--kl-coef > 0)\")",
             "(args.kl_coef > 1, \"a reference model (--kl-coef > 0)\")",
             "on-policy shortcut taken with a reference (its KL read from missing old logprobs)",
             "tests/test_on_policy_shortcut.py::test_two_pass_reason"),
    mutation("megarl/batch.py", "start = index * per + min(index, extra)", "start = index * per",
             "data-parallel shards overlap when the count does not divide",
             "tests/test_batch.py::test_contiguous_shards_cover_everything_once_and_differ_by_at_most_one"),
    # ----------------------------------------------------------------- packing ----
    mutation("megarl/packing.py", "if capacity is None or len(groups[g]) < capacity)",
             "if capacity is None or len(groups[g]) <= capacity)",
             "data-parallel balance: `<` vs `<=` lets a rank take one sample more than its share",
             "tests/test_batch.py::test_balanced_mini_batches_give_each_rank_equal_samples_and_near_equal_tokens",
             T_GUARDS),
]


# ------------------------------------------------------------------ the tree ----
def copy_tree(dest: Path) -> None:
    """The working tree into `dest`: tracked files and untracked ones git does not ignore; LINKED linked."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in sorted(set(listed) - {""}):
        source = ROOT / rel
        if rel.split("/")[0] in LINKED or not (source.is_file() or source.is_symlink()):
            continue  # deleted in the working tree, or a submodule
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    for name in LINKED:
        if (ROOT / name).exists():
            os.symlink(ROOT / name, dest / name)


def run_env(copy: Path) -> dict:
    """The environment of every run in the copy: PYTHONPATH the copy (the checkout's entries removed), no
    bytecode written (a mutated module's cache never outlives its mutation)."""
    env = dict(os.environ)
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and not Path(p).resolve().is_relative_to(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *kept])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_import(copy: Path, env: dict) -> str:
    found = subprocess.run([sys.executable, "-c", "import megarl; print(megarl.__file__)"], cwd=copy, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(found).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"mutations: `import megarl` in the copy resolves to {found}, not into {copy}")
    return found


# -------------------------------------------------------------------- checks ----
def occurrences(root: Path, m: Mutation) -> int:
    path = root / m.file
    return path.read_text().count(m.original) if path.is_file() else -1


def not_found(root: Path, chosen: list[tuple[int, Mutation]]) -> list[tuple[int, Mutation]]:
    """The mutations whose original text is not in their file (under `root`) exactly once, each said loudly."""
    missing = []
    for i, m in chosen:
        n = occurrences(root, m)
        if n != 1:
            missing.append((i, m))
            found = "the file is missing" if n < 0 else f"found {n} times"
            print(f"mutations: #{i} ({m.description}): the original text is not found exactly once in {m.file} "
                  f"({found}):\n    {m.original!r}", file=sys.stderr, flush=True)
    return missing


def location(root: Path, m: Mutation) -> str:
    """file:line of the first character the mutation changes."""
    text = (root / m.file).read_text()
    start = text.index(m.original)
    common = 0
    while common < min(len(m.original), len(m.replacement)) and m.original[common] == m.replacement[common]:
        common += 1
    return f"{m.file}:{text.count(chr(10), 0, start + common) + 1}"


def covers(root: Path, m: Mutation, without: tuple[str, ...] = ()) -> list[str]:
    """The mutation's covering node ids whose file exists (an optional file's may not), less those of the
    files in `without`."""
    out = []
    for test in m.tests:
        file = test.split("::")[0]
        if file in without:
            continue
        if (root / file).is_file():
            out.append(test)
        elif file not in OPTIONAL_TEST_FILES:
            raise SystemExit(f"mutations: {m.description}: its covering test file {file} does not exist")
    return out


def deduplicated(tests: list[str]) -> list[str]:
    """Node ids in order, once, without those inside a whole file that is also listed."""
    files = {t for t in tests if "::" not in t}
    out = []
    for test in tests:
        if test not in out and (test in files or test.split("::")[0] not in files):
            out.append(test)
    return out


# ---------------------------------------------------------------------- runs ----
FAILED = re.compile(r"^(FAILED|ERROR) (.+?)(?: - .*)?$")  # a parametrized id may hold spaces


def run_pytest(copy: Path, env: dict, tests: list[str], log: Path, first_failure: bool, timeout: float):
    """(pytest's exit status or "timeout", the failing node ids in order, seconds)."""
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *(["-x"] if first_failure else []),
               *tests]
    start = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=copy, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            status = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = "timeout"
    failing = [match.group(2) for line in log.read_text(errors="replace").splitlines()
               if (match := FAILED.match(line))]
    return status, failing, time.perf_counter() - start


def outcome(status, failing: list[str]) -> tuple[str, str]:
    """(result, by which test) of a mutation's run."""
    if status == 0:
        return "SURVIVED", ""
    if status == "timeout":
        return "caught", "(timed out: a hang)"
    if status in (1, 2) and failing:  # 2: the mutation broke the collection (an import error)
        return "caught", failing[0]
    if status == 5:
        return "ERROR", "no test ran (check the covering node ids)"
    return "ERROR", f"pytest exit status {status}, no failing test named"


def select(mutations: list[Mutation], only: str | None) -> list[tuple[int, Mutation]]:
    numbered = list(enumerate(mutations, 1))
    if not only:
        return numbered
    words = [w.strip().lower() for w in only.split(",") if w.strip()]
    return [(i, m) for i, m in numbered
            if any(w == str(i) or w in m.description.lower() or w in m.file.lower() for w in words)]


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return head.strip() + (" + working-tree changes" if dirty else "")


def markdown(rows: list[dict]) -> str:
    lines = ["| # | Mutation (file:line) | What | Result | Caught by (first failing test) | Time |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['n']} | `{row['where']}` | {row['description']} | {row['result']} | "
                     f"{'`' + row['by'] + '`' if row['by'] and not row['by'].startswith('(') else row['by']} | "
                     f"{row['seconds']:.0f} s |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated numbers or words of the description or file")
    parser.add_argument("--check", action="store_true", help="only check that each original text occurs once")
    parser.add_argument("--list", action="store_true", help="list the mutations and their covering tests")
    parser.add_argument("--markdown", type=Path, help="also write the final table (and its summary) here")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per mutation's tests (a hang)")
    parser.add_argument("--keep", action="store_true", help="keep the copy and the pytest logs")
    parser.add_argument("--without", action="append", default=[], metavar="TEST_FILE",
                        help="leave this test file's covers out (e.g. to see what the suite catches without the "
                             "tests this lane added); repeatable")
    args = parser.parse_args(argv)
    chosen = select(MUTATIONS, args.only)
    if not chosen:
        raise SystemExit(f"mutations: nothing matches --only {args.only}")

    if args.list or args.check:
        missing = not_found(ROOT, chosen)
        for i, m in chosen:
            where = location(ROOT, m) if occurrences(ROOT, m) == 1 else m.file
            print(f"{i:>2}. {where}  {m.description}\n      " + "\n      ".join(m.tests))
        print(f"{len(chosen)} mutations, {len(missing)} original texts not found exactly once")
        return 2 if missing else 0

    started = time.perf_counter()
    copy = Path(tempfile.mkdtemp(prefix="megarl-mutations-"))
    logs = copy / ".mutation-logs"
    try:
        copy_tree(copy)
        logs.mkdir()
        env = run_env(copy)
        print(f"mutations: {len(chosen)} mutations on a copy of {ROOT} ({commit()}) in {copy}; "
              f"megarl imports from {check_import(copy, env)}", flush=True)
        missing = not_found(copy, chosen)
        runnable = [(i, m) for i, m in chosen if (i, m) not in missing]
        without = tuple(args.without)
        baseline = deduplicated([t for _, m in runnable for t in covers(copy, m, without)])
        print(f"mutations: the covering tests on the unmutated copy ({len(baseline)} node ids) ...", flush=True)
        status, failing, seconds = run_pytest(copy, env, baseline, logs / "baseline.log", False, args.timeout * 3) \
            if baseline else (0, [], 0.0)  # (never pytest without node ids: that would be the whole suite)
        dropped = sorted({t.split("::")[0] for t in failing} & OPTIONAL_TEST_FILES)
        if status == 1 and failing and all(t.split("::")[0] in OPTIONAL_TEST_FILES for t in failing):
            # An optional extra cover (a file another change is still writing) that fails on the real code
            # says nothing about a mutation: left out, loudly; the lane's own covers decide.
            print(f"mutations: WARNING: {', '.join(failing)} fail(s) on the unmutated copy: "
                  f"{', '.join(dropped)} left out of the covers", flush=True)
            without += tuple(dropped)
            status = 0
        if status != 0:
            print((logs / "baseline.log").read_text(errors="replace")[-6000:])
            print(f"mutations: the unmutated copy fails its covering tests (status {status}): "
                  f"{', '.join(failing) or 'see above'}; stopping: nothing could be said to be caught", flush=True)
            return 3
        baseline_seconds = seconds
        print(f"mutations: baseline passed in {seconds:.0f} s", flush=True)

        rows = []
        width = len(str(len(MUTATIONS)))
        for i, m in chosen:
            if (i, m) not in runnable:
                rows.append({"n": i, "where": m.file, "description": m.description, "seconds": 0.0,
                             "result": "NOT FOUND", "by": "(the original text is not in the file exactly once)"})
                print(f"[{i:>{width}}] NOT FOUND  {m.file}  {m.description}", flush=True)
                continue
            tests = covers(copy, m, without)
            if not tests:
                rows.append({"n": i, "where": location(copy, m), "description": m.description, "seconds": 0.0,
                             "result": "SURVIVED", "by": "(no covering test left)"})
                print(f"[{i:>{width}}] SURVIVED  no covering test left  {m.file}  {m.description}", flush=True)
                continue
            path = copy / m.file
            original = path.read_bytes()
            where = location(copy, m)
            text = original.decode()
            mutated = text.replace(m.original, m.replacement, 1)
            compile(mutated, str(path), "exec")  # a mutation must stay valid Python: a broken one is the list's bug
            try:
                path.write_text(mutated)
                status, failing, seconds = run_pytest(copy, env, tests, logs / f"mutation_{i:02d}.log", True,
                                                      args.timeout)
            finally:
                path.write_bytes(original)
            result, by = outcome(status, failing)
            rows.append({"n": i, "where": where, "description": m.description, "seconds": seconds,
                         "result": result, "by": by})
            print(f"[{i:>{width}}] {result:<8} {seconds:6.1f} s  {where}  {m.description}"
                  + (f"  <- {by}" if by else ""), flush=True)
            if result == "ERROR":
                print((logs / f"mutation_{i:02d}.log").read_text(errors="replace")[-3000:], flush=True)

        total = time.perf_counter() - started
        survived = [r for r in rows if r["result"] == "SURVIVED"]
        errors = [r for r in rows if r["result"] in ("ERROR", "NOT FOUND")]
        summary = (f"{len(rows)} mutations: {len(rows) - len(survived) - len(errors)} caught, {len(survived)} "
                   f"survived, {len(errors)} not run (not found or errors); {total / 60:.1f} minutes in all "
                   f"(the unmutated baseline {baseline_seconds:.0f} s), {date.today().isoformat()}, commit {commit()}")
        table = markdown(rows)
        print("\n" + table + "\n\n" + summary, flush=True)
        if args.markdown:
            args.markdown.write_text(table + "\n\n" + summary + "\n")
        if missing:
            return 2
        return 1 if survived or errors else 0
    finally:
        if args.keep:
            print(f"mutations: kept {copy} (logs in {logs})")
        else:
            shutil.rmtree(copy, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
