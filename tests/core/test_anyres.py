"""The any-resolution layout against transformers' own helpers (the best-fit resolution, the
tile count, the unpadding), for pictures of many shapes, and the pinpoints check."""

from __future__ import annotations

import torch

from sonar.core.anyres import best_resolution, check_pinpoints, feature_rows, num_tiles, unpadded

PINPOINTS = [[16, 32], [32, 16], [32, 32]]
TILE = 16


def test_layout_matches_transformers_helpers() -> None:
    from transformers.image_processing_utils import select_best_resolution
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches, unpad_image

    for size in [(20, 40), (30, 18), (17, 33), (16, 16), (23, 50), (1000, 7), (7, 1000), (33, 31)]:
        assert best_resolution(size, PINPOINTS) == tuple(select_best_resolution(size, PINPOINTS))
        assert num_tiles(size, PINPOINTS, TILE) == image_size_to_num_patches(size, PINPOINTS, TILE)
        for map_size in [(4, 8), (8, 4), (8, 8)]:
            top, h, w = unpadded(size, map_size)
            assert (h, w) == tuple(unpad_image(torch.zeros(1, *map_size), list(size)).shape[1:])


def test_feature_rows_count_base_map_and_newlines() -> None:
    # 20x40 (h x w) fits 16x32: tiles 1x2, a 4x8 map with nothing cut, each line with its newline
    assert feature_rows((20, 40), PINPOINTS, TILE, 4) == 16 + 4 * 9
    # 30x18 keeps most pixels in 32x32: an 8x8 map whose picture covers 18 * 8 / 30 = 4.8
    # columns, truncated to 4 as transformers does: two columns of padding cut at each side
    assert best_resolution((30, 18), PINPOINTS) == (32, 32)
    assert unpadded((30, 18), (8, 8)) == (2, 8, 4)
    assert feature_rows((30, 18), PINPOINTS, TILE, 4) == 16 + 8 * 5
    # and within an 8x4 map, 30 * 4 / 18 = 6.67 lines, truncated to 6: one line cut at each end
    assert unpadded((30, 18), (8, 4)) == (1, 6, 4)


def test_pinpoints_must_be_whole_tiles() -> None:
    assert check_pinpoints(PINPOINTS, TILE) is None
    assert "multiples of the 16-pixel tile" in (check_pinpoints([[16, 24]], TILE) or "")
    assert "empty" in (check_pinpoints([], TILE) or "")


def test_token_counts_equal_llava_next_processors_at_llava_1_6_shapes() -> None:
    """transformers' own count (`LlavaNextProcessor._get_number_of_features`, less the class
    token) for llava-v1.6's 336 px tiles of 14 px patches, over pictures of random sizes."""
    import random
    from types import SimpleNamespace

    from transformers import LlavaNextProcessor

    pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    counter = SimpleNamespace(
        image_processor=SimpleNamespace(image_grid_pinpoints=pinpoints), patch_size=14, num_additional_image_tokens=1
    )
    counter._get_unpadded_features = lambda *args: LlavaNextProcessor._get_unpadded_features(counter, *args)
    rng = random.Random(0)
    for size in [(480, 640), (336, 672), (1, 4096), (4096, 1)] + [
        (rng.randint(1, 4096), rng.randint(1, 4096)) for _ in range(500)
    ]:
        want = LlavaNextProcessor._get_number_of_features(counter, *size, 336, 336) - 1
        assert feature_rows(size, pinpoints, 336, 14) == want, size
    assert feature_rows((480, 640), pinpoints, 336, 14) == 2340
