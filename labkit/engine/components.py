"""`EngineComponents`: the public hook through which the engine's block manager, scheduler and model
runner can be replaced.

    LLM("smollm2", components=EngineComponents(scheduler=MyScheduler))

Each field is a factory (a class, or any callable) called as labkit's own class is, and returning
an object that does what labkit's does (usually a subclass of it that overrides a few methods):

| field           | called as                                                    | labkit's own   |
| --------------- | ------------------------------------------------------------ | -------------- |
| `block_manager` | `(num_blocks, block_size, enable_prefix_caching=...)`        | `BlockManager` |
| `scheduler`     | `(scheduler_config, block_manager, kv_storage)`              | `Scheduler`    |
| `model_runner`  | `(model, storage, attention_backend, fast_path)`             | `ModelRunner`  |

The methods a subclass overrides to change one decision, each public and documented where it is defined:

- `BlockManager`: `prefix_hits` (which cached blocks a prompt reuses), `take_free_block` (which free
  block new content goes into: the eviction policy), `can_append`, and `allocate` / `append` / `swap_in`
  around which a subclass may wrap its own bookkeeping (it reads `blocks`, `hash_to_block`,
  `free_uncached` and `free_cached`, the pool's state);
- `Scheduler`: `schedule` (one step's plan) and `admit_waiting` (which waiting requests join it, through
  `admit`, `chunk_size`, `order` and `uses_prefix_cache`);
- `ModelRunner`: `prepare` (one step's tensors, `flatten_step` by default, handed on to `step_inputs`)
  and `sampler` (a `Sampler` whose `filter` may be replaced).

The course plugs students' functions in this way (`labkit_course.engine_parts`); the engine itself
knows nothing of who passes what.
"""

import dataclasses
from collections.abc import Callable

from labkit.cache.block_manager import BlockManager
from labkit.engine.model_runner import ModelRunner
from labkit.engine.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class EngineComponents:
    """Factories for the engine's block manager, scheduler and model runner; labkit's own by default."""

    block_manager: Callable[..., BlockManager] = BlockManager
    scheduler: Callable[..., Scheduler] = Scheduler
    model_runner: Callable[..., ModelRunner] = ModelRunner

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if not callable(getattr(self, field.name)):
                raise TypeError(f"EngineComponents.{field.name} must be a class or callable that builds the "
                                f"engine's {field.name}, got {getattr(self, field.name)!r}")

