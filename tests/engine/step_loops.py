"""The engine, prompts and sampling both loop variants (async scheduling, multi-step decode) are
checked against one step per trip with: five prompts over four seats (one waits), greedy ones that
EOS ends early and `max_tokens` ends late, and seeded sampling."""

from __future__ import annotations

from sonar import SamplingParams

ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, seed=0, max_num_seqs=4)
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three colors:",
    "Hello! How are you today?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24)  # EOS ends some of them early
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=16)
