"""Where Sonar keeps what it derives on this machine."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ROOT_ENV = "SONAR_CACHE_ROOT"


def cache_root() -> Path:
    """``$SONAR_CACHE_ROOT`` or ``~/.cache/sonar``: converted weights and tokenizers, compile
    artifacts, the native CPU kernels."""
    return Path(os.environ.get(CACHE_ROOT_ENV) or Path.home() / ".cache" / "sonar")
