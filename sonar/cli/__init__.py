"""The `sonar serve` command line: the flag table, the parser, help search and `--config` files.

from sonar.cli import parse_serve_args
config = parse_serve_args(["Qwen/Qwen3-0.6B", "--max-model-len", "32k", "--port", "8000"])
config.engine.max_model_len  # 32000
"""

from sonar.cli.config import ServeConfig
from sonar.cli.errors import HelpRequested, UsageError
from sonar.cli.flags import Flag, Group, Kind, Status
from sonar.cli.help import render_help
from sonar.cli.parse import parse_serve_args
from sonar.cli.table import FLAGS, GROUPS

__all__ = [
    "FLAGS",
    "GROUPS",
    "Flag",
    "Group",
    "HelpRequested",
    "Kind",
    "ServeConfig",
    "Status",
    "UsageError",
    "parse_serve_args",
    "render_help",
]
