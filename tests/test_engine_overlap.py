"""Overlapped steps (`async_scheduling=True`, labkit/engine/overlap.py): the same outputs as synchronous
steps, whatever the requests ask for, under preemption, interrupts and aborts, and no caller ever sees
a placeholder token.

The oracle is the same engine run synchronously: greedy and seeded requests must give the same tokens,
text, finish reasons and logprobs. A tiny random-weights Llama keeps it fast; on a CPU it runs the
fused C step, the fast path an overlapped decode goes through.
"""

import pytest
import torch
from engine_support import (
    Interrupter,
    assert_no_leak,
    engine,
    prompt,
    step_through_interrupts,
)

from labkit.engine import EngineConfig, FinishReason, SpeculativeConfig
from labkit.engine.model_runner import fill_placeholders
from labkit.engine.overlap import OverlappedSteps, placeholder
from labkit.sampling import SamplingParams


def summary(outputs):
    """Everything a caller sees of each sample, for comparing two runs."""
    return [[(s.token_ids, s.text, s.finish_reason, s.stop_reason, s.logprobs, s.cumulative_logprob)
             for s in o.outputs] for o in outputs]


class CountingRuns:
    """Counts the overlapped steps an engine launches, and those whose launch failed."""

    def __init__(self, llm, monkeypatch):
        self.calls, self.failed, run = 0, 0, llm._overlap.run

        def counted(out):
            self.calls += 1
            result = run(out)
            self.failed += result is None
            return result

        monkeypatch.setattr(llm._overlap, "run", counted)


def stop_settings(tiny, prompts):
    """A stop token and a stop string that greedy decoding of prompts[0] and [1] reaches mid-output."""
    probe = engine(tiny).generate(prompts[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return probe[0].token_ids[5], probe[1].text[len(probe[1].text) // 2:][:3]


def plain_requests(tiny):
    """Requests that overlap: greedy, seeded draws through every filter, stop tokens and strings."""
    prompts = [prompt(i, 3 + 2 * i) for i in range(8)]
    stop_token, stop_text = stop_settings(tiny, prompts)
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token], ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, stop=[stop_text], ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=15),
              SamplingParams(temperature=1.0, top_k=20, seed=2, max_tokens=9, stop=["e"]),
              SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=1),
              SamplingParams(temperature=0, max_tokens=20),
              SamplingParams(temperature=1.2, seed=4, max_tokens=17, n=2),
              SamplingParams(temperature=0.9, seed=5, max_tokens=6, include_stop_str_in_output=True, stop=["a"])]
    return prompts, params


def mixed_requests(tiny):
    """Requests that cannot overlap (logprobs, penalties, min_tokens, prompt logprobs) first, then the
    plain ones: while one of the first runs, or a request waits, every step is synchronous."""
    prompts, params = plain_requests(tiny)
    return [prompt(20, 9), prompt(21, 4), prompt(22, 7)] + prompts, [
        SamplingParams(temperature=0.8, seed=6, max_tokens=5, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3),
        SamplingParams(temperature=0.6, seed=7, max_tokens=12, min_tokens=10)] + params


@pytest.mark.parametrize(("requests", "overlapped"), [(plain_requests, 10), (mixed_requests, 3)],
                         ids=["plain", "mixed"])
def test_overlapped_steps_give_the_synchronous_outputs(tiny, monkeypatch, requests, overlapped):
    prompts, params = requests(tiny)
    expected = summary(engine(tiny, max_num_seqs=6).generate(prompts, params))
    llm = engine(tiny, max_num_seqs=6, async_scheduling=True)
    runs = CountingRuns(llm, monkeypatch)
    outputs = llm.generate(prompts, params)
    assert summary(outputs) == expected
    assert runs.calls >= overlapped, "the steps did not overlap"
    finished = {s.finish_reason for o in outputs for s in o.outputs}
    assert {FinishReason.STOP, FinishReason.MAX_TOKENS} <= finished
    assert llm.metrics.num_generated_tokens == sum(len(s.token_ids) for o in outputs for s in o.outputs)
    assert_no_leak(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_cache_too_small_for_the_batch_preempts_between_overlapped_steps(tiny, monkeypatch, mode):
    prompts = [prompt(i, 4 + i % 9) for i in range(12)]
    params = [SamplingParams(temperature=0.5 if i % 2 else 0, seed=i, max_tokens=10 + i % 7, ignore_eos=True)
              for i in range(12)]
    expected = summary(engine(tiny).generate(prompts, params))
    llm = engine(tiny, num_kvcache_blocks=10, max_num_seqs=8, preemption_mode=mode, async_scheduling=True)
    runs = CountingRuns(llm, monkeypatch)
    assert summary(llm.generate(prompts, params)) == expected
    assert runs.calls > 0 and llm.metrics.num_preemptions + llm.metrics.num_swaps > 0
    assert_no_leak(llm)


def test_callers_never_see_a_placeholder_and_requests_come_and_go(tiny):
    """Requests added between steps, read while in flight, and aborted: every output holds real tokens,
    a request's text so far is where its final text starts, and an abort loses nothing else."""
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    prompts = [prompt(i, 5 + i) for i in range(6)]
    expected = summary(engine(tiny).generate(prompts, params))
    llm = engine(tiny, async_scheduling=True)
    ids = [llm.add_request(prompts[0], params), llm.add_request(prompts[1], params)]
    seen, outputs, aborted = {}, {}, None
    for step in range(60):
        if step in (3, 5, 9, 11):
            ids.append(llm.add_request(prompts[len(ids)], params))
        if step == 7:
            aborted = ids[1]
            llm.abort(aborted)
        if step == 8:
            llm.abort(llm.add_request(prompts[5], params))  # aborted while waiting
        for i in ids:
            if i in llm._requests:
                now = llm.request_output(i).outputs[0]
                assert all(t >= 0 for t in now.token_ids)
                seen.setdefault(i, []).append((now.token_ids, now.text))
        outputs.update((o.request_id, o) for o in llm.step())
        if not llm.has_unfinished_requests():
            break
    assert set(outputs) == set(ids) - {aborted}
    for n, i in enumerate(ids):
        if i == aborted:
            continue
        assert summary([outputs[i]]) == [expected[n]]
        final = outputs[i].outputs[0]
        assert all(final.token_ids[:len(t)] == t and final.text.startswith(x) for t, x in seen[i])
    assert_no_leak(llm)


def test_requests_that_end_by_length_batch_as_in_synchronous_steps(tiny, monkeypatch):
    """A sequence whose placeholder reaches max_tokens or max_model_len sits the next step out: every
    step batches the same sequences as a synchronous run (no thrown-away rows)."""
    prompts = [prompt(i, 3 + 5 * i) for i in range(7)]
    params = [SamplingParams(temperature=0.5 * (i % 2), seed=i, max_tokens=3 + 4 * i, ignore_eos=True)
              for i in range(7)]
    batches, outputs = {}, {}
    for overlapped in (False, True):
        llm = engine(tiny, max_model_len=40, async_scheduling=overlapped)
        forward, batches[overlapped] = llm.runner.forward, []

        def recorded(seqs, num_new_tokens, *args, forward=forward, batches=batches[overlapped], **kwargs):
            batches.append(sorted(seq.seq_id for seq in seqs))  # both engines number the requests from 0
            return forward(seqs, num_new_tokens, *args, **kwargs)

        monkeypatch.setattr(llm.runner, "forward", recorded)
        outputs[overlapped] = summary(llm.generate(prompts, params))
        assert_no_leak(llm)
    assert outputs[True] == outputs[False]
    assert {reason for [(_, _, reason, *_)] in outputs[True]} == {FinishReason.MAX_TOKENS}
    assert batches[True] == batches[False]


def test_a_second_ctrl_c_while_generate_cleans_up_waits_for_the_cleanup(tiny, monkeypatch):
    """Ctrl-C stops generate; a second one during its cleanup (which waits for the step in flight) is held
    until the cleanup is done, so none of the call's requests stays queued or claimed."""
    import os
    import signal

    llm = engine(tiny, async_scheduling=True)
    resolve, calls = llm._overlap.resolve, [0]

    def interrupted(*args):
        calls[0] += 1
        if calls[0] == 4:  # a step of generate: the first Ctrl-C
            raise KeyboardInterrupt
        if calls[0] == 5:  # generate's cleanup resolves before aborting: the second Ctrl-C, a real signal
            os.kill(os.getpid(), signal.SIGINT)
        return resolve(*args)

    monkeypatch.setattr(llm._overlap, "resolve", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt(1, 5), prompt(2, 6)], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert calls[0] >= 5
    assert_no_leak(llm)


def test_stream_with_overlapped_steps_yields_the_generated_text_without_waiting_for_each_step(tiny, monkeypatch):
    """A stream reads what is on the host: its text comes a step late, and the steps keep overlapping."""
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=16, stop=["ou"])
    expected = engine(tiny).generate(prompt(3), params)[0].text
    llm = engine(tiny, async_scheduling=True)
    run, in_flight = llm._overlap.run, []
    monkeypatch.setattr(llm._overlap, "run", lambda out: in_flight.append(llm._overlap.pending is not None) or run(out))
    other = llm.add_request(prompt(4), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    pieces = list(llm.stream(prompt(3), params))
    assert "".join(pieces) == expected and len(pieces) > 3
    assert sum(in_flight) >= 8  # launched while the step before was still in flight
    llm.abort(other)
    assert_no_leak(llm)


def test_a_request_whose_overlapped_step_fails_is_finished_with_an_error_and_the_batch_goes_on(tiny, monkeypatch):
    """The launch fails: the step runs synchronously, whose isolation finds the one request at fault."""
    bad_prompt = prompt(7)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=9, ignore_eos=True)
    results = {}
    for overlapped in (False, True):
        llm = engine(tiny, async_scheduling=overlapped)
        sample = llm.runner.sample_on_device

        def failing(logits, seqs, eos_token_id=None, sample=sample):
            if any(seq.prompt_token_ids == bad_prompt and seq.num_output_tokens >= 3 for seq in seqs):
                raise RuntimeError("this row overflowed")
            return sample(logits, seqs, eos_token_id)

        monkeypatch.setattr(llm.runner, "sample_on_device", failing)
        runs = CountingRuns(llm, monkeypatch) if overlapped else None
        with pytest.warns(UserWarning) as warned:
            results[overlapped] = summary(llm.generate([prompt(6), bad_prompt, prompt(8)], params))
        messages = [str(w.message) for w in warned]
        assert any("request 1 failed" in m for m in messages)
        assert any("overlapped step failed to launch" in m for m in messages) == overlapped
        assert runs is None or runs.failed == 1
        assert_no_leak(llm)
    assert results[True] == results[False]
    [[(_, _, reason, message, _, _)]] = results[True][1:2]
    assert reason is FinishReason.ERROR and "this row overflowed" in message


POINTS = {  # where, in an overlapped step, the interrupt lands: (object, method, every how many calls)
    "schedule": lambda llm: (llm.scheduler, "schedule", 3),
    "forward": lambda llm: (llm.runner, "forward", 3),
    "after forward": lambda llm: (llm.runner, "forward", 3),
    "after sampling": lambda llm: (llm.runner, "sample_on_device", 3),
    "resolving": lambda llm: (llm.output_processor, "append", 7),
    "after resolving one": lambda llm: (llm.output_processor, "append", 7),
    "postprocess": lambda llm: (llm.scheduler, "postprocess", 3),
    "after postprocess": lambda llm: (llm.scheduler, "postprocess", 3),
}


@pytest.mark.parametrize("point", POINTS)
def test_an_interrupt_anywhere_in_an_overlapped_step_loses_and_repeats_nothing(tiny, monkeypatch, point):
    prompts = [prompt(i, 5 + 3 * i) for i in range(4)]
    params = [SamplingParams(temperature=0.6 * (i % 2), seed=i, max_tokens=9 + 2 * i, ignore_eos=True)
              for i in range(4)]
    expected = summary(engine(tiny).generate(prompts, params))
    llm = engine(tiny, async_scheduling=True)
    runs = CountingRuns(llm, monkeypatch)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    owner, name, every = POINTS[point](llm)
    interrupter = Interrupter(getattr(owner, name), every, after=point.startswith("after"))
    monkeypatch.setattr(owner, name, interrupter)
    outputs = step_through_interrupts(llm, max_steps=200)
    assert interrupter.fired >= 2 and runs.calls > 0
    assert summary([outputs[i] for i in ids]) == expected
    assert_no_leak(llm)


def test_soak_of_overlapped_steps_with_bursts_preemption_interrupts_reads_and_aborts(tiny, monkeypatch):
    """Requests arrive in bursts with quiet stretches (when steps overlap), through a cache small enough
    to preempt, with interrupts at random points, reads of requests in flight and random aborts. Every
    request not aborted gives the tokens of a synchronous run; nothing is left behind."""
    import random

    rng = random.Random(5)
    requests = [(prompt(rng.randrange(1000), rng.randint(1, 20)),
                 SamplingParams(temperature=rng.choice([0, 0.8]), seed=i, max_tokens=rng.randint(1, 40),
                                ignore_eos=True)) for i in range(120)]
    expected = summary(engine(tiny, num_kvcache_blocks=256, max_num_seqs=64).generate(
        [p for p, _ in requests], [sp for _, sp in requests]))
    for mode in ("recompute", "swap"):
        llm = engine(tiny, num_kvcache_blocks=24, max_num_seqs=16, max_num_batched_tokens=64, preemption_mode=mode,
                     async_scheduling=True)
        runs = CountingRuns(llm, monkeypatch)
        for owner, name in [(llm.runner, "forward"), (llm._overlap, "run"), (llm.scheduler, "postprocess"),
                            (llm.output_processor, "append")]:
            monkeypatch.setattr(owner, name, Interrupter(getattr(owner, name), every=rng.randint(9, 17),
                                                         after=rng.random() < 0.5))
        waiting, ids, outputs, aborted, steps = list(enumerate(requests)), {}, {}, set(), 0
        while waiting or llm.has_unfinished_requests():
            steps += 1
            assert steps < 3000, "the soak stopped making progress"
            if rng.random() < 0.05:
                for _ in range(rng.randint(1, 6)):
                    if waiting:
                        i, (p, sp) = waiting.pop(0)
                        ids[llm.add_request(p, sp)] = i
            try:  # reading or aborting a request resolves the step in flight: the interrupts land there too
                if llm._requests and rng.random() < 0.1:
                    read = llm.request_output(rng.choice(list(llm._requests)))
                    assert all(t >= 0 for t in read.outputs[0].token_ids)
                if llm._requests and rng.random() < 0.02:
                    victim = rng.choice(list(llm._requests))
                    llm.abort(victim)
                    aborted.add(victim)
                outputs.update((o.request_id, o) for o in llm.step())
            except KeyboardInterrupt:
                pass
        monkeypatch.undo()
        assert runs.calls > 200 and llm.metrics.num_preemptions + llm.metrics.num_swaps > 0
        assert set(outputs) | aborted == set(ids)
        for request_id, out in outputs.items():
            assert request_id not in aborted and summary([out]) == [expected[ids[request_id]]], request_id
        assert_no_leak(llm)


def test_fill_placeholders_takes_each_placeholders_row_of_the_pending_tokens():
    ids = torch.tensor([5, placeholder(2), 0, placeholder(0), 7])
    assert fill_placeholders(ids, torch.tensor([11, 12, 13])).tolist() == [5, 13, 0, 11, 7]


def test_only_requests_whose_sampling_needs_nothing_from_the_host_overlap():
    from labkit.engine.sequence import Sequence

    def overlaps(**kwargs):
        return OverlappedSteps.overlaps(Sequence([1, 2, 3], SamplingParams(**kwargs)))

    assert overlaps(temperature=0.7, top_k=5, top_p=0.9, seed=1, stop=["x"], max_tokens=4)
    for kwargs in [dict(logprobs=1), dict(prompt_logprobs=0), dict(presence_penalty=0.5),
                   dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[3]), dict(min_tokens=2), dict(n=2)]:
        assert not overlaps(**kwargs), kwargs


def test_async_scheduling_refuses_what_it_cannot_run_with():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, speculative=SpeculativeConfig("ngram", num_speculative_tokens=2))
    with pytest.raises(TypeError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")
