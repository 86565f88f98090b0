"""The output processor (labkit/engine/output_processor.py): a request without stop strings is
detokenized only when its text is asked for or when it finishes, and its text is the one a
token-by-token detokenizer gives; a request with stop strings is detokenized each step and stops
where its stop string begins; `request_output` mid-generation returns the text so far."""

import pytest
from engine_support import assert_no_leak

from labkit.engine import LLM, FinishReason
from labkit.sampling import SamplingParams
from labkit.tokenizer import IncrementalDetokenizer

PROMPT = [100, 200, 300, 400, 500]


def engine(tiny):
    model, tokenizer = tiny
    return LLM(model, tokenizer=tokenizer, block_size=8, num_kvcache_blocks=32)


def token_by_token(tokenizer, token_ids, final=True) -> str:
    """The text as the engine made it before the output processor: one push per token."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    text = "".join(detokenizer.push(t) for t in token_ids)
    return text + detokenizer.flush() if final else text


@pytest.fixture
def pushes(monkeypatch):
    """Every IncrementalDetokenizer.push the engine makes, as the list of token ids it was given."""
    calls, push = [], IncrementalDetokenizer.push

    def counted(detokenizer, token_ids):
        calls.append(token_ids)
        return push(detokenizer, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "push", counted)
    return calls


def test_text_with_and_without_stop_strings_is_the_token_by_token_text(tiny, pushes):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = engine(tiny)
    plain = llm.generate(PROMPT, greedy)[0]
    assert len(pushes) == 1, "a request without stop strings is detokenized once, when it finishes"
    assert plain.text == token_by_token(tiny[1], plain.token_ids) and len(plain.text) > 12
    stop = plain.text[6:9]
    start, before = plain.text.index(stop), len(pushes)
    stopped = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert (stopped.finish_reason, stopped.stop_reason) == (FinishReason.STOP, stop)
    assert stopped.text == plain.text[:start]
    assert len(pushes) - before == len(stopped.token_ids), "stop strings are looked for in each step's text"
    assert token_by_token(tiny[1], stopped.token_ids, final=False).startswith(stopped.text + stop)
    assert_no_leak(llm)


@pytest.mark.parametrize("stop", [[], ["never in this text"]], ids=["no-stop-strings", "stop-strings"])
def test_request_output_mid_generation_has_the_text_so_far(tiny, pushes, stop):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop)
    expected = engine(tiny).generate(PROMPT, params)[0]
    llm = engine(tiny)
    request = llm.add_request(PROMPT, params)
    for _ in range(6):
        llm.step()
    so_far = llm.request_output(request)
    assert not so_far.finished and 0 < len(so_far.token_ids) < 16
    assert so_far.token_ids == expected.token_ids[:len(so_far.token_ids)]
    assert so_far.text == token_by_token(tiny[1], so_far.token_ids, final=False)
    assert llm.request_output(request).text == so_far.text  # asking again detokenizes nothing twice
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert [(o.text, o.token_ids, o.finish_reason) for o in outputs] == [
        (expected.text, expected.token_ids, expected.finish_reason)]
    assert_no_leak(llm)
