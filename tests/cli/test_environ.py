"""`SONAR_*` environment variables: the ones Sonar reads are known, the others are reported at
startup, or stop it with --fail-on-environ-validation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sonar.cli.environ import KNOWN, unknown_variables
from sonar.cli.serve import main

PACKAGE = Path(__file__).resolve().parents[2] / "sonar"


def test_every_variable_the_package_reads_is_known() -> None:
    read = set()
    for path in PACKAGE.rglob("*.py"):
        read |= set(re.findall(r"[\"'](SONAR_[A-Z0-9_]+)[\"']", path.read_text()))
    assert read == KNOWN


def test_unknown_variables_are_named_with_the_closest_known_one() -> None:
    environ = {"SONAR_LOG_LEVELS": "debug", "SONAR_LOG_LEVEL": "info", "SONAR_SHINY": "1", "PATH": "/bin"}
    assert unknown_variables(environ) == [
        "unknown environment variable SONAR_LOG_LEVELS (did you mean SONAR_LOG_LEVEL?)",
        "unknown environment variable SONAR_SHINY",
    ]
    assert unknown_variables({"SONAR_DEVICE": "cpu", "HOME": "/root"}) == []


def test_fail_on_environ_validation_stops_the_start(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("SONAR_LOG_LEVELS", "debug")
    assert main(["--fail-on-environ-validation"]) == 2
    assert capsys.readouterr().err == (
        "sonar serve: error: unknown environment variable SONAR_LOG_LEVELS (did you mean SONAR_LOG_LEVEL?) "
        "(--fail-on-environ-validation)\n"
    )


def test_without_the_flag_an_unknown_variable_is_a_warning(
    monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path
) -> None:
    """The start goes on past the warning (here to a missing --log-config-file, which stops it)."""
    monkeypatch.setenv("SONAR_LOG_LEVELS", "debug")
    assert main(["--log-config-file", str(tmp_path / "missing.json")]) == 2
    captured = capsys.readouterr()
    assert captured.out == (
        "sonar serve: warning: unknown environment variable SONAR_LOG_LEVELS (did you mean SONAR_LOG_LEVEL?)\n"
    )
    assert "--log-config-file" in captured.err
