"""--middleware paths: a class and an async function load as starlette middleware (the last given
outermost); a path that does not import, or names something else, is a `MiddlewareError` naming it."""

from __future__ import annotations

import pytest
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.middleware.cors import CORSMiddleware

from sonar.errors import SonarError
from sonar.http.middleware import MiddlewareError, load_middleware


async def add_header(request, call_next):  # an HTTP middleware function, as the flag's users write them
    response = await call_next(request)
    response.headers["x-test"] = "1"
    return response


NOT_ASYNC = len


def test_class_and_function_load_last_outermost() -> None:
    loaded = load_middleware(["starlette.middleware.cors:CORSMiddleware", f"{__name__}.add_header"])
    assert [m.cls for m in loaded] == [BaseHTTPMiddleware, CORSMiddleware]
    assert loaded[0].kwargs == {"dispatch": add_header}


@pytest.mark.parametrize(
    "path, says",
    [
        ("nosuch_module_xyz:Thing", "cannot import nosuch_module_xyz: ModuleNotFoundError"),
        (f"{__name__}:missing", "has no attribute 'missing'"),
        (f"{__name__}:NOT_ASYNC", "neither an ASGI middleware class nor an async function"),
        ("plainname", "give an import path"),
    ],
)
def test_bad_paths_name_the_problem(path: str, says: str) -> None:
    with pytest.raises(MiddlewareError, match=says) as info:
        load_middleware([path])
    assert isinstance(info.value, SonarError) and path in str(info.value)
