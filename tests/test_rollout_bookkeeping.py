"""The rollout engine's GPU-only paths, by their bookkeeping on CPU (issue 23): per-request seeds
(Model Runner V2), the colocated sleep/wake order around a step, vLLM's sleep mode by placement,
and the bounded start-up wait. No vLLM engine is built here: vLLM's sleep mode is CUDA-only, so a
small recording object stands in for the LLM's sleep/wake_up/collective_rpc (said where it is used)."""

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megarl import accelerator, distributed
from megarl.arguments import parse_args
from megarl.placement import Placement
from megarl.rollout import RolloutEngine, request_seeds, rollout_engine_kwargs, sampling_params, stable_seed
from megarl.run import Run
from megarl.weight_sync import ColocatedSync

# ------------------------------------------------------------ seeds per request ----


def test_request_seeds_follow_seed_step_key_and_prompt_index():
    seeds = request_seeds(7, 3, ("train", 0), [0, 1, 5])
    assert seeds == [stable_seed("request", 7, 3, "train", 0, i) >> 8 for i in (0, 1, 5)]
    assert seeds == request_seeds(7, 3, ("train", 0), [0, 1, 5])  # a resumed run draws the same
    assert request_seeds(7, 3, ("train", 0), [5]) == seeds[2:]  # not the engine's shard: the prompt's index
    others = [request_seeds(7, 4, ("train", 0), [0, 1, 5]), request_seeds(8, 3, ("train", 0), [0, 1, 5]),
              request_seeds(7, 3, ("train", 1), [0, 1, 5]), request_seeds(7, 3, ("eval", "math"), [0, 1, 5])]
    for other in others:
        assert not set(other) & set(seeds)
    assert len(set(seeds)) == 3
    # vLLM gives sample j of a request seed + j, kept as int64 by Model Runner V2: room for any n.
    assert all(0 <= s and s + 2**16 < 2**63 for seeds_ in [seeds] + others for s in seeds_)


def test_sampling_params_carry_the_seeds_on_v2_and_none_on_v1():
    from vllm.v1.engine.parallel_sampling import ParentRequest

    args = parse_args(["--num-generations", "3"], world_size=1)
    seeded = sampling_params(args, [4, 9], 2, ("train", 0), 3, 1.0, 0, seeded=True)
    assert [p.seed for p in seeded] == request_seeds(args.seed, 2, ("train", 0), [4, 9])
    assert [p.n for p in seeded] == [3, 3]
    # vLLM's own fan-out of n samples (a stand-in `self` for ParentRequest, whose constructor wants a
    # whole EngineCoreRequest): sample j gets seed + j, so the 3 samples of a prompt differ.
    parent = SimpleNamespace(sampling_params=seeded[1], cached_child_sampling_params=None)
    assert [ParentRequest._get_child_sampling_params(parent, j).seed for j in range(3)] == \
        [seeded[1].seed + j for j in range(3)]
    assert [p.seed for p in sampling_params(args, [4, 9], 2, ("train", 0), 3, 1.0, 0, seeded=False)] == [None, None]


# ------------------------------------------------------------ sleep mode by placement ----


@pytest.mark.parametrize("on_cuda", [True, False])
def test_sleep_mode_only_for_a_colocated_engine(monkeypatch, on_cuda):
    monkeypatch.setattr(accelerator, "ON_CUDA", on_cuda)  # the GPU branch's settings, computed on this host
    colocated = parse_args([], world_size=2)
    separate = parse_args(["--colocate-groups", "none", "--rollout-gpus", "1"], world_size=2)
    kinds = {}
    for args in (colocated, separate):
        placement = Placement.from_args(args, 2)
        kinds[placement.colocated] = rollout_engine_kwargs(args, placement.colocated)
    if on_cuda:
        assert kinds[True]["enable_sleep_mode"] is True and kinds[False]["enable_sleep_mode"] is False
    else:  # vLLM's CPU build raises on enable_sleep_mode=True: never asked for
        assert "enable_sleep_mode" not in kinds[True] and "enable_sleep_mode" not in kinds[False]
    extra = parse_args(["--rollout-engine-kwargs", '{"enable_sleep_mode": false}'], world_size=2)
    assert rollout_engine_kwargs(extra, True).get("enable_sleep_mode") in (False, None)  # the user's word wins


# ------------------------------------------------------------ colocated wake order ----


class _RecordingLLM:
    """Stands in for vllm.LLM's CUDA-only sleep mode (sleep, wake_up) and the weight load: records the calls."""

    def __init__(self, log):
        self.log = log

    def sleep(self, level):
        self.log.append(f"vllm.sleep(level={level})")

    def wake_up(self, tags=None):
        self.log.append(f"vllm.wake_up({tags})")

    def collective_rpc(self, method, kwargs=None):
        if kwargs is None:  # level 2's _discard_derived_state
            self.log.append(f"vllm.{method.__name__}")
            return
        tensors = list(kwargs["weights"])  # the stream is drawn inside the load
        self.log.append(f"vllm.load({len(tensors)} tensors)")

    def reset_prefix_cache(self):
        pass


class _RecordingRole:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def offload(self):
        self.log.append(f"{self.name}.offload")

    def onload(self):
        self.log.append(f"{self.name}.onload")

    def hf_weights(self, bucket_bytes):
        self.log.append(f"{self.name}.hf_weights")
        yield "model.embed_tokens.weight", torch.zeros(4, 2)
        yield "lm_head.weight", torch.zeros(4, 2)


def _colocated_run(monkeypatch, log):
    monkeypatch.setattr(accelerator, "ON_CUDA", True)  # take the GPU branch of offload/onload
    engine = object.__new__(RolloutEngine)  # the engine's own verbs, without building vLLM
    engine.args, engine.asleep, engine.llm = SimpleNamespace(rollout_sleep_level=1), set(), _RecordingLLM(log)
    actor, critic = _RecordingRole("actor", log), _RecordingRole("critic", log)
    run = SimpleNamespace(rollout=engine, actor=actor, weight_sync=ColocatedSync(None, 1 << 20),
                          context=SimpleNamespace(placement=SimpleNamespace(colocated=True)),
                          trainables=lambda: {"policy": actor, "critic": critic})
    return run, engine


def test_colocated_step_wakes_the_kv_cache_only_after_the_trainer_left(monkeypatch):
    log = []
    run, engine = _colocated_run(monkeypatch, log)
    sync = ColocatedSync(None, 1 << 20)
    for step in range(2):  # generate (a rollout turn), train, sync; twice
        with Run.rollout_turn(run):
            log.append("generate")
        log.append("train")
        sync.sync(run.actor, engine)
    assert log == [
        "actor.offload", "critic.offload", "generate", "vllm.sleep(level=1)", "actor.onload", "critic.onload",
        "train", "vllm.wake_up(['weights'])", "actor.hf_weights", "vllm.load(2 tensors)",
        # the KV cache wakes in the next turn, once the trainer's states are off the device
        "actor.offload", "critic.offload", "vllm.wake_up(['kv_cache'])", "generate", "vllm.sleep(level=1)",
        "actor.onload", "critic.onload",
        "train", "vllm.wake_up(['weights'])", "actor.hf_weights", "vllm.load(2 tensors)"]
    assert engine.asleep == {"kv_cache"}


def test_a_load_into_a_sleeping_engine_wakes_its_weights_first(monkeypatch):
    """A colocated teacher served for an evaluation right after the student's (generation.serving)."""
    log = []
    run, engine = _colocated_run(monkeypatch, log)
    with Run.rollout_turn(run):
        pass
    log.clear()
    engine.load_weights(iter([("lm_head.weight", torch.zeros(4, 2))]))
    engine.load_weights(iter([("lm_head.weight", torch.zeros(4, 2))]))  # awake now: no second wake
    engine.offload()  # partly awake: vLLM sleeps only a whole engine, so the rest wakes first
    engine.offload()  # already asleep: nothing
    assert log == ["vllm.wake_up(['weights'])", "vllm.load(1 tensors)", "vllm.load(1 tensors)",
                   "vllm.wake_up(['kv_cache'])", "vllm.sleep(level=1)"]


def test_level_two_turn_without_a_sync_first_gets_the_weights_back(monkeypatch):
    """--rollout-sleep-level 2: the turn's sleep discards the weights (megarl's derived state first); a step's
    sync brings them back, and a turn that finds them discarded (an evaluation's, then the step's) has the
    sync strategy re-send them while the trainer is still on the device."""
    log = []
    run, engine = _colocated_run(monkeypatch, log)
    engine.args.rollout_sleep_level = 2
    with Run.rollout_turn(run):
        log.append("evaluate")
    assert engine.weights_discarded
    with pytest.raises(RuntimeError, match="before a weight sync"):
        engine.generate([[1]], [0], step=0)
    with Run.rollout_turn(run):
        log.append("generate")
    run.weight_sync.sync(run.actor, engine)
    assert log == [
        "actor.offload", "critic.offload", "evaluate", "vllm._discard_derived_state", "vllm.sleep(level=2)",
        "actor.onload", "critic.onload",
        "vllm.wake_up(['weights'])", "actor.hf_weights", "vllm.load(2 tensors)",  # re-sent, trainer on the device
        "actor.offload", "critic.offload", "vllm.wake_up(['kv_cache'])", "generate",
        "vllm._discard_derived_state", "vllm.sleep(level=2)", "actor.onload", "critic.onload",
        "vllm.wake_up(['weights'])", "actor.hf_weights", "vllm.load(2 tensors)"]
    assert not engine.weights_discarded


def test_level_two_discards_only_allocations_of_parameters_alone(monkeypatch):
    """GPU, level 2 (rollout._keep_allocations_beyond_parameters): an allocation of vLLM's weights pool is
    discarded only when torch's snapshot shows it holding parameters' (or kept weights') storage alone;
    one with anything else live in it (Model Runner V2's state, a derived tensor), or that the snapshot
    does not describe, goes to the "runtime" pool, which vLLM keeps at level 2."""
    from vllm.device_allocator.cumem import CuMemAllocator

    from megarl import rollout

    param, shared, kept = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    other = torch.zeros(8)
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Parameter(param), torch.nn.Parameter(shared)
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
    layers = [(None, {"weight": kept}, "model.layers.0")]

    def allocation(tag):
        return SimpleNamespace(tag=tag, is_asleep=False, handle=(None, 4096))

    def address(tensor):
        return tensor.untyped_storage().data_ptr()

    allocations = {1000: allocation("weights"), 2000: allocation("weights"), 3000: allocation("weights"),
                   4000: allocation("weights"), 5000: allocation("kv_cache")}

    def block(at, state="active_allocated"):
        return {"address": at, "size": 512, "state": state}

    snapshot = [{"address": 1000, "blocks": [block(address(model.a))]},  # a parameter alone
                {"address": 2000, "blocks": [block(address(model.b)), block(address(other))]},  # and more
                {"address": 3000, "blocks": [block(address(kept)), block(7, "inactive")]},  # kept + free space
                {"address": 5000, "blocks": [block(address(other))]}]  # 4000: not in the snapshot
    monkeypatch.setattr(CuMemAllocator, "get_instance", staticmethod(lambda: SimpleNamespace(
        pointer_to_data=allocations)))
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshot)
    rollout._keep_allocations_beyond_parameters(worker, layers)
    assert {at: data.tag for at, data in allocations.items()} == {
        1000: "weights", 2000: "runtime", 3000: "weights", 4000: "runtime", 5000: "kv_cache"}


def test_separate_placement_turn_moves_nothing(monkeypatch):
    log = []
    run, engine = _colocated_run(monkeypatch, log)
    run.context.placement.colocated = False
    with Run.rollout_turn(run):
        log.append("generate")
    assert log == ["generate"] and engine.asleep == set()


# ------------------------------------------------------------ bounded start-up wait ----


def _context(store, rank, world_size):
    return SimpleNamespace(store=store, rank=rank, env=SimpleNamespace(world_size=world_size))


def test_start_up_wait_returns_when_every_rank_arrived_and_names_the_missing_ones():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    # ranks 0-2 and 4 of 6 arrive; 3 and 5 are still building their engines
    for rank in (1, 2, 4):
        dist.PrefixStore("megarl/reached/start-up/", store).set(str(rank), "1")
    with pytest.raises(distributed.StartupTimeout) as error:
        distributed.wait_for_every_rank(_context(store, 0, 6), minutes=0.2 / 60)
    message = str(error.value)
    assert "\n" not in message and message.startswith("start-up: ranks 3, 5 were not ready")
    assert "--startup-timeout-minutes" in message
    for rank in (3, 5):
        dist.PrefixStore("megarl/reached/start-up/", store).set(str(rank), "1")
    distributed.wait_for_every_rank(_context(store, 0, 6), minutes=0.2 / 60)  # all there: returns


def test_rank_ranges():
    assert distributed._ranges([0, 1, 2, 3, 6, 8, 9]) == "0-3, 6, 8-9"
