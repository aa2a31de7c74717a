"""Response ids and JSON responses."""

from __future__ import annotations

import secrets
from typing import Any

import msgspec
from starlette.responses import Response


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")
