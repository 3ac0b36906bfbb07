"""A registry of named functions of one kind: the one place a choice set is written."""

from __future__ import annotations

from enum import StrEnum
from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions of one kind by name (in the spirit of verl's ``register_adv_est``): ``@REGISTRY.register("name")``
    adds one, ``REGISTRY.get(name, key)`` looks one up and names the config key and the choices when it is unknown.

    Args:
        kind: what the functions are, for error messages (e.g. "advantage estimator").
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._functions: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator registering a function under ``name``; a second, different function under a taken name is an
        error (it would silently change what every config naming it runs). A registered object that is equal to the
        one registered (the same function with the same declarations) is no second one."""

        def add(fn: F) -> F:
            taken = self._functions.get(name)
            if taken is not None and taken != fn:
                raise ValueError(f"{self.kind} {name!r} is already registered ({_origin(taken)})")
            self._functions[name] = fn
            return fn

        return add

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._functions)

    def __contains__(self, name: object) -> bool:
        return name in self._functions

    def get(self, name: str, key: str) -> F:
        """The function registered as ``name``; ValueError naming ``key`` (the config key that chose it) and the
        registered names when there is none."""
        try:
            return self._functions[name]
        except (KeyError, TypeError):
            raise ValueError(f"{key} must be one of {self.names()} (registered {self.kind}s), got {name!r}") from None

    def resolve(self, choice: str | F, key: str) -> F:
        """``choice`` itself when it is a function (a user's own), else the function registered under that name."""
        return choice if callable(choice) else self.get(choice, key)

    def choices(self, enum_name: str, module: str, doc: str) -> type[StrEnum]:
        """A StrEnum of the names registered now, defined as ``module.enum_name`` (so its members pickle): a typed
        config field of this type refuses any other value when the config is composed."""
        enum = StrEnum(enum_name, [(n, n) for n in self._functions], module=module)
        enum.__doc__ = doc
        return enum


def _origin(fn: Callable) -> str:
    """Where a registered function was defined (for a declaration that wraps one, e.g. a policy objective's, its
    ``fn``'s)."""
    fn = getattr(fn, "fn", fn)
    return f"{fn.__module__}.{fn.__qualname__}"
