"""Gemma 3 with images against transformers: the same tiny random checkpoint, the same pixels,
the same prompt (expanded as transformers' `Gemma3Processor` expands it); every prompt position's
logits and the greedy tokens after it equal transformers', whose image tokens attend to each
other in prefill (``token_type_ids``) — through sliding layers narrower than an image — with the
prompt whole and in chunks that end only between images (as the scheduler cuts), over a prefix
that ends inside an image, and next to another sequence in the same step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
from sonar.models.errors import ModelLoadError
from sonar.models.gemma3_vl import ImageBlocks, _image_mask
from sonar.models.loader import load_model
from sonar.multimodal.gemma3 import Gemma3ImageProcessor
from sonar.multimodal.processor import expand_images
from sonar.protocol.engine import ImageInput
from tests.models.against import ATOL, RTOL
from tests.multimodal.tiny_gemma3 import BOI, EOI, IMAGE_TOKEN, TOKENS_PER_IMAGE, save_tiny_gemma3
from tests.multimodal.tiny_llava import random_image

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    path = tmp_path_factory.mktemp("gemma3-vl")
    hf = save_tiny_gemma3(path, seed=3)
    return path, hf, load_model(str(path), dtype="float32").model


def _prompt(path: Path, model: Any, images: list[Any]) -> tuple[list[int], list[ImageInput]]:
    vision = model.vision_info()
    processor = Gemma3ImageProcessor(vision, path, None)
    ids = [5, 6, BOI, IMAGE_TOKEN, EOI, 7, 8, 9]
    if len(images) > 1:
        ids += [10, BOI, IMAGE_TOKEN, EOI, 11]
    return expand_images(ids, vision, [processor.pixels(im) for im in images])


@torch.inference_mode()
def _sonar_greedy(
    model: Any, prompt: list[int], images: list[ImageInput], cuts: list[int], n: int, cached: int = 0
) -> tuple[Any, Any]:
    """Prefill ending steps at `cuts` (then the prompt's end) over a shuffled paged cache — the
    first `cached` positions computed by a whole prefill before, as a prefix-cache hit finds
    them — then `n` greedy tokens: (the logits of the prompt positions computed, the tokens and
    their logits)."""
    caches = allocate_kv_caches(model.num_layers, 64, BLOCK, model.num_kv_heads, model.head_dim, torch.float32)
    for cache in caches:
        cache.fill_(float("nan"))
    blocks = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    if cached:
        _step(model, prompt, images, blocks, caches, 0, len(prompt))
    ends = [c for c in cuts if cached < c < len(prompt)] + [len(prompt)]
    tokens, computed, prompt_logits, out, out_logits = list(prompt), cached, [], [], []
    while len(out) < n:
        start = computed
        end = ends.pop(0) if start < len(prompt) else start + 1
        logits = model.compute_logits(_step(model, tokens, images, blocks, caches, start, end))
        computed = end
        if start < len(prompt):
            prompt_logits.append(logits)
        if computed >= len(prompt):
            out_logits.append(logits[-1])
            out.append(int(logits[-1].argmax()))
            tokens.append(out[-1])
    return torch.cat(prompt_logits), (out, torch.stack(out_logits))


def _step(
    model: Any, tokens: list[int], images: list[ImageInput], blocks: list[int], caches: Any, start: int, end: int
):
    rows, embeds = [], []
    for im in images:
        lo, hi = max(start, im.offset), min(end, im.offset + im.length)
        if lo < hi:
            features = model.encode_images(im.pixel_values.unsqueeze(0))[0]
            rows += range(lo - start, hi - start)
            embeds.append(features[lo - im.offset : hi - im.offset])
    meta = AttentionMetadata.build([end - start], [end], [blocks], BLOCK)
    ids, positions = torch.tensor(tokens[start:end]), torch.arange(start, end)
    if rows:
        return model.forward_rows(ids, positions, caches, meta, torch.tensor(rows), torch.cat(embeds))
    return model(ids, positions, caches, meta)


def _transformers(hf: Any, prompt: list[int], images: list[ImageInput], n: int) -> tuple[Any, list[int], Any]:
    pixels = torch.stack([im.pixel_values for im in images])
    types = torch.tensor([[int(t == IMAGE_TOKEN) for t in prompt]])
    with torch.inference_mode():
        full = hf(input_ids=torch.tensor([prompt]), pixel_values=pixels, token_type_ids=types).logits[0]
        ref = hf.generate(
            torch.tensor([prompt]),
            pixel_values=pixels,
            token_type_ids=types,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return full.float(), ref.sequences[0, len(prompt) :].tolist(), torch.cat(ref.logits).float()


def test_image_rows_equal_transformers_image_features(tiny: tuple[Path, Any, Any]) -> None:
    path, hf, model = tiny
    _, images = _prompt(path, model, [random_image(4)])
    pixels = images[0].pixel_values.unsqueeze(0)
    with torch.inference_mode():
        ref = hf.model.get_image_features(pixel_values=pixels).pooler_output
        ours = model.encode_images(pixels)
    assert ours.shape == (1, TOKENS_PER_IMAGE, 64)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_and_greedy_tokens_equal_transformers(tiny: tuple[Path, Any, Any], num_images: int) -> None:
    path, hf, model = tiny
    prompt, images = _prompt(path, model, [random_image(i) for i in range(num_images)])
    full, ref_tokens, ref_logits = _transformers(hf, prompt, images, 4)
    between = [images[0].offset - 1, images[0].offset + images[0].length + 2]  # chunks end only between images
    for cuts in ([], between):
        prompt_logits, (tokens, logits) = _sonar_greedy(model, prompt, images, cuts, 4)
        torch.testing.assert_close(prompt_logits, full, atol=ATOL, rtol=RTOL)
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=RTOL)


def test_a_prefix_hit_inside_an_image_equals_transformers(tiny: tuple[Path, Any, Any]) -> None:
    path, hf, model = tiny
    prompt, images = _prompt(path, model, [random_image(7)])
    full, ref_tokens, ref_logits = _transformers(hf, prompt, images, 3)
    cached = images[0].offset + 8  # whole blocks, ending halfway through the image
    prompt_logits, (tokens, logits) = _sonar_greedy(model, prompt, images, [], 3, cached=cached)
    torch.testing.assert_close(prompt_logits, full[cached:], atol=ATOL, rtol=RTOL)
    assert tokens == ref_tokens


def test_causal_attention_would_differ(tiny: tuple[Path, Any, Any]) -> None:
    """The image tokens' mutual attention changes the logits here: the test above would catch a
    model that served causal attention instead."""
    path, hf, model = tiny
    prompt, images = _prompt(path, model, [random_image(0)])
    pixels = torch.stack([im.pixel_values for im in images])
    with torch.inference_mode():
        causal = hf(input_ids=torch.tensor([prompt]), pixel_values=pixels).logits[0]
    full, _, _ = _transformers(hf, prompt, images, 1)
    assert not torch.allclose(causal[-1], full[-1], atol=1e-3)


def test_image_blocks_are_runs_of_each_sequence() -> None:
    t = IMAGE_TOKEN
    ids = torch.tensor([1, t, t, t, 2, t, 3, t, t, t, t, 4])  # seq 0: 6 rows, seq 1: 6 rows
    meta = AttentionMetadata.build([6, 6], [6, 10], [[0, 1], [2, 3, 4]], BLOCK)
    blocks = ImageBlocks.of_step(ids, meta, t)
    assert blocks is not None and blocks.runs == (((0, ((1, 4),)), (1, ((1, 5),))))
    assert ImageBlocks.of_step(torch.tensor([1, t, 2]), AttentionMetadata.build([3], [3], [[0]], BLOCK), t) is None
    mask = _image_mask(3, 5, [(0, 2)], 2, torch.device("cpu"))  # positions 2..4 query; 2 and 3 one run
    assert mask.tolist() == [
        [False, True, True, True, False],
        [False, False, True, True, False],
        [False, False, False, True, True],
    ]


def test_a_pooling_head_is_refused(tmp_path: Path) -> None:
    from tests.multimodal.tiny_gemma3 import gemma3_config

    config = gemma3_config()
    config.vision_config.vision_use_head = True
    from sonar.models.gemma3_vl import Gemma3ForConditionalGeneration

    with pytest.raises(ModelLoadError, match="vision_use_head"):
        Gemma3ForConditionalGeneration(config)


def test_bfloat16_on_cpu_runs_the_tower_in_float32(tiny: tuple[Path, Any, Any]) -> None:
    path, _, model = tiny
    bf16 = load_model(str(path), dtype="bfloat16").model
    _, images = _prompt(path, model, [random_image(9)])
    pixels = images[0].pixel_values.unsqueeze(0)
    with torch.inference_mode():
        ours, ref = bf16.encode_images(pixels), model.encode_images(pixels)
    assert ours.dtype == torch.bfloat16 and bf16.vision_tower.post_layernorm.weight.dtype == torch.float32
    torch.testing.assert_close(ours.float(), ref, atol=0.1, rtol=0.05)


def test_an_image_prompt_next_to_another_sequence_in_one_step(tiny: tuple[Path, Any, Any]) -> None:
    """A text prompt and an image prompt prefilled in one step: each sequence's rows equal
    transformers' for that prompt alone (the image mask is per sequence)."""
    path, hf, model = tiny
    text = [12, 13, IMAGE_TOKEN - 1, 14, 15, 16]
    prompt, images = _prompt(path, model, [random_image(5)])
    full, _, _ = _transformers(hf, prompt, images, 1)
    with torch.inference_mode():
        text_ref = hf(input_ids=torch.tensor([text])).logits[0].float()
        caches = allocate_kv_caches(model.num_layers, 64, BLOCK, model.num_kv_heads, model.head_dim, torch.float32)
        blocks = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
        a, b = blocks[:2], blocks[2:12]
        meta = AttentionMetadata.build([len(text), len(prompt)], [len(text), len(prompt)], [a, b], BLOCK)
        ids = torch.tensor(text + prompt)
        positions = torch.cat([torch.arange(len(text)), torch.arange(len(prompt))])
        rows = torch.arange(images[0].offset, images[0].offset + images[0].length) + len(text)
        features = model.encode_images(images[0].pixel_values.unsqueeze(0))[0]
        logits = model.compute_logits(model.forward_rows(ids, positions, caches, meta, rows, features))
    torch.testing.assert_close(logits[: len(text)], text_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[len(text) :], full, atol=ATOL, rtol=RTOL)
