"""Contiguous KV caches: one sequence (or a batch of equal-length ones) per cache.

`KVCache` is the book's cache (§10.2): every step concatenates the new K/V rows onto the old ones,
which copies the whole history each time. `PreallocatedKVCache` reserves [max_seq_len] rows up
front and writes in place, as production engines do before they go paged. Both are attention
backends: the model hands them each layer's new q/k/v, they append k/v and attend over everything
stored so far.
"""

import torch

from labkit.attention.dense import causal_attention
from labkit.attention.metadata import AttentionMetadata


class _ContiguousCache:
    """What both caches share: turning the flat batch into [B, H, n, D] and attending."""

    num_layers: int

    def length(self, layer: int) -> int:
        """Tokens already stored for `layer`."""
        raise NotImplementedError

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Append k_new, v_new [B, H_kv, n, D]; return all stored K, V [B, H_kv, cached + n, D]."""
        raise NotImplementedError

    @property
    def seq_len(self) -> int:
        """Tokens stored per sequence (every layer holds the same count between model steps)."""
        return self.length(self.num_layers - 1)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range: this cache has {self.num_layers} layers")
        B, T = meta.num_seqs, q.shape[0]
        new_lens = meta.cu_seqlens_q.diff()
        if int(meta.cu_seqlens_q[-1]) != T or bool((new_lens != new_lens[0]).any()):
            raise ValueError(f"a contiguous KV cache needs equal-length sequences covering all {T} tokens, "
                             f"got new-token counts {new_lens.tolist()}")
        n, cached = T // B, self.length(layer)
        if bool((meta.context_lens != cached + n).any()):
            raise ValueError(f"metadata says contexts of {meta.context_lens.tolist()} tokens, but the cache "
                             f"holds {cached} and the step adds {n}")

        def batched(x):  # [B*n, H, D] -> [B, H, n, D]
            return x.view(B, n, x.shape[1], x.shape[2]).transpose(1, 2)

        k_all, v_all = self.update(layer, batched(k), batched(v))
        out = causal_attention(batched(q), k_all, v_all)
        return out.transpose(1, 2).reshape(q.shape)


class KVCache(_ContiguousCache):
    """The book's cache: per layer, K and V grow by torch.cat along the sequence dimension."""

    def __init__(self, num_layers: int):
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
        self.num_layers = num_layers
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def length(self, layer: int) -> int:
        return 0 if self.keys[layer] is None else self.keys[layer].shape[2]

    def update(self, layer, k_new, v_new):
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k_new, v_new
        else:
            if k_new.shape[0] != self.keys[layer].shape[0]:
                raise ValueError(f"batch size changed from {self.keys[layer].shape[0]} to {k_new.shape[0]}")
            self.keys[layer] = torch.cat([self.keys[layer], k_new], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v_new], dim=2)
        return self.keys[layer], self.values[layer]

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored K and V tensors."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)


class PreallocatedKVCache(_ContiguousCache):
    """K/V storage [layers, batch, kv_heads, max_seq_len, head_dim] allocated once, filled in place."""

    def __init__(self, num_layers: int, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size), ("max_seq_len", max_seq_len),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_layers, self.max_seq_len = num_layers, max_seq_len
        shape = (num_layers, batch_size, num_kv_heads, max_seq_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * num_layers

    @classmethod
    def for_model(cls, model, batch_size: int = 1, max_seq_len: int | None = None) -> "PreallocatedKVCache":
        """A cache shaped for `model`; max_seq_len defaults to the model's context length."""
        c = model.config
        return cls(c.num_layers, batch_size, max_seq_len or c.max_position_embeddings, c.num_kv_heads,
                   c.head_dim, dtype=model.dtype, device=model.device)

    def length(self, layer: int) -> int:
        return self.lengths[layer]

    def update(self, layer, k_new, v_new):
        if k_new.shape[0] != self.keys.shape[1]:
            raise ValueError(f"this cache was allocated for batch size {self.keys.shape[1]}, got {k_new.shape[0]}")
        start, end = self.lengths[layer], self.lengths[layer] + k_new.shape[2]
        if end > self.max_seq_len:
            raise ValueError(f"KV cache full: {start} tokens stored, {k_new.shape[2]} more do not fit "
                             f"in max_seq_len={self.max_seq_len}")
        self.keys[layer, :, :, start:end] = k_new
        self.values[layer, :, :, start:end] = v_new
        self.lengths[layer] = end
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    @property
    def nbytes(self) -> int:
        """Bytes reserved, whether filled or not."""
        return 2 * self.keys.numel() * self.keys.element_size()
