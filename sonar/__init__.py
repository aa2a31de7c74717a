"""Sonar: an LLM inference server built from supervised actors."""

__version__ = "0.1.0"
