"""FP8 block-quantized checkpoints (DeepSeek-V3, Qwen3 FP8): weights dequantized on import, a few
block rows at a time, as tensors stream in.

Legend: M, N a weight's rows and columns; bm, bn the block (quantization_config's
weight_block_size, [128, 128] in DeepSeek-V3); Mb = ceil(M / bm), Nb = ceil(N / bn).

A quantized Linear weight `<name>` [.., M, N] is stored as float8 (e4m3fn) beside
`<name>_scale_inv` [.., Mb, Nb] (float32, or e8m0 exponents); its value is
w[i, j] * scale_inv[i // bm, j // bn]. The last block row and column may be partial, as in
DeepSeek's own `weight_dequant` (kv_a_proj_with_mqa has 576 rows: 5 block rows). Without a
weight_block_size the block is 128x128, transformers' default. A weight waits only for its own
scale: the two usually sit side by side in one shard, so the stream holds one tensor at a time.
"""

import torch

from moepar.hf.arch import ConversionError

__all__ = ["quantization_block", "dequantize", "dequantized", "FP8_DTYPES"]

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                              "float8_e5m2fnuz") if hasattr(torch, n))
_SUFFIX = "_scale_inv"


def quantization_block(cfg: dict) -> tuple[int, int] | None:
    """(bm, bn) for an FP8 block-quantized config.json, None when it is not quantized; any other
    quantization is refused by name."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ConversionError(f"config.json has quantization_config.quant_method={method!r}; "
                              "moepar dequantizes only 'fp8' (float8 weights with "
                              "weight_scale_inv) on import")
    block = q.get("weight_block_size", (128, 128))
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConversionError(f"config.json has quantization_config.weight_block_size={block!r}; "
                              "expected two positive integers [rows, columns]")
    return tuple(block)


def _scales_fp32(scale: torch.Tensor, name: str) -> torch.Tensor:
    if scale.dtype == torch.uint8:   # raw e8m0 exponents: 2^(byte - 127)
        return (scale.to(torch.float32) - 127.0).exp2()
    if not scale.dtype.is_floating_point:
        raise ConversionError(f"{name}{_SUFFIX} has dtype {scale.dtype}; expected a float "
                              "(float32, bfloat16, float8_e8m0fnu) or uint8 exponents")
    return scale.to(torch.float32)


def dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype) -> torch.Tensor:
    """weight * scale_inv per block, computed in float32 a few block rows at a time, stored in
    `dtype`; the scale grid's shape is checked against the weight's and the block size."""
    scale = _scales_fp32(scale, name)
    if weight.dim() < 2:
        raise ConversionError(f"FP8 tensor {name!r} has shape {tuple(weight.shape)}; block "
                              "quantization needs a matrix")
    (rows, cols), (bm, bn) = weight.shape[-2:], block
    grid = (*weight.shape[:-2], -(-rows // bm), -(-cols // bn))
    if tuple(scale.shape) != grid:
        raise ConversionError(f"{name}{_SUFFIX} has shape {tuple(scale.shape)}; a weight of shape "
                              f"{tuple(weight.shape)} in {bm}x{bn} blocks needs {grid}")
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    scale_MbN = scale.repeat_interleave(bn, dim=-1)[..., :cols]   # each block row's scales per column
    # A few block rows at a time (about 4M weights): a bounded float32 scratch, scaled in place.
    step = max(1, (1 << 22) // (bm * weight[..., :1, :].numel()))
    for r in range(0, grid[-2], step):
        first, last = r * bm, min((r + step) * bm, rows)
        chunk = weight[..., first:last, :].to(torch.float32)
        for b in range(-(-(last - first) // bm)):
            chunk[..., b * bm:(b + 1) * bm, :].mul_(scale_MbN[..., r + b:r + b + 1, :])
        out[..., first:last, :] = chunk
    return out


def dequantized(tensors, block: tuple[int, int] | None, dtype: torch.dtype):
    """Streams (name, tensor) with every FP8 weight replaced by its dequantized value in `dtype`
    and the `_scale_inv` tensors consumed; other tensors pass through unchanged. A weight or a
    scale without its partner, or FP8 in a config without quantization_config, is an error."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(_SUFFIX):
            base = name[:-len(_SUFFIX)]
            if base in weights:
                yield base, dequantize(base, weights.pop(base), tensor, block, dtype)
            else:
                scales[base] = tensor
        elif tensor.dtype in FP8_DTYPES:
            if block is None:
                raise ConversionError(f"tensor {name!r} is {tensor.dtype} but config.json has no "
                                      "quantization_config (quant_method 'fp8', weight_block_size)")
            if name in scales:
                yield name, dequantize(name, tensor, scales.pop(name), block, dtype)
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    if weights:
        raise ConversionError(f"FP8 tensor(s) without their {_SUFFIX}: {sorted(weights)[:6]}")
    if scales:
        raise ConversionError(f"{_SUFFIX} tensor(s) without an FP8 weight: "
                              f"{[n + _SUFFIX for n in sorted(scales)][:6]}")
