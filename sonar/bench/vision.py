"""`python -m sonar.bench.vision`: images per second through a Qwen2.5-VL vision tower, and the
time to first token of an image prompt, on dummy (random) weights.

**Tower**: Qwen2.5-VL's vision transformer with the 3B/7B checkpoints' vision config (32 blocks,
hidden 1280, 16 heads, MLP 3420, patches of 14 px merged 2x2, windows of 112 px, full attention
in blocks 7, 15, 23, 31), one ``--size`` x ``--size`` image at a time (448 px: 32 x 32 patches,
256 rows), as the runner encodes them. Prints the median seconds per image and images/s, and the
image processor's time for the same picture (resize, normalize, patchify).

**TTFT**: a `ModelRunner` over a Qwen2.5-VL-shaped dummy checkpoint (the 3B's decoder widths:
hidden 2048, 16 heads, 2 KV heads, MLP 11008, vocabulary 151936, with ``--layers`` decoder layers
instead of 36) runs the whole prompt of one request, ``--text`` text tokens around one image, in
one step: the step's seconds are its time to first token (the tower's encoding included). The
same prompt with text tokens in place of the image's gives the decoder's share.

usage: python -m sonar.bench.vision [--size 448] [--images 3] [--layers 4] [--text 64] [--dtype bfloat16]
       [--threads N] [--skip-tower] [--skip-ttft]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

#: Qwen2.5-VL 3B / 7B vision config (the 72B's differs only in out_hidden_size).
VISION_CONFIG = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    in_channels=3,
    hidden_act="silu",
    out_hidden_size=2048,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
)

#: Qwen2.5-VL 3B's decoder, its depth set by --layers.
TEXT_CONFIG = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=11008,
    num_attention_heads=16,
    num_key_value_heads=2,
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    hidden_act="silu",
    tie_word_embeddings=True,
    model_type="qwen2_5_vl_text",
)
IMAGE_PAD = 151655


def picture(size: int) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")


def patches(size: int) -> tuple[torch.Tensor, list[int], float]:
    """A random ``size`` x ``size`` picture's patches and grid, and the processor's seconds for it."""
    from sonar.multimodal.processor import image_processor
    from sonar.protocol.engine import VisionInfo

    vision = VisionInfo(IMAGE_PAD, 0, 0, None, 14, 2, 2)
    processor = image_processor(vision, None, {"max_pixels": max(size * size, 56 * 56)})
    image = picture(size)
    processor.pixels(image)
    t = time.perf_counter()
    pixels, grid = processor.pixels(image)
    return pixels, grid, time.perf_counter() - t


def bench_tower(size: int, images: int, dtype: torch.dtype, device: torch.device) -> None:
    from sonar.models.qwen2_vl import VisionTransformer

    config = SimpleNamespace(**VISION_CONFIG, rope_parameters={"rope_theta": 10000.0})
    with torch.device("meta"):
        tower = VisionTransformer(config)
    tower = tower.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    pixels, grid, prep = patches(size)
    pixels = pixels.to(device)
    seconds = []
    with torch.inference_mode():
        for i in range(images + 1):  # the first pays one-time costs
            t = time.perf_counter()
            tower(pixels, grid)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                seconds.append(time.perf_counter() - t)
    med = statistics.median(seconds)
    rows = grid[0] * grid[1] * grid[2] // 4
    print(
        f"tower: {size}x{size} px, grid {grid} ({rows} rows), {dtype}, {device}: median {1000 * med:.0f} ms "
        f"per image -> {1 / med:.2f} images/s ({images} timed); preprocessing {1000 * prep:.1f} ms"
    )


def bench_ttft(size: int, layers: int, text: int, dtype: str, repeats: int) -> None:
    from sonar.core.outputs import ScheduledRequest, SchedulerOutput
    from sonar.engine.config import EngineConfig
    from sonar.engine.runner import ModelRunner
    from sonar.multimodal.processor import expand_images
    from sonar.protocol.engine import ExecuteStep, NewRequestData, VisionInfo
    from sonar.sampling_params import SamplingParams

    folder = Path(tempfile.mkdtemp(prefix="qwen2_5_vl-dummy-"))
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "image_token_id": IMAGE_PAD,
        "vision_start_token_id": IMAGE_PAD - 3,
        "vision_end_token_id": IMAGE_PAD - 2,
        "video_token_id": IMAGE_PAD + 1,
        "tie_word_embeddings": True,
        "text_config": {**TEXT_CONFIG, "num_hidden_layers": layers},
        "vision_config": {**VISION_CONFIG, "model_type": "qwen2_5_vl"},
    }
    (folder / "config.json").write_text(json.dumps(config))
    runner = ModelRunner(EngineConfig.from_args(str(folder), dtype=dtype, load_format="dummy", max_model_len=4096))
    vision: VisionInfo = runner.info.vision
    pixels, grid, _ = patches(size)
    half = [100 + i for i in range(text // 2)]
    with_image, images = expand_images([*half, IMAGE_PAD, *half], vision, [(pixels, grid)])
    text_only = [100 + i % 1000 for i in range(len(with_image))]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    block = runner.config.block_size
    blocks = list(range(-(-len(with_image) // block)))
    step = 0

    def first_token(prompt: list[int], placed: list[Any]) -> float:
        nonlocal step
        rid = f"r{step}"
        req = ScheduledRequest(rid, prompt, 0, blocks, True, True, len(prompt))
        out = SchedulerOutput(step, [req], len(prompt), [], [])
        new = NewRequestData(rid, params, prompt, [], images=placed)
        t = time.perf_counter()
        runner.execute(ExecuteStep(out, [new]))
        seconds = time.perf_counter() - t
        step += 1
        runner.execute(ExecuteStep(SchedulerOutput(step, [], 0, [], [rid]), []))  # finish it
        step += 1
        return seconds

    first_token(text_only, [])  # warm-up
    image_s = statistics.median(first_token(with_image, images) for _ in range(repeats))
    text_s = statistics.median(first_token(text_only, []) for _ in range(repeats))
    print(
        f"ttft: Qwen2.5-VL-3B-shaped, {layers} decoder layers (of 36), {dtype}, {runner.device}: prompt of "
        f"{len(with_image)} tokens ({images[0].length} image rows, grid {grid}): {1000 * image_s:.0f} ms; the same "
        f"length as text alone: {1000 * text_s:.0f} ms (medians of {repeats})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sonar.bench.vision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=448, help="image side in pixels")
    ap.add_argument("--images", type=int, default=3, help="images timed through the tower")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the TTFT model")
    ap.add_argument("--text", type=int, default=64, help="text tokens around the image")
    ap.add_argument("--repeats", type=int, default=3, help="timed prompts of each kind")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-tower", action="store_true")
    ap.add_argument("--skip-ttft", action="store_true")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # on CPU the runner encodes in float32 (bf16 matmuls are slower there): time what it runs
    tower_dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    if not args.skip_tower:
        bench_tower(args.size, args.images, tower_dtype, device)
    if not args.skip_ttft:
        bench_ttft(args.size, args.layers, args.text, args.dtype, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
