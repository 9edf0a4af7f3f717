"""Registries: the one list of an extension point (backbones, samplers, metrics, schedules, claim kinds).

The module that owns an extension point makes a `Registry` and fills it, one line per entry:

    BACKBONES = Registry("backbone", key="model.backbone")
    BACKBONES.add("unet", build_unet)

Dispatch (`BACKBONES.choose(name)`), validation and every list shown to a user (CLI choices, help texts,
error messages) read that one registry, so nothing else names the entries. A registry made with a config
`key` is also what the config loader checks that key's value against (`registries_for`); `scope` limits it
to configs where another key has a given value (a formulation's samplers apply under its `diffusion.kind`).

This is the lowest layer, so a config field can name a registry that a higher layer fills: the config is
checked against the registries loaded at that moment (the CLI loads them all first), and each builder
checks its own name again with the same error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")

_BY_KEY: dict[str, list[Registry]] = {}  # config key -> the registries its value must name an entry of


class Registry(dict[str, T], Generic[T]):
    """name -> entry of one extension point, in the order entries were added.

    what: what an entry is, for messages ("backbone"); key: the config key whose value names an entry
    (None: no config key); scope: (config key, value) under which this registry applies, e.g.
    ("diffusion.kind", "vp") for the VP samplers.
    """

    def __init__(self, what: str, key: str | None = None, scope: tuple[str, str] | None = None):
        super().__init__()
        self.what, self.key, self.scope = what, key, scope
        if key is not None:
            _BY_KEY.setdefault(key, []).append(self)

    def add(self, name: str, entry: T) -> T:
        if name in self:
            raise KeyError(f"{self.what} {name!r} is registered twice")
        self[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`: `@BACKBONES.register("unet")` above the builder."""
        return lambda entry: self.add(name, entry)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self)

    def choose(self, name: str, given: str | None = None) -> T:
        """The entry called `name`, or a one-line ConfigError naming every valid choice. `given`: the config
        key or CLI flag that named it (default: this registry's key)."""
        if name in self:
            return self[name]
        where = given or self.key or self.what
        choices = ", ".join(self)
        if self.scope is not None:
            raise ConfigError(f"{where}: {self.what} {name!r} does not apply to {self.scope[0]}={self.scope[1]}; "
                              f"choose one of {choices}")
        raise ConfigError(f"{where}: unknown {self.what} {name!r}; choose one of {choices}")


def registries_for(key: str) -> list[Registry]:
    """The registries loaded so far whose entries the config key `key` names (empty: none loaded yet)."""
    return list(_BY_KEY.get(key, []))


def registry_keys() -> list[str]:
    """Every config key some loaded registry validates."""
    return list(_BY_KEY)
