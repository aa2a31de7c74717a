"""`LoRARequest`, an adapter as the engine's messages carry it, and `LoRAError` (no torch here: the
frontend's messages import this)."""

from __future__ import annotations

import msgspec

from sonar.errors import SonarError


class LoRAError(SonarError, ValueError):
    """An adapter cannot be served: a bad or missing file, or what it asks for is not supported or
    exceeds the server's limits (the message says which)."""

    status = 400


class LoRANotFoundError(LoRAError):
    """No adapter of that name is loaded."""

    status = 404


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """An adapter as requests carry it: its served name, its folder and its digest."""

    name: str
    path: str
    digest: str
    """Hex SHA-256 over the adapter's config and weights files (`sonar.lora.adapter.file_digest`)."""
