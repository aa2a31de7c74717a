"""Qwen2.5-VL, Qwen2-VL, Qwen3-VL and Qwen3-VL MoE against transformers: the same tiny random checkpoint, the same
patches, the same prompt (expanded as transformers' `Qwen2_5_VLProcessor` expands it); every prompt
position's logits and the greedy tokens after it equal transformers', with the prompt prefilled
whole and in chunks that cut through the images' tokens (Qwen3-VL: and so through the DeepStack
rows added to the first layers; MoE: routed through sparse and dense layers), and decode
continuing at the M-RoPE positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
from sonar.models.loader import load_model
from sonar.multimodal.processor import expand_images, image_processor
from sonar.protocol.engine import ImageInput
from tests.models.against import ATOL, RTOL, transformers_greedy
from tests.multimodal.tiny_llava import random_image
from tests.multimodal.tiny_qwen2_vl import IMAGE_PAD, VISION_END, VISION_START, save_tiny_qwen2_5_vl

BLOCK = 4
#: Sizes (width, height) whose grids differ (24x16 px: 4x6 patches) and whose windows
#: split a side (a window is 2x2 merged blocks).
SIZES = [(24, 16), (28, 36), (40, 40)]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_qwen2_5_vl(path, seed=3, family=request.param)
    return path, hf, load_model(str(path), dtype="float32").model


def _prompt(path: Path, model: Any, images: list[Any]) -> tuple[list[int], list[ImageInput]]:
    vision = model.vision_info()
    processor = image_processor(vision, path, None)
    ids = [5, 6, VISION_START, IMAGE_PAD, VISION_END, 7, 8, 9]
    if len(images) > 1:
        ids += [10, VISION_START, IMAGE_PAD, VISION_END, 11]
    return expand_images(ids, vision, [processor.pixels(im) for im in images])


def _positions(model: Any, prompt: list[int], images: list[ImageInput], start: int, size: int) -> torch.Tensor:
    table, delta = model.rope_index(len(prompt), images)
    inside = table[:, start : min(start + size, len(prompt))]
    after = torch.arange(max(start, len(prompt)), max(start + size, len(prompt))).expand(3, -1) + delta
    return torch.cat((inside, after), dim=1)


@torch.inference_mode()
def _sonar_greedy(model: Any, prompt: list[int], images: list[ImageInput], chunk: int, n: int) -> tuple[Any, Any]:
    """Prefill in chunks of `chunk` tokens over a shuffled paged cache, then `n` greedy tokens with
    1D positions shifted by the request's delta: (the prompt positions' logits, the tokens and their logits)."""
    caches = allocate_kv_caches(model.num_layers, 64, BLOCK, model.num_kv_heads, model.head_dim, torch.float32)
    for cache in caches:
        cache.fill_(float("nan"))
    blocks = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    features = {i: model.encode_grid(im.pixel_values, im.grid) for i, im in enumerate(images)}
    tokens, computed, prompt_logits, out, out_logits = list(prompt), 0, [], [], []
    while len(out) < n:
        start = computed
        size = min(chunk, len(prompt) - start) if start < len(prompt) else 1
        rows, embeds = [], []
        for i, im in enumerate(images):
            lo, hi = max(start, im.offset), min(start + size, im.offset + im.length)
            if lo < hi:
                rows += range(lo - start, hi - start)
                embeds.append(features[i][lo - im.offset : hi - im.offset])
        meta = AttentionMetadata.build([size], [start + size], [blocks], BLOCK)
        ids = torch.tensor(tokens[start : start + size])
        positions = _positions(model, prompt, images, start, size)
        if rows:
            hidden = model.forward_rows(ids, positions, caches, meta, torch.tensor(rows), torch.cat(embeds))
        else:  # text rows: the three positions agree, the ordinary 1D path serves them
            assert bool((positions == positions[0]).all())
            hidden = model(ids, positions[0], caches, meta)
        logits = model.compute_logits(hidden)
        computed += size
        if start < len(prompt):
            prompt_logits.append(logits)
        if computed >= len(prompt):
            out_logits.append(logits[-1])
            out.append(int(logits[-1].argmax()))
            tokens.append(out[-1])
    return torch.cat(prompt_logits), (out, torch.stack(out_logits))


def test_expansion_and_positions_match_qwen_processor(tiny: tuple[Path, Any, Any]) -> None:
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    path, hf, model = tiny
    tok = AutoTokenizer.from_pretrained(str(path))

    class ImagesOnly(Qwen2_5_VLProcessor):
        """Without a video processor: transformers' needs torchvision, which Sonar does not install."""

        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            return None if name == "video_processor" else super().check_argument_for_proper_class(name, arg)

    processor = ImagesOnly(image_processor=Qwen2VLImageProcessorPil.from_pretrained(str(path)), tokenizer=tok)
    pictures = [random_image(1, SIZES[0]), random_image(2, SIZES[1])]
    text = "w5 <|vision_start|><|image_pad|><|vision_end|> w7 <|vision_start|><|image_pad|><|vision_end|> w8"
    ref = processor(text=text, images=pictures, return_tensors="pt")
    pixels = [image_processor(model.vision_info(), path, None).pixels(p) for p in pictures]
    ids, images = expand_images(tok(text).input_ids, model.vision_info(), pixels)
    assert ids == ref["input_ids"][0].tolist()
    assert [im.grid for im in images] == ref["image_grid_thw"].tolist()
    torch.testing.assert_close(torch.cat([im.pixel_values for im in images]), ref["pixel_values"])
    ref_positions, ref_delta = hf.model.get_rope_index(
        ref["input_ids"], ref["mm_token_type_ids"], image_grid_thw=ref["image_grid_thw"]
    )
    table, delta = model.rope_index(len(ids), images)
    assert table.tolist() == ref_positions[:, 0].tolist() and delta == int(ref_delta)


@pytest.mark.parametrize("sizes", [SIZES[:1], SIZES[1:]], ids=["one-image", "two-images"])
def test_logits_and_greedy_tokens_equal_transformers(tiny: tuple[Path, Any, Any], sizes: list[Any]) -> None:
    path, hf, model = tiny
    prompt, images = _prompt(path, model, [random_image(i, size) for i, size in enumerate(sizes)])
    pixels = torch.cat([im.pixel_values for im in images])
    grids = torch.tensor([im.grid for im in images])
    types = torch.tensor([[int(t == IMAGE_PAD) for t in prompt]])
    with torch.inference_mode():
        full = hf(input_ids=torch.tensor([prompt]), pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=types)
        ref = hf.generate(
            torch.tensor([prompt]),
            pixel_values=pixels,
            image_grid_thw=grids,
            mm_token_type_ids=types,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=5,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ref_tokens, ref_logits = ref.sequences[0, len(prompt) :].tolist(), torch.cat(ref.logits).float()
    assert model.rope_index(len(prompt), images)[1] != 0  # decode positions really move
    for chunk in (len(prompt), 5):  # whole, and in chunks that cut through the images' tokens
        prompt_logits, (tokens, logits) = _sonar_greedy(model, prompt, images, chunk, 5)
        torch.testing.assert_close(prompt_logits, full.logits[0].float(), atol=ATOL, rtol=RTOL)
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("size", [(40, 40), (56, 24)], ids=["square", "wide"])
def test_vision_tower_equals_transformers(tiny: tuple[Path, Any, Any], size: tuple[int, int]) -> None:
    """Qwen2.5-VL: windows that split the grid unevenly (5x5 merged blocks in windows of 2x2), and a
    full-attention block. Qwen3-VL: its 4x4 position table resampled to grids of other shapes, and
    the DeepStack rows beside the merger's."""
    path, hf, model = tiny
    _, images = _prompt(path, model, [random_image(4, size)])
    image = images[0]
    assert image.grid == [1, size[1] // 4, size[0] // 4]
    with torch.inference_mode():
        ours = model.encode_grid(image.pixel_values, image.grid)
        out = hf.model.visual(image.pixel_values, grid_thw=torch.tensor([image.grid]))
    ref = torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])], dim=-1)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


def test_text_only_prompt_equals_transformers(tiny: tuple[Path, Any, Any]) -> None:
    _, hf, model = tiny
    prompt = [5, 6, 7, 8, 9]
    tokens, logits = transformers_greedy(hf, prompt, 3)
    _, (ours, our_logits) = _sonar_greedy(model, prompt, [], 3, 3)
    assert ours == tokens
    torch.testing.assert_close(our_logits, logits, atol=ATOL, rtol=RTOL)


def test_mrope_with_three_equal_positions_is_plain_rope(tiny: tuple[Path, Any, Any]) -> None:
    """Why text rows may take 1D positions: each section then turns by the same position."""
    _, _, model = tiny
    positions = torch.tensor([0, 3, 17, 250])
    plain = model.rotary.cos_sin(positions, torch.float32)
    three = model.rotary.cos_sin(positions.expand(3, -1), torch.float32)
    for a, b in zip(plain, three):
        assert torch.equal(a, b)


def test_bfloat16_on_cpu_runs_the_tower_in_float32(tiny: tuple[Path, Any, Any]) -> None:
    path, _, model = tiny
    bf16 = load_model(str(path), dtype="bfloat16").model
    _, images = _prompt(path, model, [random_image(9, SIZES[1])])
    with torch.inference_mode():
        ours = bf16.encode_grid(images[0].pixel_values, images[0].grid)
        ref = model.encode_grid(images[0].pixel_values, images[0].grid)
    assert ours.dtype == torch.bfloat16
    assert {p.dtype for p in bf16.visual.parameters()} == {torch.float32}
    torch.testing.assert_close(ours.float(), ref, atol=0.1, rtol=0.05)


def test_qwen3_vl_refuses_pipeline_parallelism_by_name() -> None:
    from sonar.models.errors import ModelLoadError
    from sonar.models.parallel import PipelineStage
    from sonar.models.qwen3_vl import Qwen3VLForConditionalGeneration
    from tests.multimodal.tiny_qwen2_vl import qwen3_vl_config

    config = qwen3_vl_config()
    Qwen3VLForConditionalGeneration.prepare_config(config)
    with pytest.raises(ModelLoadError, match="pipeline parallelism.*DeepStack"):
        Qwen3VLForConditionalGeneration(config, stage=PipelineStage(index=0, size=2).resolve(3))


@pytest.mark.parametrize("lengths", [[16, 16, 16], [16, 8, 16, 8, 4, 12], [36]], ids=["equal", "uneven", "one-frame"])
def test_batched_window_attention_equals_attention_masked_to_each_window(lengths: list[int]) -> None:
    """`window_attention` batches the windows of each length; it must equal plain softmax attention
    over the whole sequence with every row masked to its own window (uneven: a frame's inner,
    edge and corner windows interleaved, as `window_index` orders them)."""
    from sonar.models.qwen2_vl import window_attention

    n, heads, dim = sum(lengths), 3, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, heads, dim, generator=gen) for _ in range(3))
    window = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    scores = torch.einsum("qhd,khd->hqk", q, k) / dim**0.5
    scores = scores.masked_fill(window[:, None] != window[None, :], float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    torch.testing.assert_close(window_attention(q, k, v, lengths), ref, atol=1e-4, rtol=1e-4)
