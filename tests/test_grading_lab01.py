"""The Lab 01 graders accept a correct answer and name the mistake in each typical wrong one."""

from collections import Counter
from itertools import pairwise

import pytest

from labkit.grading import ExerciseFailed, check
from labkit.tokenizer import pretokenize


def get_pair_counts(ids):
    counts = {}
    for pair in pairwise(ids):
        counts[pair] = counts.get(pair, 0) + 1
    return counts


def merge(ids, pair, new_id):
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def train_bpe(text, num_merges):
    pieces = [list(piece.encode("utf-8")) for piece in pretokenize(text)]
    merges = {}
    for step in range(num_merges):
        counts = Counter()
        for ids in pieces:
            counts.update(get_pair_counts(ids))
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        merges[pair] = 256 + step
        pieces = [merge(ids, pair, 256 + step) for ids in pieces]
    return merges


def encode(text, merges):
    out = []
    for piece in pretokenize(text):
        ids = list(piece.encode("utf-8"))
        while len(ids) > 1:
            pair = min(pairwise(ids), key=lambda p: merges.get(p, float("inf")))
            if pair not in merges:
                break
            ids = merge(ids, pair, merges[pair])
        out.extend(ids)
    return out


CORRECT = {"get_pair_counts": get_pair_counts, "merge": merge, "train_bpe": train_bpe, "encode": encode}


def not_implemented(*args):
    raise NotImplementedError()


def namespace(**overrides):
    return {**CORRECT, **overrides}


@pytest.mark.parametrize("name", list(CORRECT))
def test_correct_answers_pass(name, capsys):
    check("01", name, namespace())
    assert capsys.readouterr().out.startswith(f"✔ {name}:")


@pytest.mark.parametrize("name", list(CORRECT))
def test_unimplemented_and_missing(name):
    with pytest.raises(ExerciseFailed, match="not implemented yet"):
        check("01", name, namespace(**{name: not_implemented}))
    with pytest.raises(ExerciseFailed, match=f"`{name}` is not defined"):
        check("01", name, {k: v for k, v in CORRECT.items() if k != name})


def _seed_style_training(text, num_merges):
    """The seed's loop: counts on a fresh copy of the bytes each time, so nothing is ever merged."""
    merges = {}
    for step in range(num_merges):
        pair = Counter(pairwise(text.encode())).most_common(1)[0][0]
        merges[pair] = 256 + step
    return merges


def _train_on_raw_bytes(text, num_merges):
    ids, merges = list(text.encode()), {}
    for step in range(num_merges):
        counts = get_pair_counts(ids)
        pair = min(counts, key=lambda p: (-counts[p], p))
        merges[pair] = 256 + step
        ids = merge(ids, pair, 256 + step)
    return merges


def _train_ties_to_first_seen(text, num_merges):
    pieces = [list(p.encode()) for p in pretokenize(text)]
    merges = {}
    for step in range(num_merges):
        counts = Counter()
        for ids in pieces:
            counts.update(get_pair_counts(ids))
        pair = max(counts, key=counts.get)
        merges[pair] = 256 + step
        pieces = [merge(ids, pair, 256 + step) for ids in pieces]
    return merges


def _encode_all_text_at_once(text, merges):
    ids = list(text.encode())
    for pair, new_id in sorted(merges.items(), key=lambda item: item[1]):
        ids = merge(ids, pair, new_id)
    return ids


def _encode_by_frequency(text, merges):
    out = []
    for piece in pretokenize(text):
        ids = list(piece.encode())
        while True:
            counts = Counter({p: c for p, c in get_pair_counts(ids).items() if p in merges})
            if not counts:
                break
            pair = counts.most_common(1)[0][0]
            ids = merge(ids, pair, merges[pair])
        out.extend(ids)
    return out


def _merge_in_place(ids, pair, new_id):
    i = 0
    while i < len(ids) - 1:
        if (ids[i], ids[i + 1]) == pair:
            ids[i:i + 2] = [new_id]
        i += 1
    return ids


def _merge_first_only(ids, pair, new_id):
    for i in range(len(ids) - 1):
        if (ids[i], ids[i + 1]) == pair:
            return ids[:i] + [new_id] + ids[i + 2:]
    return list(ids)


def _merge_dropping_last(ids, pair, new_id):
    out, i = [], 0
    while i < len(ids) - 1:
        if (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


WRONG = [
    ("get_pair_counts", lambda ids: Counter(pairwise(ids[:-1])), "the last pair is missing"),
    ("get_pair_counts", lambda ids: Counter(ids), "keys must be pairs"),
    ("get_pair_counts", lambda ids: list(pairwise(ids)), "return a dict"),
    ("merge", _merge_in_place, "changed the list it was given"),
    ("merge", _merge_first_only, "only the first occurrence was merged"),
    ("merge", _merge_dropping_last, "the last id was dropped"),
    ("train_bpe", _seed_style_training, "the seed's bug"),
    ("train_bpe", _train_on_raw_bytes, "counted across piece boundaries"),
    ("train_bpe", _train_ties_to_first_seen, "ties going to the smaller pair"),
    ("train_bpe", lambda text, n: [(1, 2)] * n, "return a dict"),
    ("encode", lambda text, merges: list(text.encode()), "no merge was applied"),
    ("encode", _encode_all_text_at_once, "applied across piece boundaries"),
    ("encode", _encode_by_frequency, "earliest-learned merge first"),
]


@pytest.mark.parametrize("name, wrong, words", WRONG, ids=[w[2] for w in WRONG])
def test_typical_mistakes_are_named(name, wrong, words):
    with pytest.raises(ExerciseFailed, match=words):
        check("01", name, namespace(**{name: wrong}))
