"""Resolved configs read back from the cache: every attribute Sonar's model code reads is what
transformers resolved, for each architecture Sonar serves and the embedded model; a load from the
cache builds the same model; other bytes are another entry."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from sonar.models import config_cache
from sonar.models.loader import checkpoint_dtype, load_model
from tests.models.conftest import TINY_NAMES


def _same_reads(real: Any, cached: Any) -> None:
    for name in config_cache.READ:
        if name != "dtype":  # a name in the cache, a torch dtype in transformers
            assert getattr(cached, name, None) == getattr(real, name, None), name
    assert checkpoint_dtype(cached) == checkpoint_dtype(real)
    assert cached.to_dict() == json.loads(json.dumps(real.to_dict()))


@pytest.mark.parametrize("name", TINY_NAMES)
def test_cached_config_reads_as_transformers_resolved_it(tiny_checkpoints: dict[str, Any], name: str) -> None:
    path = tiny_checkpoints[name].path
    text = (path / "config.json").read_bytes()
    real = AutoConfig.from_pretrained(str(path))
    config_cache.write(text, real)
    cached = config_cache.read(text)
    assert isinstance(cached, config_cache.CachedConfig)
    _same_reads(real, cached)


def test_embedded_config_reads_the_same(smollm2_fp32: Any) -> None:
    text = (smollm2_fp32.model_dir / "config.json").read_bytes()
    real = AutoConfig.from_pretrained(str(smollm2_fp32.model_dir))
    config_cache.write(text, real)
    _same_reads(real, config_cache.read(text))


def test_a_load_from_the_cache_builds_the_same_model(tiny_checkpoints: dict[str, Any], tmp_path: Path) -> None:
    source = tmp_path / "qwen3"
    shutil.copytree(tiny_checkpoints["qwen3"].path, source)
    text = (source / "config.json").read_bytes()
    path = config_cache.cache_path(text)
    assert path is not None
    path.unlink(missing_ok=True)
    first = load_model(str(source), dtype="float32")
    assert not isinstance(first.config, config_cache.CachedConfig) and path.is_file()
    second = load_model(str(source), dtype="float32")
    assert isinstance(second.config, config_cache.CachedConfig)
    for (name, a), (_, b) in zip(first.model.state_dict().items(), second.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # other bytes (an edited config) are another entry; a damaged entry is read again from the JSON
    assert config_cache.cache_path(text + b"\n") != path
    path.write_text("{not json")
    assert config_cache.read(text) is None
    assert not isinstance(load_model(str(source), dtype="float32").config, config_cache.CachedConfig)
    assert isinstance(config_cache.read(text), config_cache.CachedConfig)
