"""Rotary position embeddings: inverse frequencies per `rope_type`, and the cos/sin they give.

The frequency formulas follow the published methods (RoFormer; linear position interpolation;
dynamic NTK scaling; Llama 3.1's wavelength-banded scaling; YaRN; Phi-3's LongRoPE), in float32
as transformers computes them, so the same config gives the same rotation in Sonar and in the
reference.

Two of them depend on the sequence in transformers, which recomputes its frequencies from the
largest position of each forward call:

* ``dynamic`` raises the base once a sequence grows past ``max_position_embeddings`` and leaves it
  alone below: Sonar serves up to ``max_position_embeddings``, the unscaled frequencies.
* ``longrope`` (Phi-3, Phi-4) takes the short factors while a sequence fits in
  ``original_max_position_embeddings`` and the long ones past it; when a generation first crosses
  that length, transformers' Phi-3 drops the KV cache and prefills the whole sequence again with
  the long factors. Sonar does the same per sequence (a cache holding keys rotated both ways gives
  broken attention): the scheduler picks the factor set of each sequence from its length and
  recomputes one that crosses (`sonar.core.schedule`), and the runner asks for the long factors by
  adding `LONG_ROPE` to the rotary positions of that sequence's rows, so both sets serve one
  batch. `longrope_switch` is the length past which a sequence takes them.

A partial rotary (``partial_rotary_factor`` < 1) rotates the first ``rotary_dim`` dimensions of
each head and passes the rest through; `apply_partial_rotary` does it, in the halves layout of
Llama (pairs ``i``, ``i + rotary_dim / 2``) or the interleaved one of GLM (pairs ``2i``, ``2i + 1``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from sonar.kernels import ops
from sonar.models.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

LONG_ROPE = 1 << 30
"""Added to a row's rotary position to take LongRoPE's long factors (`RotaryEmbedding.cos_sin`);
above every position a model serves."""


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's rope parameters as one flat dict with at least `rope_type`, `rope_theta` and
    `partial_rotary_factor` (configs written before transformers 5 keep the last one, and
    LongRoPE's original context, beside the scaling dict)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] == "mrope":  # Qwen2-VL's name for default frequencies taken in three sections
        params["rope_type"] = "default"
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    original = getattr(config, "original_max_position_embeddings", None)
    if original is not None:
        params.setdefault("original_max_position_embeddings", original)
    return params


def rotary_dim(params: dict[str, Any], head_dim: int) -> int:
    """How many leading dimensions of each head rotate (transformers' ``int(head_dim * factor)``)."""
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def _base_inv_freq(base: float, dim: int) -> Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base**exponents)


def inv_freq_and_scale(params: dict[str, Any], head_dim: int, max_position_embeddings: int) -> tuple[Tensor, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` (float32, CPU) and the factor applied to cos/sin
    (``longrope``: the short factors'; `RotaryEmbedding` keeps the long ones beside them)."""
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    dim = rotary_dim(params, head_dim)
    if rope_type == "default":
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, dim) / params["factor"], 1.0
    if rope_type == "dynamic":
        return _dynamic(base, dim, params, max_position_embeddings), 1.0
    if rope_type == "llama3":
        return _llama3(_base_inv_freq(base, dim), params), 1.0
    if rope_type == "yarn":
        return _yarn(base, dim, params, max_position_embeddings)
    if rope_type == "longrope":
        return longrope_inv_freq(params, head_dim, max_position_embeddings, long=False)
    raise ModelLoadError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _dynamic(base: float, dim: int, params: dict[str, Any], max_positions: int) -> Tensor:
    """Dynamic NTK scaling at a sequence length of `max_positions`, the longest Sonar serves: the
    base formula's factor is then 1 (transformers evaluates the same expression at init)."""
    factor = params["factor"]
    seq_len = max_positions
    base = base * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim)


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


def longrope_inv_freq(params: dict[str, Any], head_dim: int, max_positions: int, long: bool) -> tuple[Tensor, float]:
    """LongRoPE: the short (or `long`) factors' inverse frequencies, and the attention factor (from
    `factor`, else from ``max_position_embeddings / original_max_position_embeddings``)."""
    context = _original_context(params)
    dim = rotary_dim(params, head_dim)
    key = "long_factor" if long else "short_factor"
    factors = params[key]
    if len(factors) != dim // 2:
        raise ModelLoadError(f"longrope {key} has {len(factors)} values, the rotary needs {dim // 2}")
    factor = params.get("factor") or max_positions / context
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(context))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * float(params["rope_theta"]) ** shape)
    return inv_freq, float(attention_factor)


def _original_context(params: dict[str, Any]) -> int:
    if "original_max_position_embeddings" not in params:
        raise ModelLoadError(f"rope_type {params['rope_type']!r} needs original_max_position_embeddings")
    return int(params["original_max_position_embeddings"])


def longrope_switch(params: dict[str, Any], max_position_embeddings: int) -> int | None:
    """The sequence length past which LongRoPE takes its long factors (its original context), or
    None where nothing switches (another rope type, or no position past the original context)."""
    if params["rope_type"] != "longrope":
        return None
    context = _original_context(params)
    return context if context < max_position_embeddings else None


class RotaryEmbedding:
    """cos/sin tables for a step's positions, computed once per forward and shared by all layers."""

    def __init__(self, params: dict[str, Any], head_dim: int, max_position_embeddings: int) -> None:
        self.rotary_dim = rotary_dim(params, head_dim)
        section = params.get("mrope_section")
        self.mrope_section: list[int] | None = list(section) if section else None
        """M-RoPE (Qwen2-VL): how many frequencies the temporal, height and width positions turn."""
        with torch.device("cpu"):  # the model may be built under a meta-device context
            self.inv_freq, self.scale = inv_freq_and_scale(params, head_dim, max_position_embeddings)
            self.long_inv_freq: Tensor | None = None
            """LongRoPE: the long factors' frequencies, for rows at positions from `LONG_ROPE`."""
            if params["rope_type"] == "longrope":
                if section:
                    raise ModelLoadError("rope_type 'longrope' with mrope_section is not supported")
                self.long_inv_freq = longrope_inv_freq(params, head_dim, max_position_embeddings, long=True)[0]
        self.mrope_owner: Tensor | None = None
        """Interleaved M-RoPE (Qwen3-VL, ``mrope_interleaved``): the position each frequency turns with."""
        if self.mrope_section and params.get("mrope_interleaved"):
            self.interleave_mrope()
        self._on: dict[torch.device, Tensor] = {}
        """The frequencies on each device (LongRoPE: ``[2, rotary_dim // 2]``, short then long)."""

    def interleave_mrope(self) -> None:
        """Take the M-RoPE sections interleaved (`mrope_owner`) rather than one after another."""
        assert self.mrope_section is not None
        with torch.device("cpu"):
            self.mrope_owner = mrope_owner(self.mrope_section, self.inv_freq.shape[0])

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``[num_tokens, rotary_dim]`` cos and sin (each half repeated), in ``dtype``. Positions
        ``[3, num_tokens]`` (M-RoPE): the frequencies of each `mrope_section` turn with their row.
        LongRoPE: a position from `LONG_ROPE` on is ``position - LONG_ROPE`` with the long factors."""
        inv_freq = self._on.get(positions.device)
        if inv_freq is None:
            freqs = self.inv_freq if self.long_inv_freq is None else torch.stack((self.inv_freq, self.long_inv_freq))
            inv_freq = self._on[positions.device] = freqs.to(positions.device)
        if self.long_inv_freq is not None:  # each row's factor set, from its position
            long = positions >= LONG_ROPE
            angles = (positions - long * LONG_ROPE).to(torch.float32)[:, None] * inv_freq[long.long()]
        elif positions.dim() == 2:
            if self.mrope_section is None:
                raise ValueError("positions [3, num_tokens] need a model with rope mrope_section")
            angles = positions.to(torch.float32)[:, :, None] * inv_freq
            if self.mrope_owner is not None:
                owner = self.mrope_owner.to(angles.device)
                angles = angles.gather(0, owner.expand(1, angles.shape[1], -1))[0]
            else:
                sections = angles.split(self.mrope_section, dim=-1)
                angles = torch.cat([part[i] for i, part in enumerate(sections)], dim=-1)
        else:
            angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)


def mrope_owner(section: list[int], frequencies: int) -> Tensor:
    """Interleaved M-RoPE (Qwen3-VL): which position (0 temporal, 1 height, 2 width) turns each
    frequency. Frequency ``i`` follows the height when ``i % 3 == 1`` and ``i < 3 * section[1]``,
    the width when ``i % 3 == 2`` and ``i < 3 * section[2]``, the temporal position otherwise, so
    every position turns low and high frequencies alike (transformers' Qwen3-VL rotary)."""
    owner = torch.zeros(frequencies, dtype=torch.int64)
    for axis in (1, 2):
        owner[axis : section[axis] * 3 : 3] = axis
    return owner


def apply_partial_rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` dimensions of each head of ``x`` ``[num_tokens, heads,
    head_dim]`` and pass the others through. `interleaved`: the rotating pairs are ``2i, 2i + 1``
    (GLM), each turned by the angle of frequency ``i`` (the first half of `cos`/`sin`)."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    if interleaved:
        half = dim // 2
        c, s = cos[:, None, :half], sin[:, None, :half]
        pairs = rot.unflatten(-1, (half, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        rot = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    else:
        rot = ops.apply_rotary(rot, cos, sin)
    return torch.cat((rot, rest), dim=-1)
