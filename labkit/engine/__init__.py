"""The engine: Sequence, Scheduler (continuous batching), ModelRunner, and the vLLM-style `LLM` API."""

from labkit.engine.llm import LLM
from labkit.engine.metrics import EngineMetrics, RequestMetrics
from labkit.engine.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from labkit.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from labkit.engine.sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchSequence", "CompletionOutput", "EngineMetrics", "FinishReason",
           "RequestMetrics", "RequestOutput", "Scheduler", "SchedulerConfig", "SchedulerOutput", "Sequence",
           "SequenceStatus"]
