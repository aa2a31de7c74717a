"""LLaVA against transformers: the same tiny random checkpoint, the same pixels, the same prompt
(expanded as transformers' `LlavaProcessor` expands it); every prompt position's logits and the
greedy tokens after it equal transformers', with the prompt prefilled in chunks that cut through
the images' tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
from sonar.models.loader import load_model
from sonar.multimodal.processor import ImageProcessor, expand_images
from sonar.protocol.engine import ImageInput, VisionInfo
from tests.models.against import ATOL, RTOL, transformers_greedy
from tests.multimodal.tiny_llava import IMAGE_SIZE, IMAGE_TOKEN_ID, PATCH, random_image, save_tiny_llava

BLOCK = 4

VARIANTS = {
    # LLaVA 1.5: the second-to-last layer, the class token dropped
    "default": dict(strategy="default", feature_layer=-2),
    # the class token kept, two layers' states side by side (the embeddings' and the last's)
    "full-multilayer": dict(strategy="full", feature_layer=[0, -1]),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    path = tmp_path_factory.mktemp(f"llava-{request.param}")
    hf = save_tiny_llava(path, seed=len(request.param), **VARIANTS[request.param])
    return path, hf, load_model(str(path), dtype="float32").model


def _prompt(path: Path, model: Any, images: list[Any]) -> tuple[list[int], list[ImageInput]]:
    vision = VisionInfo(IMAGE_TOKEN_ID, model.tokens_per_image, IMAGE_SIZE)
    processor = ImageProcessor(vision, path, None)
    ids = [5, 6, IMAGE_TOKEN_ID, 7, 8, 9]
    if len(images) > 1:
        ids += [10, IMAGE_TOKEN_ID, 11]
    return expand_images(ids, vision, [processor.pixels(im) for im in images])


@torch.inference_mode()
def sonar_greedy(model: Any, prompt: list[int], images: list[ImageInput], chunk: int, n: int) -> tuple[Any, Any]:
    """Prefill in chunks of `chunk` tokens over a shuffled paged cache, then `n` greedy tokens:
    (the prompt positions' logits, the tokens and their logits). An image with a grid (LLaVA-NeXT's
    original size) goes through `encode_grid`, as the runner sends it."""
    caches = allocate_kv_caches(model.num_layers, 64, BLOCK, model.num_kv_heads, model.head_dim, torch.float32)
    for cache in caches:
        cache.fill_(float("nan"))
    blocks = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    features = {
        i: model.encode_images(im.pixel_values.unsqueeze(0))[0]
        if im.grid is None
        else model.encode_grid(im.pixel_values, im.grid)
        for i, im in enumerate(images)
    }
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
        ids, positions = torch.tensor(tokens[start : start + size]), torch.arange(start, start + size)
        if rows:
            hidden = model.forward_rows(ids, positions, caches, meta, torch.tensor(rows), torch.cat(embeds))
        else:
            hidden = model(ids, positions, caches, meta)
        logits = model.compute_logits(hidden)
        computed += size
        if start < len(prompt):
            prompt_logits.append(logits)
        if computed >= len(prompt):
            out_logits.append(logits[-1])
            out.append(int(logits[-1].argmax()))
            tokens.append(out[-1])
    return torch.cat(prompt_logits), (out, torch.stack(out_logits))


def test_expansion_matches_llava_processor(tiny: tuple[Path, Any, Any]) -> None:
    from transformers import AutoTokenizer, CLIPImageProcessorPil, LlavaProcessor

    path, hf, model = tiny
    tok = AutoTokenizer.from_pretrained(str(path))
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil.from_pretrained(str(path)),
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy=hf.config.vision_feature_select_strategy,
        num_additional_image_tokens=1,
        image_token="<image>",
    )
    image = random_image(1)
    ref = processor(text="w5 <image> w7", images=[image], return_tensors="pt")
    ids, images = expand_images(tok("w5 <image> w7").input_ids, model_vision(model), [_pixels(path, model, image)])
    assert ids == ref["input_ids"][0].tolist()
    torch.testing.assert_close(images[0].pixel_values, ref["pixel_values"][0])


def model_vision(model: Any) -> VisionInfo:
    return VisionInfo(model.image_token_id, model.tokens_per_image, model.image_size)


def _pixels(path: Path, model: Any, image: Any) -> torch.Tensor:
    return ImageProcessor(model_vision(model), path, None).pixels(image)


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_and_greedy_tokens_equal_transformers(tiny: tuple[Path, Any, Any], num_images: int) -> None:
    path, hf, model = tiny
    prompt, images = _prompt(path, model, [random_image(i) for i in range(num_images)])
    pixels = torch.stack([im.pixel_values for im in images])
    with torch.inference_mode():
        full = hf(input_ids=torch.tensor([prompt]), pixel_values=pixels).logits[0]
        ref = hf.generate(
            torch.tensor([prompt]),
            pixel_values=pixels,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=4,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ref_tokens, ref_logits = ref.sequences[0, len(prompt) :].tolist(), torch.cat(ref.logits).float()
    for chunk in (len(prompt), 5):  # whole, and in chunks that cut through the images' tokens
        prompt_logits, (tokens, logits) = sonar_greedy(model, prompt, images, chunk, 4)
        torch.testing.assert_close(prompt_logits, full.float(), atol=ATOL, rtol=RTOL)
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=RTOL)


def test_a_different_image_gives_different_logits(tiny: tuple[Path, Any, Any]) -> None:
    """The image reaches the language model (not only its placeholder tokens)."""
    path, _, model = tiny
    a_prompt, a = _prompt(path, model, [random_image(0)])
    b_prompt, b = _prompt(path, model, [random_image(1)])
    assert a_prompt == b_prompt and a[0].hash != b[0].hash
    logits_a, _ = sonar_greedy(model, a_prompt, a, len(a_prompt), 1)
    logits_b, _ = sonar_greedy(model, b_prompt, b, len(b_prompt), 1)
    assert not torch.allclose(logits_a[-1], logits_b[-1])


def test_text_only_prompt_equals_transformers(tiny: tuple[Path, Any, Any]) -> None:
    _, hf, model = tiny
    prompt = [5, 6, 7, 8, 9]
    tokens, logits = transformers_greedy(hf, prompt, 3)
    _, (ours, our_logits) = sonar_greedy(model, prompt, [], 3, 3)
    assert ours == tokens
    torch.testing.assert_close(our_logits, logits, atol=ATOL, rtol=RTOL)


def test_bfloat16_on_cpu_runs_the_tower_in_float32(tiny: tuple[Path, Any, Any]) -> None:
    path, _, model = tiny
    bf16 = load_model(str(path), dtype="bfloat16").model
    pixels = _pixels(path, model, random_image(9)).unsqueeze(0)
    with torch.inference_mode():
        ours, ref = bf16.encode_images(pixels), model.encode_images(pixels)
    assert ours.dtype == torch.bfloat16 and bf16.vision_tower.pre_layrnorm.weight.dtype == torch.float32
    torch.testing.assert_close(ours.float(), ref, atol=0.1, rtol=0.05)
