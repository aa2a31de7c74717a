"""LLaVA-NeXT (1.6): LLaVA's CLIP tower, projector and decoder over any-resolution tiles.

An image arrives as its tiles (`sonar.core.anyres`): the base image resized to the tower's input,
then the tiles of the image resized into its best-fit pinpoint resolution. The tower and projector
(`LlavaForConditionalGeneration.encode_images`) run on every tile; the tiles' rows are laid out as
one feature map, the rows covering only padding are cut off, and each line of the map ends with
the learned ``image_newline`` row; the base image's rows come first. The result is
`sonar.core.anyres.feature_rows` rows, which the prompt holds as image tokens (transformers'
`LlavaNextModel.pack_image_features`, "spatial_unpad").

The runner gives `encode_grid` an image's tiles and its original ``(height, width)`` (its
`ImageInput.grid`). Only the ``default`` feature strategy (the class token dropped) is served:
transformers' layout needs each tile's rows to form a square.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from sonar.core.anyres import check_pinpoints, tile_grid, unpadded
from sonar.models.errors import ModelLoadError
from sonar.models.llava import LlavaForConditionalGeneration
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, TensorParallel
from sonar.protocol.engine import VisionInfo


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT: LLaVA with any-resolution tiling and the ``image_newline`` row."""

    architectures = ("LlavaNextForConditionalGeneration",)
    own_weights: ClassVar[tuple[str, ...]] = ("vision_tower.", "multi_modal_projector.", "image_newline")
    tower_modules: ClassVar[tuple[str, ...]] = ("vision_tower", "multi_modal_projector", "image_newline")

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        strategy = config.vision_feature_select_strategy
        if strategy != "default":
            raise ModelLoadError(
                f"LLaVA-NeXT with vision_feature_select_strategy {strategy!r} is not supported (default)"
            )
        if getattr(config, "multimodal_patch_merge_type", "spatial_unpad") != "spatial_unpad":
            raise ModelLoadError(f"LLaVA-NeXT patch merge {config.multimodal_patch_merge_type!r} is not supported")
        super().__init__(config, parallel, stage)
        self.grid_pinpoints = [[int(v) for v in point] for point in config.image_grid_pinpoints]
        problem = check_pinpoints(self.grid_pinpoints, self.image_size)
        if problem is not None:
            raise ModelLoadError(problem)
        self.patch_size = int(config.vision_config.patch_size)
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size))

    def vision_info(self) -> VisionInfo:
        """What the frontend needs: images of any size, tiled by the LLaVA-NeXT processor."""
        return VisionInfo(
            self.image_token_id,
            0,
            self.image_size,
            grid_pinpoints=self.grid_pinpoints,
            tile_patch_size=self.patch_size,
        )

    def encode_grid(self, pixels: Tensor, grid: Sequence[int]) -> Tensor:
        """One image's feature rows ``[feature_rows, hidden]`` from its tiles ``[n, 3, tile, tile]``
        (the base image first) and its original ``(height, width)``."""
        size = (int(grid[0]), int(grid[1]))
        features = self.encode_images(pixels)  # [n, side * side, hidden]
        side = self.image_size // self.patch_size
        rows, cols = tile_grid(size, self.grid_pinpoints, self.image_size)
        hidden = features.shape[-1]
        tiles = features[1:].view(rows, cols, side, side, hidden)
        grid_map = tiles.permute(0, 2, 1, 3, 4).reshape(rows * side, cols * side, hidden)
        first, height, width = unpadded(size, (rows * side, cols * side))
        if height < rows * side:
            grid_map = grid_map[first : first + height]
        else:
            grid_map = grid_map[:, first : first + width]
        newline = self.image_newline.to(grid_map.dtype).expand(height, 1, hidden)
        lines = torch.cat([grid_map, newline], dim=1).reshape(-1, hidden)
        return torch.cat([features[0], lines])
