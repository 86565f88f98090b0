"""KV-cache quantization: K and V kept as one byte per value, with one scale per block per KV head.

A value x is stored as the code q = x / s rounded to the format (int8: the nearest integer in
-127..127; fp8: the nearest float8_e4m3fn), and read back as q * s. The scale s of a (block, head)
is the largest |x| the block holds for that head divided by the format's largest code, so nothing
is ever clipped and an int8 value is off by at most s / 2 (the book, 10.8: KV quantization).

A block fills over time: decode appends one token per step, and a new token may be larger than
anything the block holds. Two fixes exist. A scale fixed by the block's first tokens would clip the
later, larger ones, with an error as large as the outlier. Instead the scale only grows: when a
token needs a larger one, the block's codes for that head are re-rounded to the new scale. Each
growth costs the tokens already there one more rounding (after one growth a token is off by at
most s_old / 2 + s_new / 2 <= s_new), and nothing is ever clipped. A block's first token (offset 0) starts it over:
whatever scale it had belonged to a previous, freed owner.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVQuantFormat:
    """One byte per value: how to turn x / scale into a code and back."""

    name: str
    code_dtype: torch.dtype  # what the byte means; the storage keeps it as int8 either way
    qmax: float  # the largest code: the block's largest |x| maps to it

    def encode(self, scaled: torch.Tensor) -> torch.Tensor:
        """x / scale (float) -> codes as int8 bytes."""
        if self.code_dtype == torch.int8:
            return scaled.round().clamp_(-self.qmax, self.qmax).to(torch.int8)
        return scaled.clamp(-self.qmax, self.qmax).to(self.code_dtype).view(torch.int8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """int8 bytes -> the codes' values as float32 (multiply by the scale to get x back)."""
        if self.code_dtype == torch.int8:
            return codes.float()
        return codes.view(self.code_dtype).float()


INT8 = KVQuantFormat("int8", torch.int8, 127.0)
FORMATS = {"int8": INT8}
if hasattr(torch, "float8_e4m3fn"):
    FORMATS["fp8"] = KVQuantFormat("fp8", torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max))
KV_CACHE_DTYPES = ("auto", *FORMATS)


def resolve_kv_cache_dtype(kv_cache_dtype: str) -> KVQuantFormat | None:
    """"auto" -> None (K/V kept in the model's dtype); "int8" / "fp8" -> their format."""
    if kv_cache_dtype == "auto":
        return None
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return FORMATS[kv_cache_dtype]


def store_quantized(fmt: KVQuantFormat, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    slots: torch.Tensor) -> None:
    """Write rows x [T, H, D] into codes [N, block_size, H, D] (int8) at `slots` [T] (all >= 0),
    growing scales [N, H] where a new row needs it and re-rounding the codes already there."""
    block_size = codes.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    touched, inverse = torch.unique(blocks, return_inverse=True)
    old = scales[touched]
    starts_over = torch.zeros(len(touched), dtype=torch.bool, device=x.device)
    starts_over[inverse[offsets == 0]] = True
    old = torch.where(starts_over[:, None], 0.0, old)
    x = x.float()
    row_max = x.abs().amax(-1)  # [T, H]
    block_max = torch.zeros_like(old).scatter_reduce_(0, inverse[:, None].expand_as(row_max), row_max, "amax")
    new = torch.maximum(old, block_max / fmt.qmax)
    grown = (new > old) & (old > 0)
    if bool(grown.any()):
        ratio = torch.where(grown, old / new, 1.0)[:, None, :, None]
        codes[touched] = fmt.encode(fmt.decode(codes[touched]) * ratio)
    scales[touched] = new
    row_scale = new[inverse][..., None]  # [T, H, 1]
    codes[blocks, offsets] = fmt.encode(torch.where(row_scale > 0, x / row_scale, 0.0))


def dequantize(fmt: KVQuantFormat, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [N, block_size, H, D] and scales [N, H] -> values [N, block_size, H, D] in `dtype`."""
    return (fmt.decode(codes) * scales[:, None, :, None]).to(dtype)
