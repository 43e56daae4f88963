"""megarl/registry.py: one registration helper behind every registry, refusing a name given twice."""

from __future__ import annotations

import pytest

from megarl import algorithms, kernels, weight_sync
from megarl.data import datasets
from megarl.models import families
from megarl.registry import Registry, register
from megarl.rewards import REWARDS, _load_builtin_rewards, register_reward


def test_register_adds_and_returns_the_object_and_refuses_a_second_one_in_one_line():
    registry = Registry("widget")

    @register(registry, "a")
    def first():
        return 1

    assert registry == {"a": first} and first() == 1  # the decorated function comes back unchanged
    with pytest.raises(ValueError, match=r"^widget 'a' is registered twice$"):
        register(registry, "a")(lambda: 2)
    with pytest.raises(ValueError, match=r"^widget 'a' is registered twice$"):
        registry.add("a", 3)
    assert registry == {"a": first}  # the refused ones left the first in place


def _every_registry():
    _load_builtin_rewards()
    return {
        "advantage estimator": algorithms.ADVANTAGE_ESTIMATORS, "policy loss": algorithms.POLICY_LOSSES,
        "loss aggregation": algorithms.LOSS_AGGREGATIONS, "KL estimator": algorithms.KL_ESTIMATORS,
        "KL controller": algorithms.KL_CONTROLLERS, "GKD top-k mode": algorithms.GKD_TOPK_MODES,
        "reward": REWARDS, "dataset preprocessor": datasets.DATASET_PREPROCESSORS,
        "weight-sync strategy": weight_sync.WEIGHT_SYNC_STRATEGIES, "model family": families.FAMILIES,
        "kernel implementation": kernels.BACKENDS,
    }


def test_every_registry_is_a_registry_and_refuses_a_built_in_name():
    for kind, registry in _every_registry().items():
        assert isinstance(registry, Registry) and registry.kind == kind
        if not registry:  # no built-in preprocessor: plugins bring them
            continue
        name = next(iter(registry))
        before = registry[name]
        with pytest.raises(ValueError, match=rf"^{kind} '{name}' is registered twice$"):
            register(registry, name)(object())
        assert registry[name] is before


def test_the_plugin_decorators_refuse_a_taken_name():
    """The names plugins use (`register_reward`, `register_preprocessor`, `algorithms.register`) go through
    the same check; the weight-sync strategies took a duplicate silently before."""
    _load_builtin_rewards()
    with pytest.raises(ValueError, match=r"^reward 'boxed' is registered twice$"):
        register_reward("boxed")(lambda response, row: 0.0)
    with pytest.raises(ValueError, match=r"^policy loss 'ppo_clip' is registered twice$"):
        algorithms.register(algorithms.POLICY_LOSSES, "ppo_clip")(lambda *a: None)
    with pytest.raises(ValueError, match=r"^weight-sync strategy 'colocated' is registered twice$"):
        register(weight_sync.WEIGHT_SYNC_STRATEGIES, "colocated")(type("Other", (), {}))
    datasets.register_preprocessor("test_registry_once")(dict)
    try:
        with pytest.raises(ValueError, match=r"^dataset preprocessor 'test_registry_once' is registered twice$"):
            datasets.register_preprocessor("test_registry_once")(list)
        assert datasets.DATASET_PREPROCESSORS["test_registry_once"] is dict
    finally:
        datasets.DATASET_PREPROCESSORS.pop("test_registry_once")
