"""Names a package exports but imports only on first use, so that importing the package stays
cheap: the flags' parser reads `sonar.offload.config` and `sonar.structured.config` without the
modules beside them (and torch). The package `sonar` itself does the same by hand: it may import
nothing of its own floor."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for `package`: each name of `exports` (name -> the module
    that defines it) is imported from its module on first use and kept in `namespace` (the
    package's globals), so later lookups do not come back here."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
