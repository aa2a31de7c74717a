"""LLaVA-NeXT's any-resolution layout: which tiles an image becomes and how many rows it takes.

An image of ``(height, width)`` pixels is resized, keeping its aspect ratio, into the best of the
model's ``image_grid_pinpoints`` (the resolution that keeps the most of its pixels, then wastes the
fewest: `best_resolution`), padded to it, and cut into ``tile x tile`` tiles (the vision tower's
input size); the whole image resized to one tile (the *base* image) comes first. The tower gives
each tile ``side = tile / patch`` squared feature rows (the class token dropped). The tiles'
rows, laid out as one ``(rows * side) x (cols * side)`` map, lose the rows or columns that only
cover the padding (`unpadded`), and each of the map's lines ends with the model's
``image_newline`` row. So an image takes ``side ** 2 + h * (w + 1)`` placeholder tokens for an
unpadded map of ``h x w`` (`feature_rows`): what transformers' `LlavaNextProcessor` counts and
`LlavaNextModel.pack_image_features` produces, both reproduced here exactly (their rounding too).

Pure functions of integers: the API server counts an image's tokens with them, the scheduler
checks an image's shape, the model lays out its rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Size = tuple[int, int]
"""``(height, width)``."""


def best_resolution(size: Size, pinpoints: Sequence[Sequence[int]]) -> Size:
    """The pinpoint ``(height, width)`` an image of `size` is resized into: the most of its pixels
    kept (after fitting it inside), then the fewest wasted; the first such in `pinpoints`."""
    height, width = size
    best: Size | None = None
    most, least_wasted = 0, math.inf
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > most or (kept == most and wasted < least_wasted):
            best, most, least_wasted = (int(h), int(w)), kept, wasted
    if best is None:
        raise ValueError(f"no grid pinpoint fits an image of {size}")
    return best


def tile_grid(size: Size, pinpoints: Sequence[Sequence[int]], tile: int) -> Size:
    """``(rows, cols)`` of tiles the image is cut into (the base image not counted); the pinpoints
    are multiples of `tile` (`check_pinpoints`)."""
    h, w = best_resolution(size, pinpoints)
    return h // tile, w // tile


def check_pinpoints(pinpoints: Sequence[Sequence[int]], tile: int) -> str | None:
    """Why `pinpoints` cannot lay out tiles of `tile` pixels, or None."""
    if not pinpoints:
        return "image_grid_pinpoints is empty"
    for point in pinpoints:
        if len(point) != 2 or any(not isinstance(v, int) or v <= 0 or v % tile for v in point):
            return f"image_grid_pinpoints {list(point)} is not a (height, width) in multiples of the {tile}-pixel tile"
    return None


def num_tiles(size: Size, pinpoints: Sequence[Sequence[int]], tile: int) -> int:
    """Tiles the tower runs on for the image: its grid's and the base image."""
    rows, cols = tile_grid(size, pinpoints, tile)
    return rows * cols + 1


def unpadded(size: Size, map_size: Size) -> tuple[int, int, int]:
    """``(top, height, width)`` of the part of a ``map_size`` feature map that covers the image
    (the padding cut off the longer side's ends evenly); ``top`` is the first kept line, or column
    when the width is cut (transformers' `unpad_image`)."""
    height, width = size
    map_h, map_w = map_size
    if width / height > map_w / map_h:
        new_h = int(round(height * (map_w / width), 7))
        pad = (map_h - new_h) // 2
        return pad, map_h - 2 * pad, map_w
    new_w = int(round(width * (map_h / height), 7))
    pad = (map_w - new_w) // 2
    return pad, map_h, map_w - 2 * pad


def feature_rows(size: Size, pinpoints: Sequence[Sequence[int]], tile: int, patch: int) -> int:
    """Placeholder tokens (feature rows) an image of `size` takes: the base image's, then the
    unpadded map's lines each with its newline row."""
    side = tile // patch
    rows, cols = tile_grid(size, pinpoints, tile)
    _, h, w = unpadded(size, (rows * side, cols * side))
    return side * side + h * (w + 1)
