"""The engine: Sequence, Scheduler (continuous batching), ModelRunner, and the vLLM-style `LLM` API."""

from labkit.engine.llm import LLM, RequestOutput
from labkit.engine.metrics import EngineMetrics, RequestMetrics
from labkit.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from labkit.engine.sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["LLM", "EngineMetrics", "FinishReason", "RequestMetrics", "RequestOutput", "Scheduler",
           "SchedulerConfig", "SchedulerOutput", "Sequence", "SequenceStatus"]
