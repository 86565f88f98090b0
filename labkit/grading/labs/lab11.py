"""Lab 11: the full engine. Its knowledge check computes one step's inputs with labkit's ModelRunner."""

from labkit.grading import exercise


@exercise("11", "knowledge_check")
def knowledge_check(ns):
    from types import SimpleNamespace

    import torch

    from labkit.cache.paged_storage import PagedKVStorage
    from labkit.engine import Sequence
    from labkit.engine.model_runner import ModelRunner
    from labkit.grading.quiz import Choice, Number, grade_answers
    from labkit.sampling import SamplingParams

    block_size = 8
    decoding = Sequence(list(range(100, 118)), SamplingParams())  # 17 tokens cached, the 18th is new
    decoding.block_table, decoding.num_cached_tokens = [5, 2, 9], 17
    prefilling = Sequence(list(range(200, 212)), SamplingParams())  # a 12-token prompt, first chunk of 6
    prefilling.block_table, prefilling.num_cached_tokens = [0, 1], 0
    storage = PagedKVStorage(1, 10, block_size, 1, 4)
    runner = ModelRunner(SimpleNamespace(device=torch.device("cpu")), storage, backend=None)
    step = runner.prepare([decoding, prefilling], [1, 6])
    return grade_answers(ns, {
        1: Number(len(step.input_ids), "'Inside generate: the step loop' and the diagram: one row per new token"),
        2: Number(len(step.sample_rows), "the diagram: which sequences' rows reach their last token"),
        3: Number(int(step.meta.slot_mapping[0]), "Lab 08 section 2: block_table[t // B] * B + t % B"),
        4: Choice("b", "the finish reasons after the first `generate`"),
        5: Choice("a", "'The prefix cache pays off at the first token'"),
    })
