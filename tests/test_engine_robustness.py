"""The engine under every caller: whose outputs are whose, interrupts at every point of a step, a
request whose step fails, bounded metrics, and a seeded soak with preemption, interrupts and aborts.

A tiny random-weights Llama (SmolLM2's vocabulary, so its tokenizer detokenizes the outputs) keeps
this fast; the oracle is the same engine run without interference: greedy outputs must be equal.
"""

import random
import time

import numpy as np
import pytest
import torch
from engine_support import (
    Interrupter,
    assert_no_leak,
    engine,
    prompt,
    step_through_interrupts,
)

from labkit.engine import LLM, FinishReason
from labkit.sampling import SamplingParams


def greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)




def alone(tiny, prompts, params):
    """Each prompt run by itself on a fresh engine: the reference outputs."""
    return [engine(tiny).generate(p, sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]


# --- whose outputs are whose ------------------------------------------------------------------
def test_generate_collects_only_its_own_requests_and_keeps_the_others(tiny):
    llm = engine(tiny)
    hello = llm.add_request("Hello", greedy(10))
    a, b = prompt(1), prompt(2, 9)
    outputs = llm.generate([a, b], greedy(10))
    assert [o.finish_reason for o in outputs] == [FinishReason.MAX_TOKENS] * 2
    assert [o.token_ids for o in outputs] == alone(tiny, [a, b], [greedy(10)] * 2)
    assert llm.has_unfinished_requests()  # Hello finished during generate(); its output waits for step()
    kept = llm.step()
    assert [o.request_id for o in kept] == [hello]
    assert kept[0].token_ids == engine(tiny).generate("Hello", greedy(10))[0].token_ids
    assert llm.step() == []
    assert_no_leak(llm)


def test_stream_yields_its_last_text_when_another_callers_step_finishes_it(tiny):
    llm = engine(tiny)
    full = engine(tiny).generate(prompt(3), greedy(4))[0].text
    stream = llm.stream(prompt(3), greedy(4))
    first = next(stream)
    llm.generate(prompt(4), greedy(12))  # its steps finish the streamed request
    assert first + "".join(stream) == full
    assert_no_leak(llm)


def test_an_abort_during_another_callers_generate_is_not_reported_as_finished(tiny):
    llm = engine(tiny)
    mine = llm.add_request(prompt(5), greedy(10))
    other = llm.add_request(prompt(6), greedy(2))
    llm.step()
    llm.abort(mine)  # as in vLLM, whoever aborts gets no output for it
    llm.generate(prompt(7), greedy(3))  # finishes `other` on the way
    assert [o.request_id for o in llm.step()] == [other]
    assert llm.metrics.finished[0].num_output_tokens == 1  # mine, aborted after its first token
    assert_no_leak(llm)


# --- one bad request --------------------------------------------------------------------------
def test_a_request_whose_step_fails_is_finished_with_an_error_and_the_batch_goes_on(tiny):
    llm = engine(tiny)
    bad = SamplingParams(temperature=1.0, max_tokens=5, seed=1)
    object.__setattr__(bad, "top_k", 10**30)  # a value validation would refuse, smuggled past it
    with pytest.warns(UserWarning, match="request .* failed"):
        good_out, bad_out = llm.generate([prompt(6), prompt(7)], [greedy(8), bad])
    assert good_out.token_ids == alone(tiny, [prompt(6)], [greedy(8)])[0]
    assert bad_out.finish_reason is FinishReason.ERROR and "Overflow" in bad_out.stop_reason
    assert llm.generate(prompt(6), greedy(8))[0].token_ids == good_out.token_ids  # the engine goes on
    assert_no_leak(llm)


def test_a_failure_of_every_request_is_the_engines_and_is_raised(tiny, monkeypatch):
    llm = engine(tiny)

    def broken(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.runner, "forward", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate([prompt(1), prompt(2)], greedy(3))
    monkeypatch.undo()
    assert_no_leak(llm)  # generate() aborted its requests on the way out


# --- interrupts -------------------------------------------------------------------------------
POINTS = {  # where, in one step, the interrupt lands: (object, method, every how many calls)
    "schedule": lambda llm: (llm.scheduler, "schedule", 3),
    "block allocation": lambda llm: (llm.block_manager, "append", 7),
    "forward": lambda llm: (llm.runner, "forward", 3),
    "after forward": lambda llm: (llm.runner, "forward", 3),
    "sampling": lambda llm: (llm.runner, "sample", 3),
    "after sampling": lambda llm: (llm.runner, "sample", 3),
    "between appends": lambda llm: (llm.output_processor, "append", 7),
    "after an append": lambda llm: (llm.output_processor, "append", 7),
    "postprocess": lambda llm: (llm.scheduler, "postprocess", 3),
    "after postprocess": lambda llm: (llm.scheduler, "postprocess", 3),
    "collecting outputs": lambda llm: (llm, "_finalize", 2),
}


@pytest.mark.parametrize("point", POINTS)
def test_an_interrupt_anywhere_in_a_step_loses_and_repeats_nothing(tiny, monkeypatch, point):
    prompts = [prompt(i, 5 + 3 * i) for i in range(4)]
    params = [greedy(6 + i) for i in range(4)]
    expected = alone(tiny, prompts, params)
    llm = engine(tiny, max_num_batched_tokens=16)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    owner, name, every = POINTS[point](llm)
    interrupter = Interrupter(getattr(owner, name), every, after=point.startswith("after"))
    monkeypatch.setattr(owner, name, interrupter)
    outputs = step_through_interrupts(llm, max_steps=200)
    assert interrupter.fired >= 2
    assert [outputs[i].token_ids for i in ids] == expected
    assert all(outputs[i].finish_reason is FinishReason.MAX_TOKENS for i in ids)
    assert_no_leak(llm)


@pytest.mark.parametrize("stop", [[], ["never in this text"]], ids=["detokenized-at-the-end", "detokenized-each-step"])
def test_an_interrupted_detokenization_is_undone(tiny, monkeypatch, stop):
    """The detokenizer or the stop check raising after the detokenizer took tokens: no token may be
    pushed twice, whether the text is made each step (stop strings) or when the request finishes."""
    import labkit.engine.output_processor as output_processor
    from labkit.tokenizer import IncrementalDetokenizer

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop)
    text = engine(tiny).generate("Hello", params)[0].text
    llm = engine(tiny)
    monkeypatch.setattr(output_processor, "check_stop", Interrupter(output_processor.check_stop, every=2))
    push, pushes = IncrementalDetokenizer.push, []

    def push_then_interrupt(detokenizer, token_ids):  # the first push and every other one take, then raise
        piece = push(detokenizer, token_ids)
        pushes.append(token_ids)
        if len(pushes) % 2 == 1:
            raise KeyboardInterrupt
        return piece

    monkeypatch.setattr(IncrementalDetokenizer, "push", push_then_interrupt)
    request = llm.add_request("Hello", params)
    outputs = []
    while llm.has_unfinished_requests():
        try:
            outputs += llm.step()
        except KeyboardInterrupt:
            pass
    assert len(pushes) >= 2, "an interrupted push was repeated"
    assert [o.request_id for o in outputs] == [request] and outputs[0].text == text
    assert_no_leak(llm)


def test_an_interrupted_generate_leaves_the_engine_clean(tiny, monkeypatch):
    llm = engine(tiny)
    monkeypatch.setattr(llm.runner, "forward", Interrupter(llm.runner.forward, every=3))
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt(1), prompt(2)], greedy(8))
    monkeypatch.undo()
    assert_no_leak(llm)


def test_ctrl_c_during_a_step_takes_effect_when_the_step_is_done(tiny, monkeypatch):
    """A real SIGINT (the notebook's interrupt) lands where a step has taken a request off the waiting
    queue but not yet put it in the running one: the step finishes first, then KeyboardInterrupt, and
    nothing is lost (without the deferral the request was in no queue, forever unfinished)."""
    import os
    import signal

    llm = engine(tiny)
    take, sent = llm.scheduler._take, []
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a process started in the background

    def interrupted(*args, **kwargs):
        if not sent:  # one Ctrl-C, raised at the next bytecode: between the two queues
            sent.append(os.kill(os.getpid(), signal.SIGINT))
        return take(*args, **kwargs)

    ids = [llm.add_request(prompt(i), greedy(1)) for i in range(2)]
    monkeypatch.setattr(llm.scheduler, "_take", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is before, "the handler is put back"
    outputs = llm.step()  # the interrupted step finished both requests; their outputs waited
    assert sorted(o.request_id for o in outputs) == ids and not llm.has_unfinished_requests()
    assert [o.outputs[0].token_ids for o in sorted(outputs, key=lambda o: o.request_id)] == \
        alone(tiny, [prompt(0), prompt(1)], [greedy(1)] * 2)
    assert_no_leak(llm)


def test_a_second_ctrl_c_stops_a_step_that_never_ends(tiny, monkeypatch):
    import os
    import signal

    llm = engine(tiny)

    def endless(*args, **kwargs):  # a part stuck in a loop: the first Ctrl-C waits for a step that never ends
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        while True:
            time.sleep(0.01)

    llm.add_request(prompt(0), greedy(1))
    monkeypatch.setattr(llm.runner, "forward", endless)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    assert signal.getsignal(signal.SIGINT) is before


# --- inputs -----------------------------------------------------------------------------------
def test_numpy_token_ids_are_prompts_and_floats_or_bools_are_not(tiny):
    llm = engine(tiny)
    ids = prompt(8)
    expected = llm.generate(ids, greedy(4))[0].token_ids
    assert llm.generate(np.array(ids), greedy(4))[0].token_ids == expected
    assert llm.generate([np.int64(t) for t in ids], greedy(4))[0].token_ids == expected
    assert [o.token_ids for o in llm.generate([np.array(ids, dtype=np.int32), ids], greedy(4))] == [expected] * 2
    with pytest.raises(TypeError, match="token ids must be integers.*float"):
        llm.generate(np.array(ids, dtype=np.float32), greedy(4))
    with pytest.raises(TypeError, match="token ids must be integers.*bool"):
        llm.generate([[True, False]], greedy(4))
    with pytest.raises(TypeError, match="one-dimensional"):
        llm.generate(np.array([ids, ids]), greedy(4))
    assert_no_leak(llm)


def test_chat_takes_one_conversation_or_a_batch_and_names_a_lone_message(tiny):
    llm = engine(tiny)
    message = {"role": "user", "content": "Hi"}
    one = llm.chat([message], greedy(3))
    batch = llm.chat([[message], [message, {"role": "assistant", "content": "Hello"}, message]], greedy(3))
    assert len(one) == 1 and len(batch) == 2 and batch[0].token_ids == one[0].token_ids
    with pytest.raises(TypeError, match="a single message.*wrap it in a list"):
        llm.chat(message, greedy(3))
    with pytest.raises(TypeError, match="'role' and 'content'"):
        llm.chat([{"role": "user"}], greedy(3))
    with pytest.raises(TypeError, match="list of messages"):
        llm.chat("Hi", greedy(3))
    assert_no_leak(llm)


@pytest.mark.parametrize("path", ["", "  ", None])
def test_an_empty_model_path_is_refused(path):
    with pytest.raises((ValueError, TypeError), match="model"):
        LLM(path)


def test_metrics_keep_aggregates_and_a_bounded_window(tiny):
    llm = engine(tiny)
    window = llm.metrics.finished.maxlen
    assert window is not None
    for _ in range(3):
        llm.generate([prompt(i, 2) for i in range(window // 2 + 1)], greedy(2))
    m = llm.metrics
    assert m.num_finished == 3 * (window // 2 + 1) > len(m.finished) == window
    assert m.mean_ttft > 0 and m.mean_tpot > 0
    assert f"{m.num_finished} requests" in m.summary()


# --- soak -------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["synchronous", "async-scheduling"])
def test_soak_with_preemption_interrupts_and_aborts_loses_and_leaks_nothing(tiny, monkeypatch, async_scheduling):
    """A few hundred small requests through a cache that forces preemption, with interrupts landing
    at random points of steps and random aborts, with steps synchronous or overlapped. Every request
    that was not aborted must give the greedy tokens it gives alone; nothing may be left behind.
    Bounded in steps (seconds on a CPU)."""
    rng = random.Random(12)
    requests = [(prompt(rng.randrange(1000), rng.randint(1, 24)), greedy(rng.randint(1, 12)),
                 rng.choice([0, 0, 0, 1, -1])) for _ in range(300)]
    reference = engine(tiny, num_kvcache_blocks=256, max_num_seqs=64, max_num_batched_tokens=512)
    expected = [o.token_ids for o in reference.generate([p for p, _, _ in requests], [sp for _, sp, _ in requests])]

    for mode in ("recompute", "swap"):
        llm = engine(tiny, num_kvcache_blocks=12, max_num_seqs=8, max_num_batched_tokens=24, preemption_mode=mode,
                     async_scheduling=async_scheduling)
        wrapped = [(llm.runner, "forward"), (llm.scheduler, "postprocess"), (llm.output_processor, "append")]
        if async_scheduling:
            wrapped.append((llm._overlap, "run"))  # counts the overlapped steps too
        for owner, name in wrapped:
            monkeypatch.setattr(owner, name, Interrupter(getattr(owner, name), every=rng.randint(7, 13),
                                                         after=rng.random() < 0.5))
        overlapped = llm._overlap.run if async_scheduling else None
        pending, ids, outputs, aborted, steps = list(enumerate(requests)), {}, {}, set(), 0
        while pending or llm.has_unfinished_requests():
            steps += 1
            assert steps < 3000, "the soak stopped making progress"
            for _ in range(rng.randint(0, 4)):
                if pending:
                    i, (p, sp, priority) = pending.pop(0)
                    ids[llm.add_request(p, sp, priority=priority)] = i
            if llm._requests and rng.random() < 0.03:
                victim = rng.choice(list(llm._requests))
                llm.abort(victim)
                aborted.add(victim)
            try:
                outputs.update((o.request_id, o) for o in llm.step())
            except KeyboardInterrupt:
                pass
        monkeypatch.undo()
        assert overlapped is None or overlapped.calls > 0, "the steps did not overlap"
        assert set(outputs) | aborted == set(ids)
        assert llm.metrics.num_preemptions + llm.metrics.num_swaps > 0
        for request_id, out in outputs.items():
            assert request_id not in aborted and out.token_ids == expected[ids[request_id]], request_id
        assert_no_leak(llm)



def test_a_tiny_temperature_samples_like_greedy_instead_of_overflowing(tiny):
    with pytest.warns(UserWarning, match="below 0.01"):
        tiny_temperature = SamplingParams(temperature=1e-38, max_tokens=8, seed=0, ignore_eos=True)
    llm = engine(tiny)
    assert llm.generate(prompt(9), tiny_temperature)[0].token_ids == llm.generate(prompt(9), greedy(8))[0].token_ids


# --- n samples (fork, copy-on-write) under every caller -----------------------------------------
def sampled(max_tokens, n=3, seed=5):
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, n=n, seed=seed)


def samples_of(output):
    return [c.token_ids for c in output.outputs]


def test_an_n3_request_keeps_its_samples_when_another_request_in_the_batch_fails(tiny):
    llm = engine(tiny)
    bad = SamplingParams(temperature=1.0, max_tokens=5, seed=1)
    object.__setattr__(bad, "top_k", 10**30)  # smuggled past validation: its sampling overflows
    with pytest.warns(UserWarning, match="request .* failed"):
        group_out, bad_out = llm.generate([prompt(6, 11), prompt(7)], [sampled(7), bad])
    assert samples_of(group_out) == samples_of(engine(tiny).generate(prompt(6, 11), sampled(7))[0])
    assert [c.index for c in group_out.outputs] == [0, 1, 2]
    assert all(c.finish_reason is FinishReason.MAX_TOKENS for c in group_out.outputs)
    assert bad_out.finish_reason is FinishReason.ERROR and len(bad_out.outputs) == 1
    assert_no_leak(llm)


def test_a_failing_n3_request_finishes_all_its_samples_with_an_error_and_the_others_go_on(tiny):
    llm = engine(tiny)
    bad = SamplingParams(temperature=1.0, max_tokens=5, n=3)  # no seed: its samples share these params
    object.__setattr__(bad, "top_k", 10**30)
    with pytest.warns(UserWarning, match="request .* failed"):
        good_out, bad_out = llm.generate([prompt(6), prompt(7)], [greedy(8), bad])
    assert good_out.token_ids == alone(tiny, [prompt(6)], [greedy(8)])[0]
    assert bad_out.finished and bad_out.outputs
    assert all(c.finish_reason is FinishReason.ERROR and "Overflow" in c.stop_reason for c in bad_out.outputs)
    assert_no_leak(llm)


def test_generate_with_n2_returns_only_its_own_outputs(tiny):
    llm = engine(tiny)
    other = llm.add_request(prompt(2, 10), sampled(9, n=2, seed=3))
    mine = llm.generate(prompt(1, 10), sampled(4, n=2, seed=4))
    assert len(mine) == 1 and len(mine[0].outputs) == 2
    assert samples_of(mine[0]) == samples_of(engine(tiny).generate(prompt(1, 10), sampled(4, n=2, seed=4))[0])
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert [o.request_id for o in outputs] == [other]
    assert samples_of(outputs[0]) == samples_of(engine(tiny).generate(prompt(2, 10), sampled(9, n=2, seed=3))[0])
    assert_no_leak(llm)


FORK_POINTS = {  # interrupts around forking a request's samples and drawing their first tokens
    "forking a sample": lambda llm: (llm.scheduler, "fork", 2),
    "after forking a sample": lambda llm: (llm.scheduler, "fork", 2),
    "sampling": lambda llm: (llm.runner, "sample", 2),
    "between appends": lambda llm: (llm.output_processor, "append", 3),
    "after an append": lambda llm: (llm.output_processor, "append", 3),
    "copy-on-write": lambda llm: (llm.storage, "copy_blocks", 2),
    "after copy-on-write": lambda llm: (llm.storage, "copy_blocks", 2),
    # the samples recompute their prompt and first token together, sharing the prompt's blocks
    "before the fork step's postprocess": lambda llm: (llm.scheduler, "postprocess", 2),
}


@pytest.mark.parametrize("point", FORK_POINTS)
def test_an_interrupt_while_forking_samples_loses_and_repeats_nothing(tiny, monkeypatch, point):
    """Seeded samples are a function of (seed + index, step): an interrupted engine must give each
    sample the tokens an undisturbed one gives, and leave no block or sequence behind."""
    prompts = [prompt(i, 7 + 4 * i) for i in range(3)]
    params = [sampled(5 + i, n=3, seed=10 * i) for i in range(3)]
    expected = [samples_of(engine(tiny).generate(p, sp)[0]) for p, sp in zip(prompts, params, strict=True)]
    llm = engine(tiny, max_num_batched_tokens=16)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    owner, name, every = FORK_POINTS[point](llm)
    interrupter = Interrupter(getattr(owner, name), every, after=point.startswith("after"))
    monkeypatch.setattr(owner, name, interrupter)
    outputs = step_through_interrupts(llm, max_steps=300)
    assert interrupter.fired >= 1
    assert [samples_of(outputs[i]) for i in ids] == expected
    assert_no_leak(llm)


# --- requests the engine refuses, and limits it keeps (issue 33) --------------------------------
def test_a_request_with_nothing_left_to_sample_is_refused_not_sampled_from_a_masked_row(tiny):
    llm = engine(tiny)
    eos = llm.eos_token_id
    with pytest.raises(ValueError, match=r"logit_bias must be .* in \[-100, 100\]"):
        SamplingParams(allowed_token_ids=[5], logit_bias={7: 1e300})  # float32 inf: inf - inf is NaN
    with pytest.raises(ValueError, match="all EOS or stop tokens, which min_tokens=3 masks"):
        llm.generate("Hi", SamplingParams(allowed_token_ids=[eos], min_tokens=3))
    with pytest.raises(ValueError, match="all EOS or stop tokens"):
        llm.add_request("Hi", SamplingParams(allowed_token_ids=[9, 11], stop_token_ids=[9, 11], min_tokens=1))
    # Allowed by themselves once min_tokens is reached or EOS is not masked: those run.
    assert llm.generate("Hi", SamplingParams(allowed_token_ids=[eos], min_tokens=3, ignore_eos=True,
                                             max_tokens=4))[0].token_ids == [eos] * 4
    # The sampler itself refuses a row with no finite entry, whoever built it: the request fails alone.
    from labkit.sampling.sampler import NothingToSample, Sampler, SamplingMetadata
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, allowed_token_ids=[3])]
    metadata = SamplingMetadata.from_requests(params, [[1], [1]], [[], []], vocab_size=8)
    logits = torch.zeros(2, 8)
    assert Sampler()(logits, metadata).tolist() == [0, 3]
    metadata = SamplingMetadata.from_requests(params, [[1], [1]], [[], []], vocab_size=8)
    object.__setattr__(metadata, "logit_offsets", metadata.logit_offsets.index_fill(1, torch.tensor([3]),
                                                                                    float("-inf")))
    with pytest.raises(NothingToSample, match=r"row\(s\) \[1\]"):
        Sampler()(logits, metadata)
    assert_no_leak(llm)


def test_max_num_seqs_counts_every_sample_of_an_n_request(tiny):
    """Four n=4 requests under max_num_seqs=4: one request (its 4 samples) runs at a time, not 16 sequences."""
    llm = engine(tiny, max_num_seqs=4, num_kvcache_blocks=128)
    for i in range(4):
        llm.add_request(prompt(i), SamplingParams(n=4, seed=i, max_tokens=6, ignore_eos=True))
    most, finished = 0, []
    while llm.has_unfinished_requests():
        finished += llm.step()
        most = max(most, len(llm.scheduler.running))
    assert most == 4 and len(finished) == 4 and all(len(o.outputs) == 4 for o in finished)
    assert_no_leak(llm)


def test_max_model_len_beyond_the_models_positions_is_refused(tiny):
    with pytest.raises(ValueError, match="max_model_len=513 is beyond the model's 512 positions"):
        engine(tiny, max_model_len=513)
    assert engine(tiny, max_model_len=512).scheduler.config.max_model_len == 512


def test_chat_refuses_the_roles_the_server_refuses_and_takes_developer_as_system(tiny):
    llm = engine(tiny)
    for role in ("tool", "function", "ipython", None):
        with pytest.raises(ValueError, match="role must be one of system, developer, user, assistant"):
            llm.chat([{"role": role, "content": "Hi"}], greedy(3))
    with pytest.raises(ValueError, match="content a str"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], greedy(3))
    developer = llm.chat([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}], greedy(3))
    system = llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], greedy(3))
    assert developer[0].prompt_token_ids == system[0].prompt_token_ids
    assert_no_leak(llm)


def test_any_integral_priority_is_taken(tiny):
    llm = engine(tiny)
    for priority in (np.int64(3), np.int32(-1), 2):
        assert llm.generate(prompt(0), greedy(2), priority=priority)[0].token_ids
    for priority in (True, 1.0, np.float64(2), "1"):
        with pytest.raises(TypeError, match="priority must be an integer"):
            llm.add_request(prompt(0), greedy(2), priority=priority)
    assert_no_leak(llm)


def test_generate_takes_no_semaphore_for_a_progress_bar_it_does_not_show(tiny, monkeypatch, capsys):
    """Even a disabled tqdm bar takes a multiprocessing lock, a named semaphore that a process killed
    before it exits (a grading worker) leaks; generate makes its bar only when it shows one."""
    import multiprocessing

    import tqdm
    made = []
    rlock = multiprocessing.RLock
    monkeypatch.setattr(multiprocessing, "RLock", lambda *args, **kwargs: made.append(1) or rlock(*args, **kwargs))
    monkeypatch.delattr(tqdm.tqdm, "_lock", raising=False)  # tqdm's lock, made afresh when next asked for
    monkeypatch.delattr(tqdm.std.TqdmDefaultWriteLock, "mp_lock", raising=False)
    llm = engine(tiny)
    llm.generate([prompt(0), prompt(1)], greedy(2), use_tqdm=False)
    assert made == []
    llm.generate([prompt(0), prompt(1)], greedy(2), use_tqdm=True)
    assert "generate: 100%" in capsys.readouterr().err and made  # a shown bar still draws (and locks)
    assert_no_leak(llm)
