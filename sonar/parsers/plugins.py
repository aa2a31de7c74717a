"""Loading an operator's parser plugin: a Python file that registers parsers when it runs.

A plugin is the operator's own code, run with the server's rights at startup, like any module
the server imports (never a file a request names). It registers with
`sonar.parsers.tools.register_tool_parser` or `sonar.parsers.reasoning.register_reasoning_parser`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

from sonar.errors import SonarError


class ParserError(SonarError, ValueError):
    """An unknown parser name, or a plugin file that cannot be loaded."""


def load_plugin(path: str) -> ModuleType:
    """Run the Python file at `path` (once per path: a second call returns the loaded module)."""
    path = os.path.abspath(path)
    name = "sonar_parser_plugin_" + "".join(c if c.isalnum() else "_" for c in path)
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.isfile(path):
        raise ParserError(f"parser plugin {path!r}: no such file")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ParserError(f"parser plugin {path!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ParserError(f"parser plugin {path!r} failed to load: {type(exc).__name__}: {exc}") from exc
    return module
