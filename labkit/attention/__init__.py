"""Attention: the per-step metadata the model passes down, reference implementations and kernels."""

from labkit.attention.metadata import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata"]
