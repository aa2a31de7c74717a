"""Parsers of model output: tool calls (`sonar.parsers.tools`) and reasoning (`sonar.parsers.reasoning`).

Pure text in, text out: no tokenizer, no I/O. The HTTP layer runs them on what the engine
generated (whole, or delta by delta when streaming). `load_plugin` runs an operator's Python file
(--tool-parser-plugin, --reasoning-parser-plugin) that registers more parsers by name.
"""

from __future__ import annotations

from sonar.parsers.plugins import ParserError, load_plugin

__all__ = ["ParserError", "load_plugin"]
