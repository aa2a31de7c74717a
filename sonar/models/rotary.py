"""Rotary position embeddings: inverse frequencies per `rope_type`, and the cos/sin they give.

The frequency formulas follow the published methods (RoFormer; linear position interpolation;
Llama 3.1's wavelength-banded scaling; YaRN), in float32 as transformers computes them, so the
same config gives the same rotation in Sonar and in the reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from sonar.models.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's rope parameters as one flat dict with at least `rope_type` and `rope_theta`."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _base_inv_freq(base: float, dim: int) -> Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base**exponents)


def inv_freq_and_scale(params: dict[str, Any], head_dim: int, max_position_embeddings: int) -> tuple[Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` (float32, CPU) and the factor applied to cos/sin."""
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    inv_freq = _base_inv_freq(base, head_dim)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(base, head_dim, params, max_position_embeddings)
    raise ModelLoadError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _llama3(inv_freq: Tensor, params: dict[str, Any]) -> Tensor:
    """Keep short wavelengths, divide long ones by `factor`, blend linearly in between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(between, blended, scaled)


def _yarn(base: float, dim: int, params: dict[str, Any], max_positions: int) -> tuple[Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale attention."""
    context = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_positions / context

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


class RotaryEmbedding:
    """cos/sin tables for a step's positions, computed once per forward and shared by all layers."""

    def __init__(self, params: dict[str, Any], head_dim: int, max_position_embeddings: int) -> None:
        with torch.device("cpu"):  # the model may be built under a meta-device context
            self.inv_freq, self.scale = inv_freq_and_scale(params, head_dim, max_position_embeddings)
        self._on: dict[torch.device, Tensor] = {}

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``[num_tokens, head_dim]`` cos and sin (each half repeated), in ``dtype``."""
        inv_freq = self._on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on[positions.device] = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)
