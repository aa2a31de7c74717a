"""`python -m sonar bench embed`: embeddings per second through `sonar.open()`, beside
sentence-transformers on the same tiny model and texts, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.bench.conftest import env_of_subprocess
from tests.models.tiny_pooling import save_tiny_sentence_transformer

ROOT = Path(__file__).resolve().parents[2]


def test_embed_report_beside_sentence_transformers(tmp_path: Path) -> None:
    model, out = tmp_path / "model", tmp_path / "embed.json"
    save_tiny_sentence_transformer(model, pooling="mean")
    args = ["--model", str(model), "--dtype", "float32", "--num-prompts", "6", "--input-len", "20"]
    proc = subprocess.run(
        [sys.executable, "-m", "sonar", "bench", "embed", *args, "--check", "--output-json", str(out)],
        cwd=ROOT,
        env=env_of_subprocess(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 6 and result["input_len"] == 20
    sonar, peer = result["sonar"], result["sentence_transformers"]
    assert sonar["prompt_tokens"] == peer["prompt_tokens"] == 6 * 22  # 20 words, [CLS] and [SEP]
    assert sonar["embeddings_per_second"] > 0 and peer["embeddings_per_second"] > 0
    assert result["ratio"] == sonar["embeddings_per_second"] / peer["embeddings_per_second"]
    assert result["cosine_min"] >= 0.9999  # float32 on both sides: the same vectors
    assert "Ratio (Sonar / sentence-transformers):" in proc.stdout
