"""The one exception type a failed model load raises, so callers catch a single thing."""

from __future__ import annotations

from sonar.errors import SonarError


class ModelLoadError(SonarError, ValueError):
    """A model could not be loaded; the message names the source and what is wrong with it."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's `architectures` (or GGUF `general.architecture`) is not one Sonar implements."""
