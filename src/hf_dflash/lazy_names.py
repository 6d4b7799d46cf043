"""Public names imported on first use (PEP 562), as transformers' own are: a package lists which module defines each of
its names, and `import` of the package stays light (so `hf-dflash --help` answers without importing torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(
    package: str, modules: dict[str, tuple[str, ...]], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The `__getattr__`, `__dir__` and `__all__` of `package` (its `globals()` is `namespace`) whose public names are
    `modules` (a module's full name -> the names it defines). A name is imported when first looked up, then kept in
    `namespace` so that the next lookup does not come back here."""
    module_of = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_of[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(module_of))

    return __getattr__, __dir__, sorted(module_of)


__all__ = ["lazy_names"]
