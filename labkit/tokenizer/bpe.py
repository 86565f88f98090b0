"""Byte-pair encoding: counting pairs, merging one, learning merges, applying them in order.

Token ids 0..255 are the bytes; merge number k creates id 256 + k. Training keeps the pair
counts up to date as each merge is applied (only the words that contain the merged pair are
touched), so a merge costs time proportional to where that pair occurs, not to the corpus.
"""

import heapq
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise

Pair = tuple[int, int]


def pair_counts(ids: Sequence[int]) -> Counter:
    """How often each adjacent pair of ids occurs in `ids`."""
    return Counter(pairwise(ids))


def merge_pair(ids: Sequence[int], pair: Pair, new_id: int) -> list[int]:
    """`ids` with every non-overlapping occurrence of `pair`, left to right, replaced by `new_id`."""
    first, second = pair
    out = []
    i, n = 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == first and ids[i + 1] == second:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def apply_merges(ids: list[int], merges: Mapping[Pair, tuple[int, int]]) -> list[int]:
    """Encode one piece: repeatedly apply the earliest-learned merge present, until none applies.

    `merges` maps a pair to (rank, merged id). Applying merges in the order they were learned
    (not by frequency in this text) is what makes encoding reproduce training.
    """
    while len(ids) > 1:
        best_rank, best_pair = None, None
        for pair in pairwise(ids):
            merge = merges.get(pair)
            if merge is not None and (best_rank is None or merge[0] < best_rank):
                best_rank, best_pair = merge[0], pair
        if best_pair is None:
            break
        ids = merge_pair(ids, best_pair, merges[best_pair][1])
    return ids


def train_merges(words: Mapping[bytes, int], num_merges: int) -> list[Pair]:
    """Learn up to `num_merges` merges from pre-tokenized `words` (piece bytes -> count).

    Each step merges the most frequent pair; a tie goes to the smaller pair (as tuples of ids),
    which makes training deterministic. Stops early when no adjacent pair is left.
    """
    pieces = [list(word) for word in words]
    freqs = list(words.values())
    counts: Counter = Counter()
    where: dict[Pair, set[int]] = {}
    for index, (piece, freq) in enumerate(zip(pieces, freqs, strict=True)):
        for pair in pairwise(piece):
            counts[pair] += freq
            where.setdefault(pair, set()).add(index)
    heap = [(-count, pair) for pair, count in counts.items()]
    heapq.heapify(heap)

    merges: list[Pair] = []
    while len(merges) < num_merges and heap:
        negative_count, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -negative_count:
            continue  # a stale entry: this pair's count changed after it was pushed
        new_id = 256 + len(merges)
        merges.append(pair)
        changed = set()
        for index in where.pop(pair):
            piece, freq = pieces[index], freqs[index]
            if len(piece) < 2:
                continue
            merged = merge_pair(piece, pair, new_id)
            if len(merged) == len(piece):
                continue  # the index is stale: an earlier merge already consumed this pair here
            for old in pairwise(piece):
                counts[old] -= freq
                changed.add(old)
            for new in pairwise(merged):
                counts[new] += freq
                changed.add(new)
                where.setdefault(new, set()).add(index)
            pieces[index] = merged
        for changed_pair in changed:
            count = counts[changed_pair]
            if count > 0:
                heapq.heappush(heap, (-count, changed_pair))
            else:
                del counts[changed_pair]
    return merges


def learned_vocab(merges: Iterable[Pair]) -> list[bytes]:
    """The bytes of every token: the 256 single bytes, then each merge's concatenation."""
    vocab = [bytes([b]) for b in range(256)]
    for first, second in merges:
        vocab.append(vocab[first] + vocab[second])
    return vocab
