"""Each checkpoint format's quantizer and packer, written in the tests from the formats' own
specifications (not from Sonar's readers): they turn a float weight into the tensors a checkpoint
of that format stores, and give the weight the format's dequantization formula yields from them,
in float32 (the reference the readers are checked against)."""

from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ writes these columns into fields 0..7


def pack_int32(fields: Tensor, bits: int, dim: int) -> Tensor:
    """Unsigned `bits`-bit `fields`, ``32 // bits`` consecutive ones along `dim` into one int32,
    the first in the lowest bits."""
    per = 32 // bits
    f = fields.to(torch.int64).movedim(dim, -1)
    f = f.reshape(*f.shape[:-1], f.shape[-1] // per, per)
    words = (f << (torch.arange(per) * bits)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def act_order_g_idx(k: int, group: int, seed: int) -> Tensor:
    """GPTQ act-order's ``g_idx``: the columns quantized in a random order, each run of `group`
    columns of that order one group."""
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    return g_idx


def int_quantize(
    w: Tensor, g_idx: Tensor, bits: int, sym: bool, scale_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Min-max integer quantization of ``w [N, K]`` per row and group (`g_idx` gives each column's).

    Returns unsigned ``q [N, K]``, ``scales [N, G]`` (as stored, in `scale_dtype`), integer zero
    points ``[N, G]`` and the dequantized ``(q - z) * s`` in float32."""
    maxq = 2**bits - 1
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    q = torch.empty(n, k, dtype=torch.int64)
    scales = torch.empty(n, groups, dtype=scale_dtype)
    zeros = torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols].float()
        if sym:
            scale = (wg.abs().amax(1) * 2 / maxq).to(scale_dtype).float()
            zero = torch.full((n,), (maxq + 1) // 2, dtype=torch.int64)
        else:
            lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
            scale = ((hi - lo) / maxq).to(scale_dtype).float()
            # zero 0 is left out: GPTQ's v1 packer cannot store it (it stores z - 1)
            zero = torch.round(-lo / scale).to(torch.int64).clamp(1, maxq)
        q[:, cols] = (torch.round(wg / scale[:, None]) + zero[:, None]).clamp(0, maxq).to(torch.int64)
        scales[:, g] = scale.to(scale_dtype)
        zeros[:, g] = zero
    gi = g_idx.to(torch.int64)
    ref = (q - zeros[:, gi]).float() * scales.float()[:, gi]
    return q, scales, zeros, ref


def gptq(w: Tensor, bits: int, group: int, sym: bool, desc_act: bool, v1: bool, seed: int = 0) -> tuple[dict, Tensor]:
    """GPTQ tensors of ``w [N, K]`` (``qweight``, ``qzeros``, ``scales``, ``g_idx``) and their dequantized weight."""
    n, k = w.shape
    group = k if group == -1 else group
    g_idx = act_order_g_idx(k, group, seed) if desc_act else (torch.arange(k) // group).to(torch.int32)
    q, scales, zeros, ref = int_quantize(w, g_idx, bits, sym, torch.float16)
    stored_zeros = zeros - 1 if v1 else zeros
    tensors = {
        "qweight": pack_int32(q.T, bits, dim=0),  # [K * bits / 32, N]
        "qzeros": pack_int32(stored_zeros.T, bits, dim=1),  # [K / G, N * bits / 32]
        "scales": scales.T.contiguous(),  # [K / G, N]
        "g_idx": g_idx,
    }
    return tensors, ref


def gptq_config(bits: int, group: int, sym: bool, desc_act: bool, v1: bool) -> dict:
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": "gptq" if v1 else "gptq_v2",
    }


def awq(w: Tensor, group: int) -> tuple[dict, Tensor]:
    """AWQ GEMM tensors of ``w [N, K]`` and their dequantized weight."""
    n, k = w.shape
    group = k if group == -1 else group
    q, scales, zeros, ref = int_quantize(w, (torch.arange(k) // group).to(torch.int32), 4, False, torch.float16)

    def interleave(fields: Tensor) -> Tensor:  # [R, N]: columns into AWQ's field order, then packed
        order = torch.arange(fields.shape[1]).view(-1, 8)[:, list(AWQ_PACK_ORDER)].reshape(-1)
        return pack_int32(fields[:, order], 4, dim=1)

    tensors = {"qweight": interleave(q.T), "qzeros": interleave(zeros.T), "scales": scales.T.contiguous()}
    return tensors, ref


def awq_config(group: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}


def fp8_block(w: Tensor, block: tuple[int, int]) -> tuple[dict, Tensor]:
    """FP8 with one float32 scale per ``[bn, bk]`` block (the last ones partial), as
    ``weight``/``weight_scale_inv``, and ``float(q) * s`` of the block."""
    n, k = w.shape
    bn, bk = block
    rows, cols = torch.arange(n) // bn, torch.arange(k) // bk
    scale = torch.zeros(-(-n // bn), -(-k // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().amax() / FP8_MAX
    s = scale[rows][:, cols]
    q = (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * s


def fp8_scaled(w: Tensor, per_row: bool, name: str = "weight_scale") -> tuple[dict, Tensor]:
    """FP8 with one float32 scale for the tensor (shape ``[]``) or per row (``[N, 1]``)."""
    amax = w.float().abs().amax(1, keepdim=True) if per_row else w.float().abs().amax()
    scale = amax / FP8_MAX
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, name: scale}, q.float() * scale


def fp8_config(block: tuple[int, int] | None, static: bool = False) -> dict:
    config = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic", "fmt": "e4m3"}
    if block is not None:
        config["weight_block_size"] = list(block)
    return config


def ct_packed(
    w: Tensor, bits: int, group: int | None, sym: bool, desc_act: bool = False, seed: int = 0
) -> tuple[dict, Tensor]:
    """compressed-tensors ``pack-quantized``: values stored ``q + 2^(bits-1)`` (signed q), zero
    points likewise, packed eight (or four) to an int32 along the input axis (zero points along
    the output axis); bfloat16 scales ``[N, K / G]`` (channel: ``[N, 1]``)."""
    n, k = w.shape
    size = k if group is None else group
    g_idx = act_order_g_idx(k, size, seed) if desc_act else (torch.arange(k) // size).to(torch.int32)
    q, scales, zeros, ref = int_quantize(w, g_idx, bits, sym, torch.bfloat16)
    tensors = {
        "weight_packed": pack_int32(q, bits, dim=1),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
        "weight_scale": scales,
    }
    if not sym:
        tensors["weight_zero_point"] = pack_int32(zeros, bits, dim=0)
    if desc_act:
        tensors["weight_g_idx"] = g_idx
    return tensors, ref


def ct_int8(w: Tensor, sym: bool) -> tuple[dict, Tensor]:
    """compressed-tensors ``int-quantized`` per channel: int8 ``weight``, ``weight_scale`` ``[N, 1]``
    (bfloat16), asymmetric: int8 ``weight_zero_point`` ``[N, 1]``; ``(q - zp) * s``."""
    n, k = w.shape
    q, scales, zeros, ref = int_quantize(w, torch.zeros(k, dtype=torch.int32), 8, sym, torch.bfloat16)
    tensors = {"weight": (q - 128).to(torch.int8), "weight_scale": scales}
    if not sym:
        tensors["weight_zero_point"] = (zeros - 128).to(torch.int8)
    return tensors, ref


def ct_config(fmt: str, weights: dict, ignore: list[str], input_activations: dict | None = None) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": input_activations}
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def ct_weights(bits: int, kind: str, strategy: str, sym: bool = True, group: int | None = None, block=None) -> dict:
    return {
        "num_bits": bits,
        "type": kind,
        "symmetric": sym,
        "strategy": strategy,
        "group_size": group,
        "block_structure": block,
        "dynamic": False,
        "actorder": None,
    }
