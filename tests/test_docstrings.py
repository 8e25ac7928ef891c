"""Every public method of an exported class has a docstring (issue #24).

For every public module of touba (each package's ``__init__`` and the public submodules
such as ``touba.history.sqlite`` or ``touba.integrations.langgraph``), every class in its
``__all__`` must document every public callable member it defines or inherits from a touba
class: methods, classmethods, staticmethods and properties. The rule is
``inspect.getdoc``'s: a method overriding a documented base method inherits its doc; a
protocol implementation that does not subclass the protocol says so in one line.

Members inherited from bases outside touba (pydantic's ``BaseModel``, ``Exception``,
``dict``, ...) are not ours to document and are skipped, as are dunder methods and
dataclass fields (values, not methods). The test is parametrised per module, so a failure
names the module and lists every member missing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil
from collections.abc import Callable
from typing import Any

import pytest

import touba


def _public_modules() -> list[str]:
    names = [info.name for info in pkgutil.walk_packages(touba.__path__, "touba.")]
    public = [name for name in names if not any(p.startswith("_") for p in name.split("."))]
    return sorted(["touba", *public])


def _exported_classes(module_name: str) -> list[type]:
    module = importlib.import_module(module_name)
    exported = getattr(module, "__all__", None)
    if exported is None:
        return []
    objects = (getattr(module, name) for name in exported)
    return [obj for obj in objects if inspect.isclass(obj)]


def _is_touba(cls: type) -> bool:
    return cls.__module__ == "touba" or cls.__module__.startswith("touba.")


def _callable_member(raw: Any) -> bool:
    """Whether a class's own attribute is a method, a property or the like, not a value."""
    if isinstance(raw, (staticmethod, classmethod, property, functools.cached_property)):
        return True
    return inspect.isfunction(raw)


def _documented(cls: type, name: str) -> bool:
    """Whether ``cls.name`` or the same name on a base class has a docstring.

    The rule of ``inspect.getdoc``, which inherits a base's doc, written out over the MRO
    because ``getdoc`` finds the class of a method by its qualified name, which fails for
    classes defined inside functions.
    """
    for base in cls.__mro__:
        raw = vars(base).get(name)
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        if raw is not None and inspect.cleandoc(getattr(raw, "__doc__", None) or ""):
            return True
    return False


def _missing(cls: type) -> list[str]:
    """The public callable members of ``cls`` defined in touba that have no docstring."""
    missing = []
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for name in sorted(dir(cls)):
        if name.startswith("_") or name in fields:  # a field defaulting to a function is a value
            continue
        owner = next((base for base in cls.__mro__ if name in vars(base)), None)
        if owner is None or not _is_touba(owner):
            continue
        if not _callable_member(vars(owner)[name]):
            continue
        if not _documented(cls, name):
            missing.append(f"{cls.__qualname__}.{name} (defined in {owner.__module__})")
    return missing


def missing_docstrings(module_name: str) -> list[str]:
    """Every undocumented public method of the classes ``module_name`` exports."""
    missing: list[str] = []
    for cls in _exported_classes(module_name):
        missing.extend(m for m in _missing(cls) if m not in missing)
    return missing


@pytest.mark.parametrize("module_name", _public_modules())
def test_public_methods_of_exported_classes_have_docstrings(module_name: str) -> None:
    missing = missing_docstrings(module_name)
    assert not missing, f"{module_name}: {len(missing)} undocumented:\n" + "\n".join(missing)


def test_an_undocumented_method_is_found() -> None:
    """The check itself: a new undocumented method fails it, a documented one passes."""

    class Documented:
        def keep(self) -> None:
            """Documented."""

    class Undocumented(Documented):
        def keep(self) -> None:  # inherits the doc of Documented.keep
            pass

        def added(self) -> None:
            pass

        @property
        def size(self) -> int:
            return 0

    def tick() -> float:
        return 0.0

    @dataclasses.dataclass
    class Fields:
        clock: Callable[[], float] = tick
        size: int = 0

    Documented.__module__ = Undocumented.__module__ = Fields.__module__ = "touba.example"
    assert _missing(Documented) == []
    assert _missing(Fields) == []
    where = "test_an_undocumented_method_is_found.<locals>.Undocumented"
    assert _missing(Undocumented) == [
        f"{where}.added (defined in touba.example)",
        f"{where}.size (defined in touba.example)",
    ]
