"""How a model's linear weights are stored, and which CPU kernel multiplies by them
(`labkit.kernels.describe()` names it).

Three formats, chosen with `LLM(..., weight_format=...)` or `load_model(..., weight_format=...)`:

- "dequantized": float weights in the model's dtype. In bf16 on a CPU with AMX or AVX512-BF16 the
  engine packs each weight once into AMX's tile layout for a small C GEMM (`packed_linear.py`, which a
  fused C decode step can call); where that kernel does not build, it reorders each weight once into
  oneDNN's blocked layout ("prepacked"), so a call multiplies at once instead of re-laying the weight
  out every time; in
  fp32 the engine packs each weight once for a small C GEMM (`packed_linear.py`) on AVX-512 CPUs, where
  it measured faster than torch's. The labs see plain `nn.Linear`s (load_model's prepack=False).
- "int8": weight-only int8, one symmetric scale per output row (scale = max|w| / 127). A quarter of
  fp32's bytes.
- "q4_1": llama.cpp's Q4_1 blocks: 32 consecutive weights of a row share a scale d and an offset m,
  w = d * q + m with q in 0..15 (5 bits a weight with the two fp16 numbers). From a GGUF holding Q4_1
  tensors these are the file's own blocks, bit for bit; any other model is quantized the way
  llama.cpp's `quantize_row_q4_1` does.

The quantized formats are a batch-1 and memory choice. Where the C int8 dot kernel builds
(`labkit/kernels/int8_dot.py`), it multiplies the codes by activations quantized to int8 per group of 32, as
llama.cpp does, in float32 or bfloat16 models; batches of more than a few rows (prefill) dequantize
the weight for a float GEMM instead. Without it, torch's weight-only kernels run: they widen the codes
to floats for every row of activations and are vectorized for bf16 only (their fp32 path is a scalar
fallback, ~20x slower, measured), so bf16 is required there. torch's int4 kernel stores a scale and a
zero per group with w = (q - 8) * scale + zero, so scale = d and zero = m + 8d carry a Q4_1 block over
exactly. The embedding table stays float (a lookup reads one row per token); the LM head, which reads
all of it every step, is int8 per row in both quantized formats (SmolLM2's GGUF stores it as Q8_0).
"""

import torch
from torch import nn

from labkit.kernels import gemm, int8_dot
from labkit.model.packed_linear import PackedBf16Linear, PackedF32Linear

WEIGHT_FORMATS = ("dequantized", "int8", "q4_1")
Q4_GROUP = 32  # weights per Q4_1 block
# torch's _weight_int8pack_mm crashes (SIGSEGV, torch 2.13, bf16) on some widths that are not a multiple
# of 16, so the fallback pads its codes and inputs with zero columns up to one.
INT8PACK_WIDTH = 16


class PrepackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (bf16, CPU): reordered once, not per call."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Int8Linear(nn.Module):
    """Weight-only int8: codes [out, in] int8 and one scale per output row; y = x (codes * scale)^T + b.
    Multiplied by the C int8 dot kernel when it builds here, else by torch's kernel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        codes = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.native = int8_dot.pack_int8(codes, scale) if int8_dot.load() is not None else None
        if self.native is None:
            self.register_buffer("codes", nn.functional.pad(codes, (0, -self.in_features % INT8PACK_WIDTH)))
            self.register_buffer("scale", scale.to(torch.bfloat16))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            y = self.native(x)
        else:
            rows, padding = x.reshape(-1, self.in_features), self.codes.shape[1] - self.in_features
            if padding:  # SmolLM2's widths (576, 1536) need none: no copy on their path
                rows = nn.functional.pad(rows, (0, padding))
            y = torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scale)
            y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_1 of a [out, in] weight: (codes uint8 0..15 [out, in], d, m [out, in/32] fp32),
    d and m rounded to fp16 as the file stores them."""
    out_features, in_features = weight.shape
    if in_features % Q4_GROUP:
        raise ValueError(f"Q4_1 needs in_features divisible by {Q4_GROUP}, got {in_features}")
    groups = weight.detach().float().reshape(out_features, in_features // Q4_GROUP, Q4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    d = (high - low) / 15
    inv_d = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.clamp(((groups - low[..., None]) * inv_d[..., None] + 0.5).to(torch.int32), 0, 15)
    return (codes.reshape(out_features, in_features).to(torch.uint8), d.half().float(), low.half().float())


def dequantize_q4_1(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """fp32 weight [out, in] of Q4_1 blocks: d * q + m per group of 32."""
    out_features, in_features = codes.shape
    groups = codes.float().reshape(out_features, in_features // Q4_GROUP, Q4_GROUP)
    return (groups * d[..., None] + m[..., None]).reshape(out_features, in_features)


class Q4Linear(nn.Module):
    """Weight-only Q4_1 through torch's int4 CPU kernel: 4-bit codes packed two to a byte, and per
    group of 32 the pair (scale, zero) = (d, m + 8d)."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if d.shape != (self.out_features, self.in_features // Q4_GROUP) or m.shape != d.shape:
            raise ValueError(f"Q4_1 scales {tuple(d.shape)} and offsets {tuple(m.shape)} do not match codes "
                             f"{tuple(codes.shape)} in groups of {Q4_GROUP}")
        if codes.numel() and int(codes.max()) > 15:
            raise ValueError(f"Q4_1 codes must lie in 0..15, got up to {int(codes.max())}")
        self.native = int8_dot.pack_q4_1(codes, d, m) if int8_dot.load() is not None else None
        if self.native is None:
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
            scale_and_zero = torch.stack((d, m + 8 * d), dim=-1).transpose(0, 1).contiguous()  # [in/32, out, 2]
            self.register_buffer("scale_and_zero", scale_and_zero.to(torch.bfloat16))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            y = self.native(x)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), self.packed, Q4_GROUP,
                                                          self.scale_and_zero)
            y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def check_weight_format(weight_format: str, dtype: torch.dtype, device: torch.device | str) -> None:
    """Raise ValueError naming the problem if the format cannot run in this dtype on this device."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if weight_format == "dequantized":
        return
    if torch.device(device).type != "cpu":
        raise ValueError(f"weight_format={weight_format!r} runs on the CPU only (torch's weight-only "
                         f"kernels differ per device); on {torch.device(device).type} use weight_format='dequantized'")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"weight_format={weight_format!r} takes float32 or bfloat16 activations, got {dtype}")
    if dtype != torch.bfloat16 and int8_dot.load() is None:
        raise ValueError(f"weight_format={weight_format!r} needs dtype=torch.bfloat16 here: without the C int8 dot "
                         f"kernel ({int8_dot.load.why_not()}) torch's CPU int8/int4 kernels run, and they are "
                         f"vectorized for bf16 activations only, got {dtype}")


def apply_weight_format(model: nn.Module, weight_format: str, prepack: bool = False,
                        q4_blocks: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None) -> None:
    """Replace the model's linear layers (in place) by the format's kernels.

    `prepack`: for "dequantized" on a CPU, bf16 (with native bf16) uses oneDNN's prepacked layout and
    fp32 the packed C GEMM (AVX-512 CPUs), each only where it is the faster kernel.
    `q4_blocks`: a GGUF's own Q4_1 blocks by weight name (codes, d, m); other weights are quantized here.
    """
    dtype, device = model.dtype, model.device
    check_weight_format(weight_format, dtype, device)
    if weight_format == "dequantized" and not (
            prepack and device.type == "cpu" and (dtype == torch.bfloat16 and gemm.prepacks_bf16()
                                                  or dtype == torch.float32 and gemm.f32_serves_this_cpu())):
        return
    q4_blocks = q4_blocks or {}
    for module_name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            name = f"{module_name}.{child_name}" if module_name else child_name
            setattr(module, child_name, _converted(child, name, weight_format, q4_blocks))


def _converted(linear: nn.Linear, name: str, weight_format: str, q4_blocks: dict) -> nn.Module:
    if weight_format == "dequantized":
        if linear.weight.dtype == torch.float32:
            return PackedF32Linear(linear)
        return PackedBf16Linear(linear) if gemm.load_bf16() is not None else PrepackedLinear(linear)
    if weight_format == "int8" or name == "lm_head" or linear.in_features % Q4_GROUP:
        return Int8Linear(linear)
    blocks = q4_blocks.get(f"{name}.weight") or quantize_q4_1(linear.weight)
    return Q4Linear(*blocks, bias=linear.bias)
