"""Components of your own: add a class to the catalogue, and specs accept its `kind`.

    from miras.registry import register

    class SwiGLU3Memory(Memory):  # components/base.py names the hooks a kind declares
        kind: Literal["swiglu3"] = "swiglu3"
        ...

    register(SwiGLU3Memory)
    miras.compile({"name": "mine", "memory": "swiglu3"})

The catalogue is `miras.components.CATALOGUE` (a dict you can print); `register` puts the
class under its family and kind there and rebuilds `miras.spec.Spec`'s field of that family,
so that the spec's validation picks the class by `kind` like a shipped one. Everything past
the spec (the compiler, the forms, the models) asks the component its hooks, never its kind.
`unregister` (or the `registered` context manager, for tests) takes it out again.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from contextlib import contextmanager

from pydantic.fields import FieldInfo

from miras.components import CATALOGUE
from miras.components.base import Component
from miras.spec import Spec, one_of


def _kind_of(cls: type) -> tuple[str, str]:
    """(family, kind) of a component class, or a ValueError saying what the class lacks."""
    if not isinstance(cls, type) or not issubclass(cls, Component):
        raise ValueError(f"register: expected a Component subclass, got {cls!r}")
    family = cls.family
    if family not in CATALOGUE:
        raise ValueError(
            f"register: {cls.__name__} has no family (its base is not one of the kinds' bases: "
            f"{', '.join(sorted(CATALOGUE))})"
        )
    field = cls.model_fields["kind"]
    values = typing.get_args(field.annotation)
    if typing.get_origin(field.annotation) is not typing.Literal or len(values) != 1:
        raise ValueError(
            f"register: {cls.__name__}.kind must be one Literal string, as "
            f'kind: Literal["name"] = "name"; got {field.annotation!r}'
        )
    return family, values[0]


def _rebuild(family: str) -> None:
    """Spec's field `family` accepts exactly the classes now in `CATALOGUE[family]`."""
    default = Spec.model_fields[family].default
    Spec.model_fields[family] = FieldInfo.from_annotated_attribute(one_of(family), default)
    Spec.model_rebuild(force=True)


def register(cls: type[Component]) -> None:
    """Add `cls` to `CATALOGUE[cls.family]` under its kind; a kind taken by another class is
    refused (a class registered twice is left as it is)."""
    family, kind = _kind_of(cls)
    members = CATALOGUE[family]
    if members.get(kind, cls) is not cls:
        raise ValueError(
            f"register: {family} kind {kind!r} is taken by {members[kind].__name__}; taken "
            f"kinds: {', '.join(members)}"
        )
    if kind not in members:
        members[kind] = cls
        _rebuild(family)


def unregister(cls: type[Component]) -> None:
    """Take `cls` out of the catalogue again (it must be the class registered there)."""
    family, kind = _kind_of(cls)
    if CATALOGUE[family].get(kind) is not cls:
        raise ValueError(f"unregister: {cls.__name__} is not the registered {family} {kind!r}")
    del CATALOGUE[family][kind]
    _rebuild(family)


@contextmanager
def registered(*classes: type[Component]) -> Iterator[None]:
    """`register` each class for the duration of a `with` block, then `unregister` it."""
    done = []
    try:
        for cls in classes:
            family, kind = _kind_of(cls)
            if CATALOGUE[family].get(kind) is cls:
                continue  # registered before the block: left registered after it
            register(cls)
            done.append(cls)
        yield
    finally:
        for cls in reversed(done):
            unregister(cls)


__all__ = ["register", "registered", "unregister"]
