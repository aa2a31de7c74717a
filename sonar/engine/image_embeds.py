"""Images given as their feature rows (--enable-mm-embeds): what the vision tower and projector
would give for an image, in the language model's hidden size, one row per image placeholder.

The forms, as vLLM takes them:
- the library (`LLM.add_images`): a tensor ``[rows, hidden_size]`` (or ``[1, rows, hidden_size]``)
  among the images; for a dynamic-resolution model (Qwen2-VL) a mapping ``{"image_embeds":
  tensor, "image_grid_thw": [t, h, w]}``, the grid saying which patches the rows stand for;
- HTTP: a chat content part ``{"type": "image_embeds", "image_embeds": B}`` where ``B`` is the
  base64 of a ``torch.save`` file of the tensor, or ``{"image_embeds": B, "image_grid_thw": G}``
  with ``G`` the base64 of the grid's tensor.

They are untrusted input like prompt embeddings: read with `sonar.engine.prompt_embeds.read_tensor`
(no pickled code runs, sizes bounded before anything is unpacked), then checked to be finite,
floating point, of the model's hidden size, with the rows the model's placeholder takes
(`sonar.multimodal.processor.expand_images`). The worker feeds the rows where the image's tokens
are, without running the tower (`ImageInput.embeds`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sonar.engine.prompt_embeds import check_rows, read_tensor
from sonar.errors import InvalidRequestError
from sonar.multimodal.processor import ImageEmbeds

#: The largest side of a patch grid accepted (a 4096-pixel image of 14-pixel patches is 293).
MAX_GRID_SIDE = 1024

_FIELDS = {"image_embeds", "image_grid_thw"}


def is_image_embeds(item: Any) -> bool:
    """Whether a library image item is given as embeddings (a tensor or a mapping), not a picture."""
    import torch

    return isinstance(item, torch.Tensor | Mapping)


def library_embeds(item: Any, hidden_size: int, max_rows: int, param: str) -> ImageEmbeds:
    """A library item (see the module docstring) as `ImageEmbeds`, or a 400 naming `param`."""
    if isinstance(item, Mapping):
        extra = set(item) - _FIELDS
        if extra:
            raise InvalidRequestError(f"{param} takes only {sorted(_FIELDS)}, not {sorted(extra)}", param)
        grid = item.get("image_grid_thw")
        return ImageEmbeds(
            check_rows(item.get("image_embeds"), hidden_size, max_rows, f"{param}.image_embeds"),
            None if grid is None else _grid(grid, f"{param}.image_grid_thw"),
        )
    return ImageEmbeds(check_rows(item, hidden_size, max_rows, param))


def part_embeds(value: Any, hidden_size: int, max_rows: int, param: str) -> ImageEmbeds:
    """An ``image_embeds`` content part's value (base64 text, or a mapping of base64 texts) as
    `ImageEmbeds`, or a 400 naming `param`."""
    if isinstance(value, str):
        return library_embeds(read_tensor(value, max_rows * hidden_size, param), hidden_size, max_rows, param)
    if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
        raise InvalidRequestError(f"{param} must be base64 text or an object of base64 texts", param)
    extra = set(value) - _FIELDS
    if extra:
        raise InvalidRequestError(f"{param} takes only {sorted(_FIELDS)}, not {sorted(extra)}", param)
    if "image_embeds" not in value:
        raise InvalidRequestError(f"{param} needs its image_embeds", param)
    item = {"image_embeds": read_tensor(value["image_embeds"], max_rows * hidden_size, f"{param}.image_embeds")}
    if "image_grid_thw" in value:
        item["image_grid_thw"] = read_tensor(value["image_grid_thw"], 3, f"{param}.image_grid_thw")
    return library_embeds(item, hidden_size, max_rows, param)


def _grid(grid: Any, param: str) -> tuple[int, int, int]:
    """A grid ``(t, h, w)`` from a tensor ``[3]`` or ``[1, 3]`` or a sequence of three ints."""
    import torch

    if isinstance(grid, torch.Tensor):
        if grid.dtype.is_floating_point or grid.dtype.is_complex or grid.numel() != 3:
            raise InvalidRequestError(
                f"{param} must hold three integers (t, h, w), got {grid.dtype} {list(grid.shape)}", param
            )
        values = [int(v) for v in grid.reshape(-1).tolist()]
    elif isinstance(grid, list | tuple) and len(grid) == 3 and all(type(v) is int for v in grid):
        values = list(grid)
    else:
        raise InvalidRequestError(f"{param} must hold three integers (t, h, w)", param)
    if not all(1 <= v <= MAX_GRID_SIDE for v in values):
        raise InvalidRequestError(f"{param} must be between 1 and {MAX_GRID_SIDE} each, got {values}", param)
    return values[0], values[1], values[2]
