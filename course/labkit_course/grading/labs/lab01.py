"""Lab 01: byte-pair encoding built by hand (pair counts, one merge, the training loop, encode)."""

import random
from collections import Counter

from labkit.tokenizer import Tokenizer, merge_pair, pair_counts, pretokenize, train
from labkit.tokenizer.bpe import learned_vocab
from labkit_course.data import JARGON_FILE, data_path
from labkit_course.grading import ExerciseFailed, exercise, raised_type, require
from labkit_course.grading.core import naming, seeded_random

_CORPUS = data_path(JARGON_FILE)


def _random_ids(rng: random.Random, length: int, alphabet: int = 4) -> list[int]:
    return [rng.randrange(alphabet) for _ in range(length)]


def _sample_text(start: int, size: int) -> str:
    with open(_CORPUS, encoding="utf-8") as f:
        return f.read()[start:start + size]


def _weighted_pair_counts(pieces: dict[tuple[int, ...], int], *, weighted=True, span=False, step=1, last=True,
                          reverse=False, once_per_piece=False) -> Counter:
    """Pair counts over distinct pieces, each weighted by its frequency; the switches make typical mistakes."""
    counts = Counter()
    if span:  # one long sequence: pairs run across the pieces' boundaries
        pieces = {tuple(i for piece, n in pieces.items() for _ in range(n) for i in piece): 1}
    for piece, freq in pieces.items():
        pairs = list(zip(piece[::step], piece[1::step], strict=False))
        if not last:
            pairs = pairs[:-1]
        if once_per_piece:
            pairs = list(dict.fromkeys(pairs))
        for a, b in pairs:
            counts[(b, a) if reverse else (a, b)] += freq if weighted else 1
    return counts


_PAIR_COUNT_MISTAKES = (
    (dict(weighted=False), "each distinct piece was counted once: a piece that occurs n times adds n to each of "
                           "its pairs (that is what the frequency is for)"),
    (dict(span=True), "pairs were counted across pieces: a pair never spans two pieces, count inside each one"),
    (dict(once_per_piece=True), "a pair that occurs twice in one piece was counted once: (5, 5, 5) holds (5, 5) "
                                "twice, so it adds 2 x its frequency"),
    (dict(last=False), "the last pair of each piece is missing: pairs run from (piece[0], piece[1]) to "
                       "(piece[-2], piece[-1])"),
    (dict(step=2), "pairs were counted without overlap (stepping by 2): count every adjacent pair, so (5, 5, 5) "
                   "holds (5, 5) twice"),
    (dict(reverse=True), "pairs are reversed: the key is (piece[i], piece[i + 1]), in reading order"),
)


def _piece_cases() -> list[dict[tuple[int, ...], int]]:
    rng = seeded_random(1)
    random_pieces = [{tuple(_random_ids(rng, rng.randrange(1, 7))): rng.randrange(1, 5) for _ in range(n)}
                     for n in (3, 8, 20)]
    return [{}, {(7,): 3}, {(5, 5, 5): 1}, {(5, 5, 5): 2, (1, 2): 4, (2, 1, 2): 1}, {(1, 2): 3, (3, 1): 2},
            *random_pieces]


@exercise("01", "get_pair_counts", forbidden=("labkit.tokenizer.pair_counts", "labkit.tokenizer.bpe.pair_counts"))
def get_pair_counts(ns):
    fn = require(ns, "get_pair_counts")
    cases = _piece_cases()
    answers = []
    for pieces in cases:
        given = dict(pieces)
        got = fn(given)
        if given != pieces:
            raise ExerciseFailed("get_pair_counts changed the pieces it was given: count, don't modify")
        if not isinstance(got, dict):
            raise ExerciseFailed(f"return a dict {{(a, b): count}}, got a {type(got).__name__}")
        got = {pair: count for pair, count in got.items() if count}
        if any(not (isinstance(k, tuple) and len(k) == 2) for k in got):
            raise ExerciseFailed(f"keys must be pairs (a, b) of adjacent ids, got keys like {next(iter(got))!r}")
        answers.append(got)
    if all(got == _weighted_pair_counts(pieces) for got, pieces in zip(answers, cases, strict=True)):
        return "counts every adjacent pair inside each piece, weighted by the piece's frequency"
    for mistake, why in _PAIR_COUNT_MISTAKES:  # named only if it explains every case
        if all(got == _weighted_pair_counts(pieces, **mistake) for got, pieces in zip(answers, cases, strict=True)):
            raise ExerciseFailed(why)
    got, pieces = next((got, pieces) for got, pieces in zip(answers, cases, strict=True)
                       if got != _weighted_pair_counts(pieces))
    raise ExerciseFailed(f"for pieces={pieces} expected {dict(_weighted_pair_counts(pieces))}, got {got}")


@exercise("01", "merge", forbidden=("labkit.tokenizer.merge_pair", "labkit.tokenizer.bpe.merge_pair"))
def merge(ns):
    fn = require(ns, "merge")
    rng = seeded_random(2)
    cases = [([1, 2, 3, 1, 2], (1, 2), 99), ([5, 5, 5], (5, 5), 9), ([1, 2], (2, 1), 9), ([], (1, 2), 9),
             ([12, 3, 1, 23], (2, 3), 99), ([104, 101, 108, 4, 101], (4, 101), 256)]  # digits of ids must not merge
    for _ in range(5):  # three ids, multi-digit ones among them, so pairs repeat
        alphabet = rng.sample(range(256), 3)
        ids = [alphabet[i] for i in _random_ids(rng, 25, 3)]
        cases.append((ids, (rng.choice(alphabet), rng.choice(alphabet)), 256))
    for ids, pair, new_id in cases:
        before = list(ids)
        got = fn(ids, pair, new_id)
        expected = merge_pair(before, pair, new_id)
        if ids != before:
            raise ExerciseFailed("merge changed the list it was given: build and return a new list")
        if not isinstance(got, list):
            raise ExerciseFailed(f"return a list of ids, got a {type(got).__name__}")
        if got == expected:
            continue
        if before.count(pair[0]) and got == _merge_first_only(before, pair, new_id):
            raise ExerciseFailed(f"only the first occurrence was merged in {before}: replace every occurrence")
        if got == _merge_without_skipping(before, pair, new_id):
            raise ExerciseFailed(f"merge({before}, {pair}, {new_id}) kept the second id of each merged pair: "
                                 f"after a merge, skip past both ids (expected {expected}, got {got})")
        if pair[0] != pair[1] and got == merge_pair(merge_pair(before, pair, new_id), pair[::-1], new_id):
            raise ExerciseFailed(f"merge({before}, {pair}, {new_id}) also merged the reversed pair "
                                 f"{pair[::-1]}: only (a, b) in that order")
        if len(got) == len(expected) - 1 and got == expected[:-1]:
            raise ExerciseFailed(f"the last id was dropped: merge({before}, {pair}, {new_id}) should be {expected}")
        if invented := sorted(set(got) - set(before) - {new_id}):
            raise ExerciseFailed(f"merge({before}, {pair}, {new_id}) should be {expected}, got {got}: ids {invented} "
                                 "are neither in the list nor new_id; compare whole ids, not their digits in a string")
        if before == [5, 5, 5]:
            raise ExerciseFailed(f"merge([5, 5, 5], (5, 5), 9) should be [9, 5] (left to right, no overlap), "
                                 f"got {got}")
        raise ExerciseFailed(f"merge({before}, {pair}, {new_id}) should be {expected}, got {got}")
    return "replaces every occurrence, left to right, without touching the input"


def _merge_without_skipping(ids, pair, new_id):
    return [new_id if (a, b) == pair else a for a, b in zip(ids, ids[1:], strict=False)] + ids[-1:]


def _merge_first_only(ids, pair, new_id):
    for i in range(len(ids) - 1):
        if (ids[i], ids[i + 1]) == pair:
            return ids[:i] + [new_id] + ids[i + 2:]
    return list(ids)


def _merges_as_list(merges) -> list[tuple[int, int]]:
    if not isinstance(merges, dict):
        raise ExerciseFailed(f"return a dict {{(a, b): new_id}}, got a {type(merges).__name__}")
    ordered = sorted(merges.items(), key=lambda item: item[1])
    ids = [new_id for _, new_id in ordered]
    if ids != list(range(256, 256 + len(ids))):
        raise ExerciseFailed(f"new ids must be 256, 257, ... in the order the merges were learned, got {ids[:6]}")
    return [tuple(pair) for pair, _ in ordered]


_TRAINING = ("labkit.tokenizer.train", "labkit.tokenizer.tokenizer.train", "labkit.tokenizer.train_merges",
             "labkit.tokenizer.bpe.train_merges")
# Not Tokenizer.encode itself: the grading runtime also flags any `.encode` attribute, and str.encode is
# how an answer starts. Tokenizer.encode goes through encode_piece, which trips.
_ENCODING = ("labkit.tokenizer.Tokenizer.encode_piece", "labkit.tokenizer.apply_merges",
             "labkit.tokenizer.bpe.apply_merges")


@exercise("01", "train_bpe", points=2, forbidden=_TRAINING)
def train_bpe(ns):
    fn = require(ns, "train_bpe")
    num_merges = 40
    _check_training(fn, _sample_text(30_000, 6_000), num_merges)
    _stops_when_pairs_run_out(fn)
    for text, asked in _small_corpora():
        with naming(f"train_bpe({text!r}, {asked})"):
            _check_training(fn, text, asked)
    return f"learns the same {num_merges} merges as labkit.tokenizer.train, and stops when no pair is left"


def _small_corpora() -> list[tuple[str, int]]:
    """Fresh corpora over a small alphabet (é is two bytes), so pairs repeat and merges build on merges. Every
    distinct word is a piece that ends as one token, so each corpus has more merges to give than are asked."""
    rng = seeded_random(103)
    corpora = []
    for distinct in (8, 12):
        words = set()
        while len(words) < distinct:
            words.add("".join(rng.choices("abcdé", k=rng.randint(2, 6))))
        words = sorted(words)
        text = words + rng.choices(words, weights=[1 / rank for rank in range(1, distinct + 1)], k=3 * distinct)
        rng.shuffle(text)
        corpora.append((" ".join(text), rng.randint(distinct // 2, distinct)))
    return corpora


def _check_training(fn, text, num_merges):
    learned = fn(text, num_merges)
    if isinstance(learned, dict) and len(learned) <= 1:
        raise ExerciseFailed(f"{len(learned)} distinct pair(s) learned in {num_merges} merges: the pieces must be "
                             "updated after each merge (the seed's bug: it re-encoded the text every time)")
    got = _merges_as_list(learned)
    expected = train(text, 256 + num_merges).merges
    if got == expected:
        return
    if len(got) != num_merges:
        raise ExerciseFailed(f"asked for {num_merges} merges, got {len(got)}")
    if got == _train_without_pretokenizing(text, num_merges):
        raise ExerciseFailed("pairs were counted across piece boundaries: count within each piece of "
                             "pretokenize(text), so no token spans a space before a word")
    unmade = next(((k, pair) for k, pair in enumerate(got) if max(pair) >= 256 + k), None)
    if unmade:
        k, pair = unmade
        raise ExerciseFailed(f"merge {k} is {pair}: id {max(pair)} is no byte and no earlier merge made it, so the "
                             "pieces were cut into characters (ord), not bytes; BPE starts from piece.encode('utf-8'), "
                             "ids 0-255")
    if got in (_train_unweighted(text, num_merges, ties) for ties in (min, max)):
        raise ExerciseFailed("each distinct piece was counted once: a piece that occurs n times adds n to each of its "
                             "pairs, so count the pieces with a Counter and weight the pair counts by it")
    first_wrong = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
    wrong, right = got[first_wrong], expected[first_wrong]
    counts = _counts_before(text, expected[:first_wrong])
    where = f"merge {first_wrong} (new id {256 + first_wrong}) should be {right}, got {wrong}"
    if wrong not in counts:
        raise ExerciseFailed(f"{where}, a pair that occurs nowhere in the pieces of pretokenize(text) after the "
                             "merges before it: check your pieces (each of pretokenize(text), spaces kept, as UTF-8 "
                             "bytes)")
    if counts[wrong] == counts[right]:
        raise ExerciseFailed(f"{where}: both occur {counts[right]} times, and ties go to the smaller pair")
    raise ExerciseFailed(f"{where}: in the pieces of pretokenize(text), {right} occurs {counts[right]} times, "
                         f"{wrong} {counts[wrong]}; the most frequent pair wins, so check your pieces and their "
                         "counts (each piece weighted by its frequency)")


def _counts_before(text, merges):
    """The weighted pair counts over pretokenize(text)'s pieces after `merges`, as labkit's training sees them."""
    pieces = Counter(tuple(piece.encode("utf-8")) for piece in pretokenize(text))
    for step, pair in enumerate(merges):
        pieces = Counter({tuple(merge_pair(list(piece), pair, 256 + step)): n for piece, n in pieces.items()})
    return _weighted_pair_counts(pieces)


def _stops_when_pairs_run_out(fn):
    """A short text has fewer merges to give than asked for: training must stop, not crash or invent pairs. In
    'ab cd' every pair occurs once, and is still merged while it is the most frequent one."""
    for text, asked in (("hello hello hello", 20), ("ab cd", 5)):
        _stops_after_every_merge(fn, text, asked)


def _stops_after_every_merge(fn, text, asked):
    expected = train(text, 256 + asked).merges
    try:
        got = fn(text, asked)
    except Exception as error:
        if raised_type(error) == "NotImplementedError":
            raise
        raise ExerciseFailed(f"train_bpe({text!r}, {asked}) raised {raised_type(error)}: after {len(expected)} "
                             "merges every piece is one token and no pair is left; stop early when the pair "
                             "counts are empty") from None
    got = _merges_as_list(got)
    if len(got) < len(expected) and got == expected[:len(got)]:
        raise ExerciseFailed(f"train_bpe({text!r}, {asked}) stopped after {len(got)} merges, with pairs left: a pair "
                             f"seen once is merged too when it is the most frequent, so it learns {len(expected)}; "
                             "stop only when no pair is left")
    if got != expected:
        raise ExerciseFailed(f"train_bpe({text!r}, {asked}) should learn {len(expected)} merges and stop (no pair "
                             f"is left after that), got {len(got)}")


def _train_unweighted(text, num_merges, ties):
    """Training over the distinct pieces, each counted once; ties to the smaller pair (min) or the first seen."""
    pieces, merges = list(dict.fromkeys(tuple(piece.encode("utf-8")) for piece in pretokenize(text))), []
    for step in range(num_merges):
        counts = Counter(pair for piece in pieces for pair in zip(piece, piece[1:], strict=False))
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair)) if ties is min else max(counts, key=counts.get)
        merges.append(best)
        pieces = [tuple(merge_pair(list(piece), best, 256 + step)) for piece in pieces]
    return merges


def _train_without_pretokenizing(text, num_merges):
    ids, merges = list(text.encode("utf-8")), []
    for step in range(num_merges):
        counts = pair_counts(ids)
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        ids = merge_pair(ids, best, 256 + step)
    return merges


@exercise("01", "bpe_encode", points=2, forbidden=_ENCODING)
def bpe_encode(ns):
    fn = require(ns, "bpe_encode")
    merges = train(_sample_text(0, 20_000), 256 + 120).merges  # learned from the corpus's first 20,000 characters
    merges_dict = {pair: 256 + rank for rank, pair in enumerate(merges)}
    reference = Tokenizer(learned_vocab(merges), merges, "gpt2")
    texts = ["", "a", "hello world", "naïve café 😀, 12345!!", "don'the  the   in", _sample_text(200_000, 600)]
    for text in texts:
        _check_encoding(fn, text, merges_dict, reference)
    for text in _unseen_texts():
        with naming(f"bpe_encode({text!r}, the {len(merges)} merges learned from {JARGON_FILE}[:20_000])"):
            _check_encoding(fn, text, merges_dict, reference)
    return "same ids as labkit's tokenizer with your merges"


def _unseen_texts() -> list[str]:
    """Fresh text the merges were not learned on: two passages of the corpus, and its words rejoined with runs of
    spaces, newlines, contractions and punctuation, where the piece boundaries fall differently."""
    rng = seeded_random(104)
    corpus = _sample_text(rng.randrange(20_000, 890_000), 60_000)
    passages = [corpus[offset:offset + rng.randint(60, 160)] for offset in (0, 30_000)]
    words = [word for word in corpus.split() if word.isalpha()]
    jumble = "".join(rng.choice(words) + rng.choice((" ", "  ", "\n", "'s ", ", ", "!! ", " 42 ")) for _ in range(14))
    return [*passages, jumble]


def _check_encoding(fn, text, merges_dict, reference):
    got = fn(text, dict(merges_dict))
    expected = reference.encode(text)
    if not isinstance(got, list):
        raise ExerciseFailed(f"return a list of ids, got a {type(got).__name__}")
    if got == expected:
        return
    if got == list(text.encode("utf-8")):
        raise ExerciseFailed("no merge was applied: the ids are just the UTF-8 bytes")
    for mistaken_encode, why in _ENCODE_MISTAKES:
        if got == mistaken_encode(text, merges_dict):
            raise ExerciseFailed(why)
    at = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
              min(len(got), len(expected)))
    if at == len(got):
        raise ExerciseFailed(f"bpe_encode({text[:40]!r}...) gave {len(got)} ids, expected {len(expected)}: the "
                             f"first {at} are right, then yours stop (next expected: {expected[at:at + 6]})")
    raise ExerciseFailed(f"bpe_encode({text[:40]!r}...) differs from labkit's at position {at} (of "
                         f"{len(expected)} ids): expected ...{expected[max(at - 2, 0):at + 6]}..., got "
                         f"...{got[max(at - 2, 0):at + 6]}...")


def _encode_without_pretokenizing(text, merges_dict):
    ids = list(text.encode("utf-8"))
    for pair, new_id in merges_dict.items():
        ids = merge_pair(ids, pair, new_id)
    return ids


def _encode_latest_first(text, merges_dict):
    out = []
    for piece in pretokenize(text):
        ids = list(piece.encode("utf-8"))
        for pair, new_id in reversed(merges_dict.items()):
            ids = merge_pair(ids, pair, new_id)
        out.extend(ids)
    return out


def _encode_by_frequency(text, merges_dict):
    """Each step merges the known pair that is most frequent over the whole text (the training rule, misapplied)."""
    pieces = [list(piece.encode("utf-8")) for piece in pretokenize(text)]
    while True:
        counts = Counter(pair for ids in pieces for pair in zip(ids, ids[1:], strict=False) if pair in merges_dict)
        if not counts:
            break
        pair = counts.most_common(1)[0][0]
        pieces = [merge_pair(ids, pair, merges_dict[pair]) for ids in pieces]
    return [i for ids in pieces for i in ids]


def _encode_leftmost_first(text, merges_dict):
    out = []
    for piece in pretokenize(text):
        ids = list(piece.encode("utf-8"))
        while (at := next((i for i in range(len(ids) - 1) if (ids[i], ids[i + 1]) in merges_dict), None)) is not None:
            ids = ids[:at] + [merges_dict[ids[at], ids[at + 1]]] + ids[at + 2:]
        out.extend(ids)
    return out


_ENCODE_MISTAKES = (  # wrong bpe_encode(text, merges_dict)s, each with what it gets wrong
    (_encode_without_pretokenizing, "merges were applied across piece boundaries: encode each piece of "
                                    "pretokenize(text) on its own, as in training"),
    (_encode_latest_first, "the latest-learned merges were applied first: apply the earliest-learned merge first "
                           "(the lowest new id), as training did"),
    (_encode_by_frequency, "merges were chosen by how often a pair occurs in this text: apply the earliest-learned "
                           "merge first (the lowest new id), as training did"),
    (_encode_leftmost_first, "the leftmost mergeable pair of each piece was merged first: apply the "
                             "earliest-learned merge first (the lowest new id) wherever it is, as training did"),
)


@exercise("01", "knowledge_check")
def knowledge_check(ns):
    from labkit_course.grading.quiz import Choice, Number, grade_answers, smollm2_config, smollm2_tokenizer

    hidden = smollm2_config().hidden_size
    return grade_answers(ns, {
        1: Choice("b", "Exercise 4 (encoding replays training's order)"),
        2: Number(len(merge_pair([5] * 5, (5, 5), 9)), "Exercise 2: left to right, without overlaps"),
        3: Number(len(smollm2_tokenizer().encode("The capital of France is")),
                  "section 5, and encode the prompt yourself"),
        4: Number(2 * 7 * hidden, "section 6: E has shape [B, S, D]"),
        5: Choice("b", "the paragraph after *Text to Tensors*' pipeline (§1.3)"),
    })
