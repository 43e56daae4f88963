"""One way to register a name, for every registry in megarl (algorithms, rewards, dataset
preprocessors, weight-sync strategies, model families, kernel implementations): a `Registry` is a
dict from names to what they name, filled through `register` (a decorator) or `Registry.add`, both
of which refuse a name given twice, so a plugin cannot silently replace a built-in or another plugin.
"""

from __future__ import annotations


class Registry(dict):
    """name -> registered object, for one kind of thing (`kind` names it in the error)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def add(self, name: str, value):
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self[name] = value
        return value


def register(registry: Registry, name: str):
    """Decorator: `registry[name]` = the decorated function or class, returned unchanged."""
    def wrap(obj):
        registry.add(name, obj)
        return obj
    return wrap
