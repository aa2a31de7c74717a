"""The adapters a server serves, by name: those of ``--lora-modules`` and those loaded at run time
(``POST /v1/load_lora_adapter``, `LLM.load_lora`). A request names one as its ``model``.

Loading reads and checks the whole adapter against the base model (`read_adapter`), so a bad
folder is refused when it is loaded, never when a request first uses it. The worker reads the
folder again when it needs the weights (it may run in another process, on another machine's
disk view of the same path): what it reads must have the digest checked here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from sonar.core.request import LoRARequest
from sonar.errors import LoRAError

if TYPE_CHECKING:
    from sonar.lora.limits import LoRALimits, ModelShapes

MAX_ADAPTERS = 1024
"""Most adapters one server has loaded at once (each costs a table entry and, once used, host memory)."""

MAX_NAME_CHARS = 256

RUNTIME_UPDATING_ENV = "SONAR_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """Whether the HTTP server offers /v1/load_lora_adapter and /v1/unload_lora_adapter
    (``SONAR_ALLOW_RUNTIME_LORA_UPDATING`` is 1 or true): off by default, since a client that
    may load adapters makes the server read folders it names."""
    return os.environ.get(RUNTIME_UPDATING_ENV, "").lower() in ("1", "true")


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: Iterable[Any]) -> list[LoRAModule]:
    """``--lora-modules`` values: ``name=path``, a JSON object ``{"name", "path", "base_model_name"}``
    (or a JSON list of them), or such dicts (the library). Raises ValueError naming a bad entry."""
    out: list[LoRAModule] = []
    for value in values:
        if isinstance(value, str) and value.lstrip().startswith(("{", "[")):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"lora_modules: {value!r} is not valid JSON: {exc}") from None
        for item in value if isinstance(value, list) else [value]:
            out.append(_module(item))
    names = [m.name for m in out]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ValueError(f"lora_modules: the name {duplicate!r} is given twice")
    return out


def _module(item: Any) -> LoRAModule:
    if isinstance(item, str):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules: expected name=path or a JSON object, got {item!r}")
        module = LoRAModule(name, path)
    elif isinstance(item, dict):
        unknown = sorted(set(item) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"lora_modules: unknown key {unknown[0]!r} (name, path, base_model_name)")
        name, path, base = item.get("name"), item.get("path"), item.get("base_model_name")
        if not isinstance(name, str) or not isinstance(path, str) or not (base is None or isinstance(base, str)):
            raise ValueError(f"lora_modules: name and path must be strings in {item!r}")
        module = LoRAModule(name, path, base)
    else:
        raise ValueError(f"lora_modules: expected name=path or a JSON object, got {item!r}")
    check_name(module.name)
    return module


def check_name(name: str) -> None:
    """Refuse an adapter name no client could send back as a ``model`` (ValueError)."""
    if not name or len(name) > MAX_NAME_CHARS or not name.isprintable() or name != name.strip():
        raise ValueError(
            f"LoRA adapter name {name[:MAX_NAME_CHARS]!r}: 1 to {MAX_NAME_CHARS} printable characters, "
            "no leading or trailing space"
        )


@dataclass(frozen=True)
class ServedAdapter:
    request: LoRARequest
    parent: str
    """The served model name it applies to (its ``base_model_name``, else the first served name)."""


class LoRARegistry:
    """The served adapters by name; `reserved` names (the base model's served names) are not
    available to adapters."""

    def __init__(self, shapes: ModelShapes, limits: LoRALimits, reserved: Iterable[str] = ()) -> None:
        self.shapes = shapes
        self.limits = limits
        self.reserved = frozenset(reserved)
        self._adapters: dict[str, ServedAdapter] = {}

    def get(self, name: str) -> LoRARequest | None:
        adapter = self._adapters.get(name)
        return None if adapter is None else adapter.request

    def served(self) -> list[ServedAdapter]:
        return list(self._adapters.values())

    async def load(self, name: str, path: str, parent: str, replace: bool = False) -> LoRARequest:
        """Read and check the adapter in `path` (off the event loop), then serve it as `name`
        (`replace`: in place of the adapter of that name, once the new one has been read).
        Raises `LoRAError` (a bad adapter, a taken name, too many adapters)."""
        try:
            check_name(name)
        except ValueError as exc:
            raise LoRAError(str(exc)) from None
        if name in self.reserved:
            raise LoRAError(f"{name!r} is the base model's name; give the adapter another")
        if name in self._adapters and not replace:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
        if len(self._adapters) >= MAX_ADAPTERS and not replace:
            raise LoRAError(f"{MAX_ADAPTERS} LoRA adapters are loaded already; unload one first")
        from sonar.lora.adapter import read_adapter  # torch: only once adapters are loaded

        weights = await anyio.to_thread.run_sync(read_adapter, path, self.shapes, self.limits)
        if name in self._adapters and not replace:  # loaded by another call while this one read
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
        request = LoRARequest(name=name, path=str(path), digest=weights.digest)
        self._adapters[name] = ServedAdapter(request, parent)
        return request

    def unload(self, name: str) -> None:
        """Stop serving `name` (requests already running keep their adapter). KeyError if unknown."""
        del self._adapters[name]
