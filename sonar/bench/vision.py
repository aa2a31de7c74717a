"""`python -m sonar.bench.vision`: images per second through a Qwen2.5-VL vision tower (or, with
``--tower qwen3_vl``, Qwen3-VL's), and the time to first token of an image prompt, on dummy
(random) weights.

**Tower**: Qwen2.5-VL's vision transformer with the 3B/7B checkpoints' vision config (32 blocks,
hidden 1280, 16 heads, MLP 3420, patches of 14 px merged 2x2, windows of 112 px, full attention
in blocks 7, 15, 23, 31), one ``--size`` x ``--size`` image at a time (448 px: 32 x 32 patches,
256 rows), as the runner encodes them. Prints the median seconds per image and images/s, and the
image processor's time for the same picture (resize, normalize, patchify). ``--tower qwen3_vl``:
transformers' default Qwen3-VL vision config (27 blocks, hidden 1152, 16 heads, MLP 4304, patches
of 16 px merged 2x2, a 48x48 learned position table, DeepStack after blocks 8, 16, 24; 448 px:
28 x 28 patches, 196 rows), its DeepStack rows included. ``--peer`` (Qwen2.5-VL only): transformers'
own tower with the same weights, timed alternately image by image, its output compared.

**TTFT**: a `ModelRunner` over a Qwen2.5-VL-shaped dummy checkpoint (the 3B's decoder widths:
hidden 2048, 16 heads, 2 KV heads, MLP 11008, vocabulary 151936, with ``--layers`` decoder layers
instead of 36) runs the whole prompt of one request, ``--text`` text tokens around one image, in
one step: the step's seconds are its time to first token (the tower's encoding included). The
same prompt with text tokens in place of the image's gives the decoder's share. ``--serve``: the
same checkpoint (with a word-level tokenizer) behind a real ``sonar serve`` (arguments after
``--`` go to it), timed per chat request with a PNG data URL and ``max_tokens`` 1.

usage: python -m sonar.bench.vision [--size 448] [--images 3] [--layers 4] [--text 64] [--dtype bfloat16]
       [--threads N] [--tower qwen2_5_vl|qwen3_vl] [--peer] [--serve] [--skip-tower] [--skip-ttft]
       [-- SERVER ARGS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from sonar.bench.launch import split_server_args

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

#: transformers' default Qwen3-VL vision config (its `Qwen3VLVisionConfig`).
QWEN3_VISION_CONFIG = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    in_channels=3,
    hidden_act="gelu_pytorch_tanh",
    out_hidden_size=3584,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
)


def picture(size: int, seed: int = 0) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")


def patches(size: int, patch: int = 14) -> tuple[torch.Tensor, list[int], float]:
    """A random ``size`` x ``size`` picture's patches and grid, and the processor's seconds for it."""
    from sonar.multimodal.processor import image_processor
    from sonar.protocol.engine import VisionInfo

    vision = VisionInfo(IMAGE_PAD, 0, 0, None, patch, 2, 2)
    processor = image_processor(vision, None, {"max_pixels": max(size * size, 56 * 56)})
    image = picture(size)
    processor.pixels(image)
    t = time.perf_counter()
    pixels, grid = processor.pixels(image)
    return pixels, grid, time.perf_counter() - t


def random_tower(family: str, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    """Sonar's tower of `family` on dummy weights (norms near 1, the rest small), and its config."""
    from sonar.models import qwen2_vl, qwen3_vl

    if family == "qwen3_vl":
        config = SimpleNamespace(**QWEN3_VISION_CONFIG)
        make: Any = qwen3_vl.VisionTransformer
    else:
        config = SimpleNamespace(**VISION_CONFIG, rope_parameters={"rope_theta": 10000.0})
        make = qwen2_vl.VisionTransformer
    with torch.device("meta"):
        tower = make(config)
    tower = tower.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    return tower, config


def transformers_tower(ours: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> Any:
    """transformers' own Qwen2.5-VL vision tower (SDPA attention) with `ours`'s weights: the peer."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLVisionConfig(**VISION_CONFIG)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        peer = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=dtype)
    peer = peer.to_empty(device=device)
    peer.load_state_dict(ours.state_dict(), strict=False)  # ours has no buffers transformers lacks
    # transformers' rotary tables are non-persistent buffers: to_empty left them uninitialised
    rotary = peer.rotary_pos_emb
    inv_freq, _ = rotary.compute_axial_rope_parameters(config)
    rotary.inv_freq.copy_(inv_freq)
    rotary.original_inv_freq.copy_(inv_freq)
    return peer.eval()


def bench_tower(
    size: int, images: int, dtype: torch.dtype, device: torch.device, family: str = "qwen2_5_vl", peer: bool = False
) -> None:
    tower, config = random_tower(family, dtype, device)
    pixels, grid, prep = patches(size, config.patch_size)
    pixels = pixels.to(device)
    towers: dict[str, Any] = {"sonar": lambda: tower(pixels, grid)}
    if peer:
        hf = transformers_tower(tower, dtype, device)
        thw = torch.tensor([grid], device=device)
        towers["transformers"] = lambda: hf(pixels, grid_thw=thw)
        with torch.inference_mode():
            ref = hf(pixels, grid_thw=thw)
            ref = getattr(ref, "pooler_output", ref)
            gap = (tower(pixels, grid) - ref).abs().max().item()
        print(f"sonar vs transformers tower on the same weights: max |difference| {gap:.2e}")
    seconds: dict[str, list[float]] = {name: [] for name in towers}
    with torch.inference_mode():
        for i in range(images + 1):  # the first pays one-time costs; the towers alternate image by image
            for name, run in towers.items():
                t = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i:
                    seconds[name].append(time.perf_counter() - t)
    rows = grid[0] * grid[1] * grid[2] // 4
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    for name, med in medians.items():
        print(
            f"tower ({family}, {name}): {size}x{size} px, grid {grid} ({rows} rows), {dtype}, {device}: median "
            f"{1000 * med:.0f} ms per image -> {1 / med:.3f} images/s ({images} timed: "
            f"{', '.join(f'{1000 * x:.0f}' for x in seconds[name])} ms); preprocessing {1000 * prep:.1f} ms"
        )
    if peer:
        print(f"tower speed sonar / transformers: {medians['transformers'] / medians['sonar']:.2f}x")


def dummy_checkpoint(layers: int, tokenizer: bool = False) -> Path:
    """A folder with the config of a Qwen2.5-VL-3B-shaped model of `layers` decoder layers (served
    with ``--load-format dummy``); `tokenizer`: also a word-level tokenizer (token ``i`` is
    ``w<i>``, the vision tokens at their Qwen2.5-VL ids) and a chat template, for a server."""
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
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        special = {IMAGE_PAD - 3: "<|vision_start|>", IMAGE_PAD - 2: "<|vision_end|>", IMAGE_PAD: "<|image_pad|>"}
        vocab = {special.get(i, f"w{i}"): i for i in range(TEXT_CONFIG["vocab_size"])}
        backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token="w0")
        tok.add_special_tokens({"additional_special_tokens": list(special.values())})
        # the server puts the image's text (IMAGE_TEXT) where an image part was in the content
        tok.chat_template = "{% for m in messages %}w1 {{ m.content }} w2 {% endfor %}w4"
        tok.save_pretrained(str(folder))
    return folder


def bench_serve(size: int, layers: int, text: int, dtype: str, repeats: int, server_args: list[str]) -> None:
    """TTFT through a real ``sonar serve``: a chat of `text` words and one new ``size`` px picture
    (a PNG data URL), ``max_tokens`` 1, one request at a time, after a first picture that pays the
    one-time costs; then the same picture again (its blocks hit the prefix cache) and a text-only
    chat."""
    import base64
    import io

    import httpx

    from sonar.bench.launch import launch, stop

    folder = dummy_checkpoint(layers, tokenizer=True)
    args = [str(folder), "--load-format", "dummy", "--dtype", dtype, "--max-model-len", "4096", *server_args]
    server = launch(args, folder / "logs", timeout=1800.0)
    words = " ".join(f"w{100 + i}" for i in range(text))

    def ask(seed: int | None) -> float:
        content: list[dict[str, Any]] = [{"type": "text", "text": words}]
        if seed is not None:
            buf = io.BytesIO()
            picture(size, seed).save(buf, "PNG")
            url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            content.insert(0, {"type": "image_url", "image_url": {"url": url}})
        body = {"model": str(folder), "messages": [{"role": "user", "content": content}], "max_tokens": 1}
        t = time.perf_counter()
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=3600.0)
        seconds = time.perf_counter() - t
        reply.raise_for_status()
        print(
            f"  {'image ' + str(seed) if seed is not None else 'text only'}: {1000 * seconds:.0f} ms, "
            f"{reply.json()['usage']['prompt_tokens']} prompt tokens",
            flush=True,
        )
        return seconds

    try:
        print(f"serve: ready in {server.ready_seconds:.1f} s ({' '.join(server.argv[3:])})", flush=True)
        first = ask(0)  # the first image also pays one-time costs (the tower's kernels' first calls)
        cold = [ask(seed) for seed in range(1, repeats + 1)]
        again = ask(1)
        plain = ask(None)
    finally:
        stop(server)
    print(
        f"ttft (sonar serve): Qwen2.5-VL-3B-shaped, {layers} decoder layers (of 36), {dtype}: a new {size}x{size} "
        f"picture + {text} words: median {1000 * statistics.median(cold):.0f} ms of {repeats}; the same picture "
        f"again (prefix cache): {1000 * again:.0f} ms; text only: {1000 * plain:.0f} ms; the first picture after "
        f"start: {1000 * first:.0f} ms"
    )


def bench_ttft(size: int, layers: int, text: int, dtype: str, repeats: int) -> None:
    from sonar.core.outputs import ScheduledRequest, SchedulerOutput
    from sonar.engine.config import EngineConfig
    from sonar.engine.runner import ModelRunner
    from sonar.multimodal.processor import expand_images
    from sonar.protocol.engine import ExecuteStep, NewRequestData, VisionInfo
    from sonar.sampling_params import SamplingParams

    folder = dummy_checkpoint(layers)
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
        # Every repeat encodes its image: the runner's encoder cache would otherwise answer the
        # second and later ones with the first one's rows (the same picture each time).
        runner.encoder_cache.clear()
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
    ap.add_argument("--tower", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl"], help="whose vision tower")
    ap.add_argument("--peer", action="store_true", help="also time transformers' Qwen2.5-VL tower, alternating")
    ap.add_argument("--serve", action="store_true", help="time TTFT through a real `sonar serve` instead")
    ap.add_argument("--skip-tower", action="store_true")
    ap.add_argument("--skip-ttft", action="store_true")
    own, server_args = split_server_args(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(own)
    if args.peer and args.tower != "qwen2_5_vl":
        ap.error("--peer compares with transformers' Qwen2.5-VL tower only (--tower qwen2_5_vl)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # on CPU the runner encodes in float32 (bf16 matmuls are slower there): time what it runs
    tower_dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    if not args.skip_tower:
        bench_tower(args.size, args.images, tower_dtype, device, args.tower, args.peer)
    if not args.skip_ttft and args.serve:
        bench_serve(args.size, args.layers, args.text, args.dtype, args.repeats, server_args)
    elif not args.skip_ttft:
        bench_ttft(args.size, args.layers, args.text, args.dtype, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
