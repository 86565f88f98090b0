"""Stop strings (also spanning tokens), stop token ids, EOS and max_tokens, as the engine's finish reasons."""

import pytest

from labkit.sampling import FinishState, SamplingParams, StopMatch, check_stop, find_stop_string


def stream(pieces, params, eos_token_id=None):
    """Feed detokenized pieces one token at a time, as the engine does; return (tokens used, finish, text)."""
    text, tokens = "", []
    for token_id, piece in enumerate(pieces):
        tokens.append(token_id)
        text += piece
        finish = check_stop(params, tokens, text, len(piece), eos_token_id)
        if finish is not None:
            return len(tokens), finish, text if finish.text_end is None else text[: finish.text_end]
    return len(tokens), None, text


def test_a_stop_string_spanning_three_tokens_is_found_and_cut():
    pieces = ["Sure", ".\n", "\nUs", "er", ": more", " text"]
    used, finish, text = stream(pieces, SamplingParams(stop=["\n\nUser:"]))
    assert used == 5 and text == "Sure."
    assert finish == FinishState("stop", stop_reason="\n\nUser:", text_end=5)


def test_the_earliest_of_several_stop_strings_wins_even_inside_one_token():
    assert find_stop_string("abc END x STOP", ["STOP", "END"], num_new_chars=14) == StopMatch(4, "END")
    assert find_stop_string("no stop here", ["STOP"], num_new_chars=4) is None


def test_only_text_where_a_match_could_newly_end_is_searched():
    # "END" lies entirely in old text: it was (or would have been) found on an earlier step
    assert find_stop_string("END and more", ["END"], num_new_chars=5) is None
    assert find_stop_string("xxEN" + "D", ["END"], num_new_chars=1) == StopMatch(2, "END")
    with pytest.raises(ValueError, match="num_new_chars must be in"):
        find_stop_string("abc", ["b"], num_new_chars=4)


def test_eos_stop_token_ids_and_max_tokens():
    params = SamplingParams(max_tokens=3, stop_token_ids=[7])
    assert check_stop(params, [5, 2], "ab", 1, eos_token_id=2) == FinishState("stop")
    assert check_stop(SamplingParams(ignore_eos=True), [5, 2], "ab", 1, eos_token_id=2) is None
    assert check_stop(params, [5, 7], "ab", 1, eos_token_id=2) == FinishState("stop", stop_reason=7)
    assert check_stop(params, [5, 6, 8], "abc", 1, eos_token_id=2) == FinishState("length")
    assert check_stop(params, [5, 6], "ab", 1, eos_token_id=2) is None
    assert check_stop(params, [], "", 0, eos_token_id=2) is None


def test_a_stop_string_on_the_last_allowed_token_reports_stop_not_length():
    used, finish, text = stream(["a", "b", "STOP"], SamplingParams(max_tokens=3, stop=["STOP"]))
    assert finish.finish_reason == "stop" and text == "ab"
