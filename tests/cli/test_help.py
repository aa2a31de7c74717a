"""--help lists groups; --help=NAME finds a group, a flag, or every partial match; --help=all has all."""

from __future__ import annotations

import re

import pytest

from sonar.cli import FLAGS, GROUPS, HelpRequested, UsageError, parse_serve_args, render_help


def help_for(*argv: str) -> str:
    with pytest.raises(HelpRequested) as info:
        parse_serve_args(list(argv))
    return info.value.text


def flags_in(text: str) -> set[str]:
    """The flags a help text documents (each starts a line, indented by two spaces)."""
    return set(re.findall(r"^  (--[a-z0-9-]+)", text, flags=re.MULTILINE))


def test_plain_help_lists_every_group() -> None:
    text = help_for("--help")
    assert text.startswith("usage: python -m sonar serve")
    for group in GROUPS:
        assert f"\n  {group.name}" in text or group.name == "options"
    assert "--help=all" in text
    assert flags_in(text) == {f.name for f in GROUPS[0].flags}  # only the top-level options in full
    assert help_for("-h") == text
    assert help_for("--model", "x", "--max-num-seqs", "bad", "--help") == text  # help wins over errors


def test_help_for_one_flag() -> None:
    text = help_for("--help=max-model-len")
    assert flags_in(text) == {"--max-model-len"}
    assert text.startswith("ModelConfig:")
    assert "32K (32768)" in text and "'auto' or -1" in text
    for spelling in ("--max-model-len", "max_model_len", "MAX-MODEL-LEN"):
        assert help_for(f"--help={spelling}") == text
    assert help_for("--help", "max-model-len") == text


def test_help_for_alias_and_no_form() -> None:
    assert flags_in(help_for("--help=tp")) == {"--tensor-parallel-size"}
    assert flags_in(help_for("--help=no-enable-prefix-caching")) == {"--enable-prefix-caching"}


def test_help_for_a_group() -> None:
    text = help_for("--help=CacheConfig")
    cache = next(g for g in GROUPS if g.name == "CacheConfig")
    assert flags_in(text) == {f.name for f in cache.flags}
    assert {"--block-size", "--gpu-memory-utilization", "--kv-cache-memory-bytes"} <= flags_in(text)
    assert help_for("--help=cacheconfig") == text


def test_help_partial_match() -> None:
    text = help_for("--help=prefix")
    assert flags_in(text) == {"--enable-prefix-caching", "--prefix-caching-hash-algo", "--prefix-match-unit"}
    lora = flags_in(help_for("--help=lora"))
    assert {"--enable-lora", "--max-loras", "--lora-modules", "--fully-sharded-loras"} <= lora


def test_help_all_has_every_flag() -> None:
    text = help_for("--help=all")
    assert flags_in(text) == set(FLAGS)
    assert all(len(line) <= 100 for line in text.splitlines())


def test_help_shows_status_choices_and_default() -> None:
    text = render_help("decode-context-parallel-size")
    assert "Default: 1." in text and "Sonar: not supported yet; accepted only as 1." in text
    text = " ".join(render_help("all2all-backend").split())
    assert "Sonar: not supported yet (Sonar's expert parallelism exchanges no tokens" in text
    text = " ".join(render_help("data-parallel-backend").split())
    assert "Choices: mp, ray." in text and "not supported" not in text
    text = " ".join(render_help("disable-custom-all-reduce").split())
    assert "Sonar: either value is accepted and means the same for Sonar: Sonar's all-reduce is always" in text
    text = render_help("dtype")
    assert "Choices: auto, bfloat16, float, float16, float32, half." in text
    assert "Also one key at a time: --override-generation-config.KEY VALUE" in render_help("override-generation-config")


def test_help_no_match_is_an_error() -> None:
    with pytest.raises(UsageError) as info:
        parse_serve_args(["--help=no-such-thing-at-all"])
    assert str(info.value) == "sonar serve: error: --help: no flag or group matches 'no-such-thing-at-all'"
    with pytest.raises(UsageError) as info:
        render_help("max-num-seq5")
    assert "(close: max-num-seqs" in str(info.value)
