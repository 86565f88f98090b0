"""Lab 01: byte-pair encoding by hand (pair counts, one merge, training, encoding)."""

from collections import Counter, defaultdict
from itertools import pairwise

from catalogue import Right, Wrong
from labkit.tokenizer import apply_merges, merge_pair, pair_counts, pretokenize, train

# ---- correct answers, in different styles

def pair_counts_dict(pieces):
    """dict.get over itertools.pairwise, piece by piece."""
    counts = {}
    for piece, freq in pieces.items():
        for pair in pairwise(piece):
            counts[pair] = counts.get(pair, 0) + freq
    return counts


def pair_counts_indexed(pieces):
    """An index loop into a defaultdict."""
    counts = defaultdict(int)
    for piece, freq in pieces.items():
        for i in range(len(piece) - 1):
            counts[piece[i], piece[i + 1]] += freq
    return counts


def pair_counts_scaled(pieces):
    """Counter per piece, scaled by its frequency, then summed."""
    total = Counter()
    for piece, freq in pieces.items():
        total.update({pair: n * freq for pair, n in Counter(zip(piece, piece[1:], strict=False)).items()})
    return total


def pair_counts_with(pieces, *, pairs_of=pairwise, weighted=True):
    """Weighted counts where `pairs_of(piece)` lists a piece's pairs; the switches make typical mistakes."""
    counts = Counter()
    for piece, freq in pieces.items():
        for pair in pairs_of(piece):
            counts[pair] += freq if weighted else 1
    return counts


def pair_counts_concatenated(pieces):
    """Every occurrence of every piece laid end to end: pairs span the pieces."""
    return Counter(pairwise([i for piece, freq in pieces.items() for _ in range(freq) for i in piece]))


def merge_while(ids, pair, new_id):
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def merge_skip_flag(ids, pair, new_id):
    out, skip = [], False
    for i, token in enumerate(ids):
        if skip:
            skip = False
        elif i + 1 < len(ids) and (token, ids[i + 1]) == pair:
            out.append(new_id)
            skip = True
        else:
            out.append(token)
    return out


def train_recount(text, num_merges):
    pieces = [list(piece.encode("utf-8")) for piece in pretokenize(text)]
    merges = {}
    for step in range(num_merges):
        counts = Counter()
        for ids in pieces:
            counts.update(pairwise(ids))
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        merges[pair] = 256 + step
        pieces = [merge_while(ids, pair, 256 + step) for ids in pieces]
    return merges


def train_without_early_stop(text, num_merges, *, pick="min"):
    """The solution's loop without `if not counts: break`: it crashes once every piece is one token."""
    pieces = Counter(tuple(piece.encode("utf-8")) for piece in pretokenize(text))
    merges = {}
    for step in range(num_merges):
        counts = pair_counts_dict(pieces)
        if pick == "min":
            pair = min(counts, key=lambda p: (-counts[p], p))
        else:
            best = Counter(counts).most_common()
            pair = min(p for p, c in best if c == best[0][1])
        merges[pair] = 256 + step
        pieces = Counter({tuple(merge_while(list(ids), pair, 256 + step)): n for ids, n in pieces.items()})
    return merges


def train_with_placeholder_merges(text, num_merges):
    """Keeps going when no pair is left, recording a made-up pair to reach num_merges."""
    merges = train_recount(text, num_merges)
    while len(merges) < num_merges:
        merges[(0, len(merges))] = 256 + len(merges)
    return merges


def train_by_word_counts(text, num_merges):
    words = Counter(tuple(piece.encode("utf-8")) for piece in pretokenize(text))
    merges = {}
    for step in range(num_merges):
        counts = Counter()
        for word, n in words.items():
            for pair in pairwise(word):
                counts[pair] += n
        if not counts:
            break
        best = max(counts.values())
        pair = min(p for p, c in counts.items() if c == best)
        merges[pair] = 256 + step
        words = Counter({tuple(merge_skip_flag(list(w), pair, 256 + step)): n for w, n in words.items()})
    return merges


def encode_lowest_rank(text, merges):
    return [i for piece in pretokenize(text) for i in _merge_ids(list(piece.encode("utf-8")), merges)]


def _merge_ids(ids, merges):
    """Repeatedly merge the lowest-ranked pair present."""
    while len(ids) > 1:
        pair = min(pairwise(ids), key=lambda p: merges.get(p, float("inf")))
        if pair not in merges:
            break
        ids = merge_while(ids, pair, merges[pair])
    return ids


def encode_in_learned_order(text, merges):
    out = []
    for piece in pretokenize(text):
        ids = list(piece.encode("utf-8"))
        for pair, new_id in sorted(merges.items(), key=lambda item: item[1]):
            ids = merge_skip_flag(ids, pair, new_id)
        out.extend(ids)
    return out


# ---- wrong answers

def seed_style_training(text, num_merges):
    """The seed's loop: counts a fresh copy of the bytes each time, so nothing is ever merged."""
    merges = {}
    for step in range(num_merges):
        merges[Counter(pairwise(text.encode())).most_common(1)[0][0]] = 256 + step
    return merges


def train_on_raw_bytes(text, num_merges):
    ids, merges = list(text.encode()), {}
    for step in range(num_merges):
        counts = Counter(pairwise(ids))
        pair = min(counts, key=lambda p: (-counts[p], p))
        merges[pair] = 256 + step
        ids = merge_while(ids, pair, 256 + step)
    return merges


def train_ties_to_first_seen(text, num_merges):
    pieces = [list(p.encode()) for p in pretokenize(text)]
    merges = {}
    for step in range(num_merges):
        counts = Counter()
        for ids in pieces:
            counts.update(pairwise(ids))
        pair = max(counts, key=counts.get)
        merges[pair] = 256 + step
        pieces = [merge_while(ids, pair, 256 + step) for ids in pieces]
    return merges


def encode_all_text_at_once(text, merges):
    ids = list(text.encode())
    for pair, new_id in sorted(merges.items(), key=lambda item: item[1]):
        ids = merge_while(ids, pair, new_id)
    return ids


def encode_by_frequency(text, merges):
    """Training's rule misapplied: merge the known pair most frequent in this text, until none is left."""
    pieces = [list(piece.encode()) for piece in pretokenize(text)]
    while True:
        counts = Counter(pair for ids in pieces for pair in pairwise(ids) if pair in merges)
        if not counts:
            break
        pair = max(counts, key=counts.get)
        pieces = [merge_while(ids, pair, merges[pair]) for ids in pieces]
    return [i for ids in pieces for i in ids]


def encode_leftmost_first(text, merges):
    out = []
    for piece in pretokenize(text):
        ids = list(piece.encode())
        i = 0
        while i < len(ids) - 1:
            if (ids[i], ids[i + 1]) in merges:
                ids[i:i + 2] = [merges[ids[i], ids[i + 1]]]
                i = 0
            else:
                i += 1
        out.extend(ids)
    return out


def encode_dropping_the_last_piece(text, merges):
    pieces = pretokenize(text)
    return encode_lowest_rank("".join(pieces[:-1]), merges) if len(pieces) > 1 else encode_lowest_rank(text, merges)


def encode_skipping_first_ids(text, merges):
    """Merges only after each piece's first byte."""
    out = []
    for piece in pretokenize(text):
        ids = list(piece.encode())
        out.extend(ids[:1] + _merge_ids(ids[1:], merges))
    return out



def train_once_per_distinct_piece(text, num_merges):
    """A set of pieces: ' the' weighs as much as a word seen once."""
    return _train_pieces({tuple(piece.encode()) for piece in pretokenize(text)}, num_merges)


def train_on_characters(text, num_merges):
    return _train_pieces(Counter(tuple(ord(c) for c in piece) for piece in pretokenize(text)), num_merges)


def _train_pieces(pieces, num_merges, fewest=1):
    """The solution's loop over {piece: frequency} (a set counts each piece once), stopping when the best pair
    occurs fewer than `fewest` times."""
    pieces = dict.fromkeys(pieces, 1) if isinstance(pieces, set) else dict(pieces)
    merges = {}
    for step in range(num_merges):
        counts = pair_counts_dict(pieces)
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        if counts[pair] < fewest:
            break
        merges[pair] = 256 + step
        pieces = {tuple(merge_while(list(ids), pair, 256 + step)): n for ids, n in pieces.items()}
    return merges


def encode_latest_first(text, merges):
    out = []
    for piece in pretokenize(text):
        ids = list(piece.encode())
        for pair, new_id in sorted(merges.items(), key=lambda item: -item[1]):
            ids = merge_while(ids, pair, new_id)
        out.extend(ids)
    return out


def merge_in_place(ids, pair, new_id):
    i = 0
    while i < len(ids) - 1:
        if (ids[i], ids[i + 1]) == pair:
            ids[i:i + 2] = [new_id]
        i += 1
    return ids


def merge_first_only(ids, pair, new_id):
    for i in range(len(ids) - 1):
        if (ids[i], ids[i + 1]) == pair:
            return ids[:i] + [new_id] + ids[i + 2:]
    return list(ids)


def merge_dropping_last(ids, pair, new_id):
    out, i = [], 0
    while i < len(ids) - 1:
        if (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def merge_without_skipping(ids, pair, new_id):
    return [new_id if (a, b) == pair else a for a, b in zip(ids, ids[1:], strict=False)] + ids[-1:]


def merge_right_to_left(ids, pair, new_id):
    return merge_while(ids[::-1], pair[::-1], new_id)[::-1]


def merge_either_order(ids, pair, new_id):
    return merge_while(merge_while(ids, pair, new_id), pair[::-1], new_id)


def merge_by_string_replacement(ids, pair, new_id):
    """Replaces the pair's text in the comma-joined ids: a digit can be cut off a neighbouring id."""
    text = ",".join(map(str, ids)).replace(f"{pair[0]},{pair[1]}", str(new_id))
    return [int(x) for x in text.split(",")] if text else []


def train_skipping_pairs_seen_once(text, num_merges):
    """Stops when the best pair occurs only once, which labkit's train still merges."""
    return _train_pieces(Counter(tuple(piece.encode("utf-8")) for piece in pretokenize(text)), num_merges, fewest=2)


def train_on_whitespace_split(text, num_merges):
    """text.split() for pieces: the spaces before words are lost."""
    return _train_pieces(Counter(tuple(piece.encode()) for piece in text.split()), num_merges)


def train_off_by_one_ids(text, num_merges):
    return {pair: new_id + 1 for pair, new_id in train_recount(text, num_merges).items()}


def train_one_merge_short(text, num_merges):
    return train_recount(text, num_merges - 1)


RIGHT = [
    Right("get_pair_counts", "dict.get over itertools.pairwise", pair_counts_dict),
    Right("get_pair_counts", "index loop into a defaultdict", pair_counts_indexed),
    Right("get_pair_counts", "Counter per piece, scaled by its frequency", pair_counts_scaled),
    Right("merge", "while loop with an index", merge_while),
    Right("merge", "for loop with a skip flag", merge_skip_flag),
    Right("train_bpe", "recount every piece after each merge", train_recount),
    Right("train_bpe", "count distinct words once, weighted by frequency", train_by_word_counts),
    Right("bpe_encode", "repeatedly merge the lowest-ranked pair", encode_lowest_rank),
    Right("bpe_encode", "apply every merge in learned order to each piece", encode_in_learned_order),
]

WRONG = [
    Wrong("get_pair_counts", "ignores the frequencies", lambda pieces: pair_counts_with(pieces, weighted=False),
          "each distinct piece was counted once"),
    Wrong("get_pair_counts", "pairs across piece boundaries", pair_counts_concatenated, "counted across pieces"),
    Wrong("get_pair_counts", "a set of pairs per piece", lambda pieces: pair_counts_with(
        pieces, pairs_of=lambda p: set(pairwise(p))), "was counted once: (5, 5, 5) holds (5, 5)"),
    Wrong("get_pair_counts", "skips the last pair", lambda pieces: pair_counts_with(
        pieces, pairs_of=lambda p: list(pairwise(p))[:-1]), "the last pair of each piece is missing"),
    Wrong("get_pair_counts", "non-overlapping pairs (stepping by 2)", lambda pieces: pair_counts_with(
        pieces, pairs_of=lambda p: zip(p[::2], p[1::2], strict=False)), "without overlap"),
    Wrong("get_pair_counts", "pairs stored reversed", lambda pieces: pair_counts_with(
        pieces, pairs_of=lambda p: [(b, a) for a, b in pairwise(p)]), "pairs are reversed"),
    Wrong("get_pair_counts", "counts single ids, not pairs", lambda pieces: Counter(
        i for piece in pieces for i in piece), "keys must be pairs"),
    Wrong("get_pair_counts", "returns a list of pairs", lambda pieces: [q for p in pieces for q in pairwise(p)],
          "return a dict"),
    Wrong("get_pair_counts", "pops the pieces while counting", lambda pieces: pair_counts_dict(
        {p: pieces.pop(p) for p in list(pieces)}), "changed the pieces"),
    Wrong("get_pair_counts", "calls labkit's pair_counts", lambda pieces: sum(
        (Counter({q: n * f for q, n in pair_counts(list(p)).items()}) for p, f in pieces.items()), Counter()),
          "`pair_counts`",
          calls="labkit.tokenizer.pair_counts"),
    Wrong("merge", "mutates the input list", merge_in_place, "changed the list it was given"),
    Wrong("merge", "merges only the first occurrence", merge_first_only, "only the first occurrence was merged"),
    Wrong("merge", "drops the last id", merge_dropping_last, "the last id was dropped"),
    Wrong("merge", "keeps the second id after a merge", merge_without_skipping, "skip past both ids"),
    Wrong("merge", "scans right to left", merge_right_to_left, "left to right, no overlap"),
    Wrong("merge", "merges (b, a) too", merge_either_order, "also merged the reversed pair"),
    Wrong("merge", "replaces the pair in the ids' text", merge_by_string_replacement, "compare whole ids"),
    Wrong("merge", "returns a tuple", lambda ids, pair, new_id: tuple(merge_while(ids, pair, new_id)), "return a list"),
    Wrong("merge", "calls labkit's merge_pair", lambda ids, pair, new_id: merge_pair(ids, pair, new_id),
          "`merge_pair`", calls="labkit.tokenizer.merge_pair"),
    Wrong("train_bpe", "re-counts the raw text each step (the seed's bug)", seed_style_training, "the seed's bug"),
    Wrong("train_bpe", "counts across pretokenized pieces", train_on_raw_bytes, "counted across piece boundaries"),
    Wrong("train_bpe", "ties go to the first pair seen", train_ties_to_first_seen, "ties go to the smaller pair"),
    Wrong("train_bpe", "returns a list of pairs", lambda text, n: [(1, 2)] * n, "return a dict"),
    Wrong("train_bpe", "new ids start at 257", train_off_by_one_ids, "new ids must be 256, 257"),
    Wrong("train_bpe", "one merge too few", train_one_merge_short, "asked for 40 merges, got 39"),
    Wrong("train_bpe", "no early stop: min() of empty counts", train_without_early_stop, "stop early when the pair"),
    Wrong("train_bpe", "no early stop: most_common() of empty counts", lambda text, n: train_without_early_stop(
        text, n, pick="most_common"), "no pair is left"),
    Wrong("train_bpe", "pads to num_merges with made-up pairs", train_with_placeholder_merges,
          "should learn 5 merges and stop"),
    Wrong("train_bpe", "stops when the best pair occurs only once", train_skipping_pairs_seen_once,
          "a pair seen once is merged too"),
    Wrong("train_bpe", "pieces from text.split(), not pretokenize", train_on_whitespace_split,
          "check your pieces"),
    Wrong("train_bpe", "calls labkit's train", lambda text, n: {p: 256 + i for i, p in enumerate(
        train(text, 256 + n).merges)}, "`train`", calls="labkit.tokenizer.train"),
    Wrong("bpe_encode", "returns the raw UTF-8 bytes", lambda text, merges: list(text.encode()),
          "no merge was applied"),
    Wrong("bpe_encode", "merges across pretokenized pieces", encode_all_text_at_once,
          "applied across piece boundaries"),
    Wrong("bpe_encode", "picks the most frequent pair in the new text, not the earliest merge", encode_by_frequency,
          "how often a pair occurs in this text"),
    Wrong("bpe_encode", "merges the leftmost known pair first", encode_leftmost_first, "leftmost mergeable pair"),
    Wrong("bpe_encode", "drops the last piece", encode_dropping_the_last_piece, "then yours stop"),
    Wrong("bpe_encode", "the first id of each piece left unmerged", encode_skipping_first_ids,
          "differs from labkit's at position"),
    Wrong("train_bpe", "counts each distinct piece once", train_once_per_distinct_piece,
          "each distinct piece was counted once"),
    Wrong("train_bpe", "characters (ord) instead of UTF-8 bytes", train_on_characters, "not bytes"),
    Wrong("bpe_encode", "applies the latest merges first", encode_latest_first,
          "latest-learned merges were applied first"),
    Wrong("bpe_encode", "returns the decoded string", lambda text, merges: text, "return a list of ids"),
    Wrong("bpe_encode", "calls labkit's apply_merges", lambda text, merges: [i for piece in pretokenize(text) for i in
          apply_merges(list(piece.encode()), {p: (n - 256, n) for p, n in merges.items()})],
          "`apply_merges`", calls="labkit.tokenizer.apply_merges"),
]
