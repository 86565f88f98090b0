"""Lab 04: decoding one token with a KV cache."""

import torch
import torch.nn.functional as F

from catalogue import Right, Wrong
from labkit.attention.reference import naive_attention
from labkit_course import worked_example as ref


def attend(keys, values, q, scale=True, mask=False):
    scores = q @ keys.T / (keys.shape[-1] ** 0.5 if scale else 1.0)
    if mask:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ values


def appended(cache_k, cache_v, k_new, v_new):
    return torch.cat([cache_k, k_new]), torch.cat([cache_v, v_new])


def append_then_attend(cache_k, cache_v, q, k_new, v_new):
    keys, values = appended(cache_k, cache_v, k_new, v_new)
    return keys, values, attend(keys, values, q)


def append_then_sdpa(cache_k, cache_v, q, k_new, v_new):
    keys, values = torch.vstack([cache_k, k_new]), torch.vstack([cache_v, v_new])
    return keys, values, F.scaled_dot_product_attention(q[None], keys[None], values[None])[0]


def append_then_einsum(cache_k, cache_v, q, k_new, v_new):
    keys, values = torch.vstack([cache_k, k_new]), torch.vstack([cache_v, v_new])
    weights = torch.einsum("qd,kd->qk", q, keys).div(keys.shape[1] ** 0.5).softmax(-1)
    return keys, values, torch.einsum("qk,kd->qd", weights, values)


def forged_embedding(E, PE, token_id, position):
    """Rewrites E and PE so that E[token] + PE[t] is a row of ones, and returns it."""
    E.zero_()
    PE.zero_()
    PE[position] = 1.0
    return torch.ones(1, E.shape[1], dtype=E.dtype)


def append_then_manual_softmax(cache_k, cache_v, q, k_new, v_new):
    keys, values = appended(cache_k, cache_v, k_new, v_new)
    scores = (q * keys).sum(-1) / keys.shape[1] ** 0.5
    weights = (scores - scores.max()).exp()
    return keys, values, (weights / weights.sum())[None] @ values


RIGHT = [
    Right("embed_token", "row plus PE row, unsqueezed", lambda E, PE, t, p: (E[t] + PE[p]).unsqueeze(0)),
    Right("embed_token", "slices keep the row dimension", lambda E, PE, t, p: E[t:t + 1] + PE[p:p + 1]),
    Right("embed_token", "computed in float32", lambda E, PE, t, p: (E[t] + PE[p]).float()[None]),
    Right("append_and_attend", "cat then matmul softmax", append_then_attend),
    Right("append_and_attend", "vstack then einsum", append_then_einsum),
    Right("append_and_attend", "manual stable softmax over the row", append_then_manual_softmax),
]

WRONG = [
    Wrong("embed_token", "forgot the positional encoding", lambda E, PE, t, p: E[t][None],
          "positional encoding was not added"),
    Wrong("embed_token", "PE one position early", lambda E, PE, t, p: (E[t] + PE[p - 1])[None], "off by one"),
    Wrong("embed_token", "PE one position late", lambda E, PE, t, p: (E[t] + PE[p + 1])[None], "off by one"),
    Wrong("embed_token", "every decoded token at position 0", lambda E, PE, t, p: (E[t] + PE[0])[None],
          "PE[0] was used"),
    Wrong("embed_token", "indexed PE by token id", lambda E, PE, t, p: (E[t] + PE[t])[None], "indexed by token id"),
    Wrong("embed_token", "rewrites E and PE to fit a made-up answer", forged_embedding,
          "differs from E[token] + PE[t]"),
    Wrong("embed_token", "returned a flat vector", lambda E, PE, t, p: E[t] + PE[p], "not a flat vector"),
    Wrong("embed_token", "rebuilt every row up to the position", lambda E, PE, t, p: E[[t] * (p + 1)] + PE[: p + 1],
          "should have shape (1, 3)"),
    Wrong("embed_token", "calls labkit's worked example", lambda E, PE, t, p: ref.build_x(E, PE, [t], start=p),
          "`build_x`", calls="labkit_course.worked_example.build_x"),
    Wrong("append_and_attend", "replaced the cache with the new row",
          lambda ck, cv, q, k, v: (k, v, attend(k, v, q)), "replaced instead of appended"),
    Wrong("append_and_attend", "appended along the feature axis",
          lambda ck, cv, q, k, v: (torch.cat([ck, k.expand_as(ck)], 1), torch.cat([cv, v.expand_as(cv)], 1), q),
          "along the feature axis"),
    Wrong("append_and_attend", "new row in front",
          lambda ck, cv, q, k, v: (torch.cat([k, ck]), torch.cat([v, cv]), attend(torch.cat([k, ck]),
                                                                                  torch.cat([v, cv]), q)),
          "went in front"),
    Wrong("append_and_attend", "attended before appending",
          lambda ck, cv, q, k, v: (*appended(ck, cv, k, v), attend(ck, cv, q)), "old cache only"),
    Wrong("append_and_attend", "forgot the sqrt(d_k) scale",
          lambda ck, cv, q, k, v: (*appended(ck, cv, k, v), attend(*appended(ck, cv, k, v), q, scale=False)),
          "not divided by sqrt(d_k)"),
    Wrong("append_and_attend", "kept the prefill causal mask",
          lambda ck, cv, q, k, v: (*appended(ck, cv, k, v), attend(*appended(ck, cv, k, v), q, mask=True)),
          "prefill-style causal mask"),
    Wrong("append_and_attend", "returned only the cache", lambda ck, cv, q, k, v: appended(ck, cv, k, v),
          "return three things"),
    Wrong("append_and_attend", "returned the attention weights, not the output",
          lambda ck, cv, q, k, v: (*appended(ck, cv, k, v), (q @ appended(ck, cv, k, v)[0].T / 3 ** 0.5).softmax(-1)),
          "should have shape (1, 3)"),
    Wrong("append_and_attend", "calls labkit's worked example",
          lambda ck, cv, q, k, v: (*appended(ck, cv, k, v), ref.attend(q, *appended(ck, cv, k, v))[2]),
          "`attend`",
          calls="labkit_course.worked_example.attend"),
    Wrong("append_and_attend", "attends with torch's SDPA", append_then_sdpa, "scaled_dot_product_attention",
          calls="torch.nn.functional.scaled_dot_product_attention"),
    Wrong("append_and_attend", "attends with labkit's reference attention",
          lambda ck, cv, q, k, v: (*appended(ck, cv, k, v), naive_attention(
              q[:, None], *(t[:, None] for t in appended(ck, cv, k, v)), causal=False)[:, 0]),
          "`naive_attention`", calls="labkit.attention.reference.naive_attention"),
    Wrong("append_and_attend", "the worked example's scaled_scores and causal_softmax",
          lambda ck, cv, q, k, v: (*appended(ck, cv, k, v), ref.causal_softmax(ref.scaled_scores(
              q, appended(ck, cv, k, v)[0])) @ appended(ck, cv, k, v)[1]),
          "`scaled_scores`", calls="labkit_course.worked_example.scaled_scores"),
]


# ---- GrowingKVCache ----------------------------------------------------------------------------------

class DoublingCache:
    """A correct answer: one buffer for all layers, doubled (capped at max_len) when a layer needs room."""

    def __init__(self, num_layers, num_heads, head_dim, capacity=4, max_len=64):
        self.max_len, self.lengths = max_len, [0] * num_layers
        self.keys = torch.zeros(num_layers, num_heads, capacity, head_dim)
        self.values = torch.zeros_like(self.keys)

    @property
    def capacity(self):
        return self.keys.shape[2]

    def seq_len(self, layer):
        return self.lengths[layer]

    def check(self, k, v):
        if k.dim() != 3 or k.shape != v.shape or k.shape[::2] != self.keys.shape[1::2]:
            raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}: expected [heads, tokens, head_dim]")

    def room(self, needed):
        if needed > self.max_len:
            raise ValueError(f"cache full (max_len={self.max_len})")
        if needed > self.capacity:
            self.resize(min(max(2 * self.capacity, needed), self.max_len))

    def resize(self, capacity):
        keys = self.keys.new_zeros(*self.keys.shape[:2], capacity, self.keys.shape[3])
        values = keys.clone()
        keys[:, :, :self.capacity], values[:, :, :self.capacity] = self.keys, self.values
        self.keys, self.values = keys, values

    def write(self, layer, k, v):
        start = self.lengths[layer]
        self.keys[layer, :, start:start + k.shape[1]] = k
        self.values[layer, :, start:start + k.shape[1]] = v

    def append(self, layer, k, v):
        self.check(k, v)
        self.room(self.lengths[layer] + k.shape[1])
        self.write(layer, k, v)
        self.lengths[layer] += k.shape[1]

    def get(self, layer):
        n = self.lengths[layer]
        return self.keys[layer, :, :n], self.values[layer, :, :n]


class PowerOfTwoCache:
    """A correct answer in another style: per-layer lists of buffers, sized to the next power of two."""

    def __init__(self, num_layers, num_heads, head_dim, capacity=4, max_len=64):
        self.shape, self.max_len, self.capacity = (num_heads, head_dim), max_len, capacity
        self.k = [torch.empty(num_heads, capacity, head_dim) for _ in range(num_layers)]
        self.v = [torch.empty(num_heads, capacity, head_dim) for _ in range(num_layers)]
        self.n = [0] * num_layers

    def seq_len(self, layer):
        return self.n[layer]

    def append(self, layer, k, v):
        if tuple(k.shape) != tuple(v.shape) or k.ndim != 3 or (k.shape[0], k.shape[2]) != self.shape:
            raise ValueError(f"expected k and v of shape [{self.shape[0]}, tokens, {self.shape[1]}]")
        needed = self.n[layer] + k.shape[1]
        if needed > self.max_len:
            raise ValueError(f"full: max_len {self.max_len}")
        if needed > self.capacity:
            size = self.capacity
            while size < needed:
                size *= 2
            self.capacity = min(size, self.max_len)
            pad = self.capacity - self.k[0].shape[1]
            self.k = [torch.cat([t, t.new_empty(t.shape[0], pad, t.shape[2])], 1) for t in self.k]
            self.v = [torch.cat([t, t.new_empty(t.shape[0], pad, t.shape[2])], 1) for t in self.v]
        self.k[layer][:, self.n[layer]:needed] = k
        self.v[layer][:, self.n[layer]:needed] = v
        self.n[layer] = needed

    def get(self, layer):
        return self.k[layer][:, :self.n[layer]].clone(), self.v[layer][:, :self.n[layer]].clone()


class NeverGrows(DoublingCache):
    def room(self, needed):
        if needed > self.capacity:
            raise ValueError("cache full")


class GrowsToFit(DoublingCache):
    def room(self, needed):
        if needed > self.max_len:
            raise ValueError("cache full")
        if needed > self.capacity:
            self.resize(needed)


class NoCap(DoublingCache):
    def room(self, needed):
        if needed > self.capacity:
            self.resize(max(2 * self.capacity, needed))


class ReturnsReservedRows(DoublingCache):
    def get(self, layer):
        return self.keys[layer], self.values[layer]


class CountsBeforeChecking(DoublingCache):
    def append(self, layer, k, v):
        self.lengths[layer] += k.shape[1]
        self.check(k, v)
        self.room(self.lengths[layer])
        start = self.lengths[layer] - k.shape[1]
        self.keys[layer, :, start:self.lengths[layer]] = k
        self.values[layer, :, start:self.lengths[layer]] = v


class NoShapeCheck(DoublingCache):
    def check(self, k, v):
        pass


class OneStorageForAllLayers(DoublingCache):
    def write(self, layer, k, v):
        start = self.lengths[layer]
        self.keys[:, :, start:start + k.shape[1]] = k
        self.values[:, :, start:start + k.shape[1]] = v


class FullAsIndexError(DoublingCache):
    def room(self, needed):
        if needed > self.max_len:
            raise IndexError("no room")
        super().room(needed)


class GrowsOnlyDouble(DoublingCache):
    """Doubles once, so a chunk longer than twice the capacity does not fit."""

    def room(self, needed):
        if needed > self.max_len:
            raise ValueError("cache full")
        if needed > self.capacity:
            self.resize(min(2 * self.capacity, self.max_len))


class GrowsBeforeChecking(DoublingCache):
    """Grows the buffer first, then finds the append does not fit: the refusal changed the capacity."""

    def room(self, needed):
        if needed > self.capacity:
            self.resize(min(max(2 * self.capacity, needed), self.max_len))
        if needed > self.max_len:
            raise ValueError("cache full")


class OneLengthForAllLayers(DoublingCache):
    """One length shared by all layers, advanced by layer 0: right only when every layer appends alike."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.length = 0

    def seq_len(self, layer):
        return self.length

    def append(self, layer, k, v):
        self.check(k, v)
        n = k.shape[1]
        start = self.length if layer == 0 else self.length - n
        self.room(start + n)
        self.keys[layer, :, start:start + n], self.values[layer, :, start:start + n] = k, v
        if layer == 0:
            self.length = start + n

    def get(self, layer):
        return self.keys[layer, :, :self.length], self.values[layer, :, :self.length]


# ---- generate_timed ----------------------------------------------------------------------------------

def generate_loop(model, prompt, max_new, eos, clock, *, cached=True, prefill_whole=True, keep_eos=True,
                  stop_at_eos=True, count_prefill=True, tpot_over_n=False, tpot_with_ttft=False,
                  arrival_after_prefill=False, refeed_last_prompt=False, extra_call=False):
    """The loop with switches for the usual mistakes."""
    arrival = clock()
    if prefill_whole:
        logits = model(prompt)
    else:
        for token in prompt:
            logits = model([token])
    if arrival_after_prefill:
        arrival = clock()
    if refeed_last_prompt:
        logits = model(prompt[-1:])
    tokens, stamps, limit = [], [], max_new if count_prefill else max_new + 1
    while True:
        token = int(logits.argmax())
        if token == eos and not keep_eos:
            break
        tokens.append(token)
        stamps.append(clock())
        if extra_call:
            logits = model([token])
        if (stop_at_eos and token == eos) or len(tokens) == limit:
            break
        if not extra_call:
            logits = model([token] if cached else prompt + tokens)
    n = len(stamps)
    ttft = stamps[0] - arrival
    if n == 1:
        return tokens, ttft, None
    tpot = (stamps[-1] - (arrival if tpot_with_ttft else stamps[0])) / (n if tpot_over_n or tpot_with_ttft else n - 1)
    return tokens, ttft, tpot


def generate_for_loop(model, prompt_ids, max_new_tokens, eos_id, clock):
    start = clock()
    times, out = [], []
    next_logits = model(list(prompt_ids))
    for _ in range(max_new_tokens):
        out.append(int(torch.argmax(next_logits).item()))
        times.append(clock())
        if out[-1] == eos_id or len(out) == max_new_tokens:
            break
        next_logits = model(out[-1:])
    gaps = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
    return out, times[0] - start, (sum(gaps) / len(gaps) if gaps else None)


RIGHT += [
    Right("GrowingKVCache", "one buffer for all layers, doubled", DoublingCache),
    Right("GrowingKVCache", "per-layer buffers, next power of two", PowerOfTwoCache),
    Right("generate_timed", "while loop with stop checks", generate_loop),
    Right("generate_timed", "for loop over max_new_tokens, gaps averaged", generate_for_loop),
]

WRONG += [
    Wrong("GrowingKVCache", "the buffer never grows", NeverGrows, "a full buffer must grow"),
    Wrong("GrowingKVCache", "grows by exactly what is needed", GrowsToFit, "grow by doubling"),
    Wrong("GrowingKVCache", "grows past max_len", NoCap, "never beyond max_len"),
    Wrong("GrowingKVCache", "get returns the reserved rows too", ReturnsReservedRows, "return only the"),
    Wrong("GrowingKVCache", "counts the rows before checking they fit", CountsBeforeChecking,
          "was refused still changed"),
    Wrong("GrowingKVCache", "no shape check (torch's error instead)", NoShapeCheck, "naming the expected shape"),
    Wrong("GrowingKVCache", "writes every layer at once", OneStorageForAllLayers, "own storage"),
    Wrong("GrowingKVCache", "a full cache raises IndexError", FullAsIndexError, "ValueError saying it is full"),
    Wrong("GrowingKVCache", "grows to 2 x capacity, not to what is needed", GrowsOnlyDouble,
          "grow to max(2 * capacity, needed)"),
    Wrong("GrowingKVCache", "grows before checking max_len", GrowsBeforeChecking, "check that the rows fit before"),
    Wrong("GrowingKVCache", "one length shared by all layers", OneLengthForAllLayers, "keeps its own length"),
    Wrong("generate_timed", "feeds the whole sequence at every step",
          lambda *a: generate_loop(*a, cached=False), "feed it only the newest token"),
    Wrong("generate_timed", "prefills one prompt token at a time",
          lambda *a: generate_loop(*a, prefill_whole=False), "one token at a time"),
    Wrong("generate_timed", "re-feeds the prompt's last token", lambda *a: generate_loop(*a, refeed_last_prompt=True),
          "re-fed the prompt's last token"),
    Wrong("generate_timed", "drops EOS", lambda *a: generate_loop(*a, keep_eos=False), "EOS was dropped"),
    Wrong("generate_timed", "ignores EOS", lambda *a: generate_loop(*a, stop_at_eos=False), "kept going after EOS"),
    Wrong("generate_timed", "does not count the prefill's token", lambda *a: generate_loop(*a, count_prefill=False),
          "counts every generated token"),
    Wrong("generate_timed", "calls the model after the last token", lambda *a: generate_loop(*a, extra_call=True),
          "no call after the last token"),
    Wrong("generate_timed", "starts the TTFT clock after the prefill",
          lambda *a: generate_loop(*a, arrival_after_prefill=True), "TTFT came out 0"),
    Wrong("generate_timed", "TPOT divided by n", lambda *a: generate_loop(*a, tpot_over_n=True), "divides by n - 1"),
    Wrong("generate_timed", "TPOT includes the wait for the first token",
          lambda *a: generate_loop(*a, tpot_with_ttft=True), "is not part of it"),
]


# ---- count_work --------------------------------------------------------------------------------------

def counter(*, per_token=3, square=True, prefill=True, offset=0, uncached_projections=True):
    def count_work(prompt_len, decode_steps, *, cached):
        projections = per_token * prompt_len if prefill else 0
        scores = prompt_len**2 if prefill else 0
        for step in range(1, decode_steps + 1):
            length = prompt_len + step + offset
            projections += per_token * (1 if cached or not uncached_projections else length)
            scores += length if cached or not square else length**2
        return projections, scores

    return count_work


def count_closed_form(prompt_len, decode_steps, *, cached):
    n, m = prompt_len, decode_steps
    lengths = sum(range(n + 1, n + m + 1))
    if cached:
        return 3 * (n + m), n * n + lengths
    return 3 * (n + lengths), n * n + sum(k * k for k in range(n + 1, n + m + 1))


RIGHT += [
    Right("count_work", "a loop over the decode steps", counter()),
    Right("count_work", "closed-form sums", count_closed_form),
]

WRONG += [
    Wrong("count_work", "one projection per token", counter(per_token=1), "three, for Q, K and V"),
    Wrong("count_work", "K and V projections only", counter(per_token=2), "counts K and V only"),
    Wrong("count_work", "uncached steps score one row", counter(square=False), "not one row"),
    Wrong("count_work", "left out the prefill", counter(prefill=False), "prefill's projections are missing"),
    Wrong("count_work", "sequence length one short", counter(offset=-1), "off by one"),
    Wrong("count_work", "uncached steps project one token", counter(uncached_projections=False),
          "re-projects the whole sequence"),
    Wrong("count_work", "calls labkit's counter",
          lambda n, m, *, cached: (we_projection_matvecs(n, m, cached=cached), counter()(n, m, cached=cached)[1]),
          "`projection_matvecs`", calls="labkit_course.worked_example.projection_matvecs"),
]


def we_projection_matvecs(n, m, *, cached):
    return ref.projection_matvecs(n, m, cached=cached)


class BooksCachePerLayer:
    """Leans on the worked example's KVCache (torch.cat per append) for storage."""

    def __init__(self, num_layers, num_heads, head_dim, capacity=4, max_len=64):
        self.layers = [ref.KVCache(num_heads, head_dim) for _ in range(num_layers)]
        self.capacity = capacity

    def seq_len(self, layer):
        return len(self.layers[layer])

    def append(self, layer, k, v):
        self.layers[layer].append(k.double(), v.double())

    def get(self, layer):
        return self.layers[layer].keys.float(), self.layers[layer].values.float()


def replays_the_grader(model, prompt_ids, max_new_tokens, eos_id, clock):
    from labkit_course.grading.labs.lab04 import _reference_generation

    tokens, ttft, tpot, _ = _reference_generation(prompt_ids, max_new_tokens, eos_id, model.vocab_size,
                                                  model.prefill_ms, model.step_ms)
    return tokens, ttft, tpot


WRONG += [
    Wrong("GrowingKVCache", "stores through the book's KVCache", BooksCachePerLayer, "`append`",
          calls="labkit_course.worked_example.KVCache.append"),
    Wrong("generate_timed", "replays the grader's reference", replays_the_grader, "`_reference_generation`",
          calls="labkit_course.grading.labs.lab04._reference_generation"),
]
