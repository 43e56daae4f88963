"""`--external-plugins`: user files that register names in megarl's registries (rewards, algorithms, ...).

One loader for the trainer, `python -m megarl.score` and the reward worker processes (which import
the trainer's plugins again, in the same order). It imports nothing heavy: a reward worker or the
scoring command would otherwise pay torch's import (about 2 s) for each start.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from megarl.errors import ConfigError

_LOADED_PLUGINS: dict[str, None] = {}  # in load order (reward worker processes load them again)


def load_plugins(paths: list[str]) -> None:
    """Import each plugin file once; a plugin registers names in megarl's registries. A missing file or
    a plugin that raises is a ConfigError naming the file."""
    for path in paths:
        if path in _LOADED_PLUGINS:
            continue
        if not os.path.isfile(path):
            raise ConfigError(f"--external-plugins {path}: no such file")
        spec = importlib.util.spec_from_file_location(f"megarl_plugin_{len(_LOADED_PLUGINS)}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # so the plugin's classes and functions pickle by name
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 - any plugin failure is a configuration error
            del sys.modules[spec.name]
            raise ConfigError(f"--external-plugins {path}: {type(error).__name__}: {error}") from None
        _LOADED_PLUGINS[path] = None


def loaded_plugins() -> list[str]:
    """The plugin files imported so far, in order."""
    return list(_LOADED_PLUGINS)
