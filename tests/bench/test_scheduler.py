"""`python -m sonar bench scheduler`: the parts of a decode step outside the model, per running count."""

from __future__ import annotations

import pytest

from sonar.__main__ import main


def test_prints_one_row_per_running_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "scheduler", "--running", "1,3", "--steps", "4", "--prompt-len", "20"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("median CPU time per decode step (us), 4 steps, prompts of 20 tokens")
    assert lines[1].split() == ["running", "core", "metadata", "detokenize", "stream", "total", "per", "request"]
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["1", "3"]
    for row in rows:
        values = [float(v) for v in row[1:]]
        assert all(v >= 0 for v in values) and values[4] > 0
        assert values[5] == pytest.approx(values[4] / int(row[0]), abs=0.1)


def test_refuses_a_count_of_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "scheduler", "--running", "0"])
    assert exc.value.code == 2
    assert "must be positive" in capsys.readouterr().err
