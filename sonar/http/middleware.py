"""--middleware: the operator's own ASGI middleware, imported by path and wrapped around the app.

Each path is ``module:attr`` or ``module.attr`` (the last dot splits). A class is an ASGI
middleware in starlette's sense (``cls(app, **options)``), added as `app.add_middleware` would; a
function is an HTTP middleware, ``async def f(request, call_next) -> Response``, as with
``@app.middleware("http")``. Anything else, or a path that does not import, stops the start
(`MiddlewareError`) rather than serving without it.

They wrap Sonar's own middleware (CORS, body limits, API keys), as vLLM's do: the last one given is
the outermost.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Sequence

from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware

from sonar.errors import SonarError


class MiddlewareError(SonarError, ValueError):
    """A --middleware path that does not import or names neither a class nor a function."""


def import_path(path: str, flag: str) -> Any:
    """The object `path` (``module:attr`` or ``module.attr``) names; `flag` goes into the error."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise MiddlewareError(f"{flag} {path!r}: give an import path, module:attr or module.attr")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure of the operator's module stops the start
        raise MiddlewareError(f"{flag} {path!r}: cannot import {module_name}: {type(exc).__name__}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise MiddlewareError(f"{flag} {path!r}: module {module_name} has no attribute {attr!r}") from None


def load_middleware(paths: Sequence[str]) -> list[Middleware]:
    """Starlette `Middleware` entries for `paths`, outermost first (the last path given)."""
    loaded = []
    for path in paths:
        obj = import_path(path, "--middleware")
        if inspect.isclass(obj):
            loaded.append(Middleware(obj))
        elif inspect.iscoroutinefunction(obj):
            loaded.append(Middleware(BaseHTTPMiddleware, dispatch=obj))
        else:
            raise MiddlewareError(
                f"--middleware {path!r}: {type(obj).__name__} is neither an ASGI middleware class nor an "
                "async function (request, call_next)"
            )
    return loaded[::-1]
