"""The engine: Sequence, Scheduler (continuous batching), ModelRunner, and the vLLM-style `LLM` API
with its settings (`EngineConfig`) and its replaceable components (`EngineComponents`).

Names are imported on first use, so `python -m labkit.engine --help` answers without loading torch.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "labkit.engine.llm",
    "EngineConfig": "labkit.engine.config", "EngineComponents": "labkit.engine.components",
    "BeamSearchOutput": "labkit.engine.outputs", "BeamSearchSequence": "labkit.engine.outputs",
    "CompletionOutput": "labkit.engine.outputs", "RequestOutput": "labkit.engine.outputs",
    "EngineMetrics": "labkit.engine.metrics", "RequestMetrics": "labkit.engine.metrics",
    "ModelRunner": "labkit.engine.model_runner",
    "Scheduler": "labkit.engine.scheduler", "SchedulerConfig": "labkit.engine.scheduler",
    "SchedulerOutput": "labkit.engine.scheduler",
    "FinishReason": "labkit.engine.sequence", "Sequence": "labkit.engine.sequence",
    "SequenceStatus": "labkit.engine.sequence",
    "SpeculativeConfig": "labkit.engine.speculative",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'labkit.engine' has no attribute {name!r}")
