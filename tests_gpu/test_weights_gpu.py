"""Weight updates on the GPU: the decode steps replay CUDA graphs captured over the parameters'
addresses, so an update must write in place; after it the greedy answer is transformers' on the
new checkpoint. Also the RL loop of docs/operations.md: sleep at level 1 (weights in host memory),
update them there, wake up (graphs captured again)."""

from __future__ import annotations

from pathlib import Path

import pytest

import sonar
from tests.engine.test_weights import GREEDY, PROMPTS, expected, save_llama

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_updates_write_under_the_cuda_graphs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SONAR_DEVICE", "cuda")
    hf_a, hf_b = save_llama(tmp_path / "a", 1), save_llama(tmp_path / "b", 2)
    async with sonar.open(
        str(tmp_path / "a"),
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=64,
        cudagraph_capture_sizes=[1, 2, 4],
        optimization_level=1,
        enable_sleep_mode=True,
        weight_transfer_config={"backend": "sonar"},
    ) as llm:

        async def answers() -> list[list[int]]:
            return [o.token_ids for o in await llm.generate_many(PROMPTS, GREEDY)]

        assert await answers() == expected(hf_a)
        await llm.update_weights(tmp_path / "b")
        assert await answers() == expected(hf_b)

        await llm.sleep(1)
        await llm.update_weights(tmp_path / "a")  # into the weights in host memory
        await llm.wake_up()
        assert await answers() == expected(hf_a)
