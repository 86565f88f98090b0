"""The sampler's Gumbel-max draw as one Triton kernel: the GPU's way to run `gumbel_max` with seeded uniforms.

In torch the draw is some thirty element-wise passes over a [batch, vocab] int64/float64 tensor (the
hash, its 32-bit multiplications split in halves, two logs): at 256 rows of Qwen3's 151,936 entries
that is ~15 GB of memory traffic, several milliseconds a decode step, more than the model's own
forward. The kernel reads each logit once, hashes its index in registers, adds the Gumbel noise and
keeps the running argmax, so a step's draw costs one pass over the logits.

It computes what `labkit.sampling.sampler` computes, in the same float64 arithmetic: the uniform of
entry i in a row with key k is (hash32(k ^ hash32(i)) + 0.5) / 2^32, the score is
logit - log(-log u), the token the first maximum. Each program takes one row and BLOCK entries and
writes its best (score, index); the row's winner is the first of the programs' best. The tests
check it against the torch draw on the interpreter; `make gpu-check` compiled.
"""

import functools
import importlib.util

import torch

BLOCK = 4096  # vocabulary entries per program


def available() -> bool:
    """Whether the kernel can run here: triton is installed (Linux; on a CPU only the interpreter runs it)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gumbel_argmax_kernel(logits_ptr, keys_ptr, best_score_ptr, best_index_ptr, vocab, stride_row,
                             num_blocks, BLOCK: tl.constexpr):
        row, block = tl.program_id(0), tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        ok = cols < vocab
        logits = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=ok, other=float("-inf"))
        key = tl.load(keys_ptr + row).to(tl.uint64)
        # hash32(key ^ hash32(index)): two rounds of lowbias32, on uint64 lanes holding 32-bit values
        # (a product of two of them fits), the key mixed in before the second
        bits = cols.to(tl.uint64)
        for second in tl.static_range(2):
            if second:
                bits = bits ^ key
            bits = bits ^ (bits >> 16)
            bits = (bits * 0x7FEB352D) & 0xFFFFFFFF
            bits = bits ^ (bits >> 15)
            bits = (bits * 0x846CA68B) & 0xFFFFFFFF
            bits = bits ^ (bits >> 16)
        uniform = (bits.to(tl.float64) + 0.5) / 4294967296.0
        scores = logits.to(tl.float64) - tl.log(-tl.log(uniform))
        scores = tl.where(ok, scores, float("-inf"))
        best = tl.max(scores, axis=0)
        # the first entry reaching the maximum (argmax's tie rule), found without relying on tl.argmax's
        first = tl.min(tl.where(scores == best, cols, vocab), axis=0)
        tl.store(best_score_ptr + row * num_blocks + block, best)
        tl.store(best_index_ptr + row * num_blocks + block, first)

    return gumbel_argmax_kernel


def gumbel_argmax(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per row of `logits` [batch, vocab], argmax of logit - log(-log u) with the uniforms of `row_keys`
    `keys` [batch] (int64 holding 32-bit keys): `sampler.gumbel_max(logits, uniforms)` in one pass."""
    if logits.dim() != 2 or keys.shape != (logits.shape[0],):
        raise ValueError(f"logits must be [batch, vocab] and keys [batch], got {tuple(logits.shape)} and "
                         f"{tuple(keys.shape)}")
    rows, vocab = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    num_blocks = -(-vocab // BLOCK)
    best_score = torch.empty(rows, num_blocks, dtype=torch.float64, device=logits.device)
    best_index = torch.empty(rows, num_blocks, dtype=torch.int32, device=logits.device)
    _kernel()[(rows, num_blocks)](logits, keys.contiguous(), best_score, best_index, vocab, logits.stride(0),
                                  num_blocks, BLOCK=BLOCK)
    winner = best_score.argmax(dim=-1, keepdim=True)  # the first block holding the row's maximum
    return best_index.gather(-1, winner).squeeze(-1).to(torch.int64)
