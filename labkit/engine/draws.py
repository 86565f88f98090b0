"""A step's draws: the model runs over the scheduled batch and every sequence due a token draws one,
a request whose step fails isolated from the others.

This half of a step lives apart from llm.py's loop because it is the half that may fail and must be
repeatable: it changes nothing but the K/V it computes and prompt logprobs, so when the batch fails
each sequence can run again alone to find whose fault it was. `LLM._run_step` appends what it drew.
"""

from collections.abc import Iterator

from labkit.engine import samples
from labkit.engine.output_processor import OutputProcessor
from labkit.engine.scheduler import SchedulerOutput
from labkit.engine.sequence import Sequence


class StepDrawer:
    """Draws an engine's tokens: its runner runs and samples, its output processor keeps the logprobs,
    its scheduler finishes a failed request, and the new samples a request forks take ids from `ids`."""

    def __init__(self, runner, output_processor: OutputProcessor, scheduler, eos_token_id: int | None,
                 ids: Iterator[int]):
        self.runner, self.output_processor, self.scheduler = runner, output_processor, scheduler
        self.eos_token_id, self.ids = eos_token_id, ids

    def draw_isolated(self, out: SchedulerOutput) -> list[samples.Draw]:
        """The step's draws (see `draw`). If the batch fails, each scheduled sequence runs alone:
        a request whose step fails by itself finishes with reason ERROR (its error as stop_reason),
        all its samples with it, and the others go on; if every one of several fails, the engine is
        at fault and it raises."""
        try:
            return self.draw(out.seqs, out.num_new_tokens)
        except Exception as batch_error:
            draws, failures = [], {}
            for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
                try:
                    draws += self.draw([seq], [n])
                except Exception as error:  # noqa: BLE001 - isolate it; its output carries the message
                    failures[seq] = error
            if len(failures) == len(out.seqs) > 1:
                raise batch_error
            for seq, error in failures.items():
                samples.fail(self.scheduler, seq, f"{type(error).__name__}: {error}")
            return [d for d in draws if not (d.forked_from or d.seq).is_finished]  # not a failed request's

    def draw(self, seqs: list[Sequence], num_new_tokens: list[int]) -> list[samples.Draw]:
        """Run the model over `seqs` and sample the next token of each that is due one, and the first
        token of each new sample a request forks now (samples.who_draws). Changes nothing but the K/V
        it computes and prompt logprobs (positions already recorded are skipped), so a failed or
        interrupted call can simply be repeated."""
        forward = self.runner.forward(seqs, num_new_tokens)
        self.output_processor.add_prompt_logprobs(forward.prompt_logits)
        drawn, parents, rows = samples.who_draws(forward.sampled_seqs, self.ids)
        if not drawn:
            return []
        logits = forward.logits if len(rows) == len(forward.sampled_seqs) else forward.logits[rows]
        tokens = self.runner.sample(logits, drawn, self.eos_token_id)
        logprobs = self.output_processor.sampled_logprobs(logits, drawn, tokens)
        return [samples.Draw(*draw) for draw in zip(drawn, tokens, logprobs, parents, strict=True)]
