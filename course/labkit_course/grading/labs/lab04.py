"""Lab 04: decoding with a KV cache. Graders test the student's functions on fresh random inputs
against `labkit_course.worked_example` (or a model and a clock the grader scripts), and name the usual
mistakes."""

import math

import torch

from labkit_course import worked_example as ref
from labkit_course.grading import ExerciseFailed, exercise, expect_tensor, raised_type, require
from labkit_course.grading.core import close_at_precision as _close
from labkit_course.grading.core import float64_randn as _random
from labkit_course.grading.core import seeded_generator, seeded_random
from labkit_course.grading.records import ScriptedLM, SimulatedClock


@exercise("04", "embed_token", forbidden=("labkit_course.worked_example.build_x",))
def embed_token(ns):
    fn = require(ns, "embed_token")
    embeddings, positional = _random(6, 3, seed=40), _random(8, 3, seed=41)
    for token_id, position in ((2, 5), (5, 3)):
        got = fn(embeddings.clone(), positional.clone(), token_id, position)  # the references read these
        if isinstance(got, torch.Tensor) and tuple(got.shape) == (3,):
            raise ExerciseFailed("return one row of shape (1, d_model), not a flat vector: add .unsqueeze(0)")
        got = expect_tensor(got, (1, 3), "the new token's input row (1 x d_model)")
        row = embeddings[token_id]
        if _close(got[0], row):
            raise ExerciseFailed("the positional encoding was not added: X[t] = E[token] + PE[t]")
        if _close(got[0], row + positional[position - 1]) or _close(got[0], row + positional[position + 1]):
            raise ExerciseFailed(f"PE of the wrong position (off by one): a token at position {position} "
                                 f"gets PE[{position}]")
        if _close(got[0], row + positional[0]):
            raise ExerciseFailed("PE[0] was used: a decoded token is at position t (the number of tokens "
                                 "before it), not 0")
        if _close(got[0], row + positional[token_id]):
            raise ExerciseFailed("PE was indexed by token id; it is indexed by position")
        if not _close(got, ref.build_x(embeddings, positional, [token_id], start=position)):
            raise ExerciseFailed("X[t] differs from E[token] + PE[t] on fresh inputs")
    return "X[t] = E[token] + PE[t], one 1 x d_model row"


@exercise("04", "append_and_attend", forbidden=("labkit_course.worked_example.attend",
                                               "labkit_course.worked_example.scaled_scores",
                                               "labkit_course.worked_example.causal_softmax",
                                               "labkit.attention.reference.naive_attention",
                                               "torch.nn.functional.scaled_dot_product_attention"))
def append_and_attend(ns):
    fn = require(ns, "append_and_attend")
    cached, d_k = 4, 3
    cache_k, cache_v = _random(cached, d_k, seed=42), _random(cached, d_k, seed=43)
    q, k_new, v_new = _random(1, d_k, seed=44), _random(1, d_k, seed=45), _random(1, d_k, seed=46)
    result = fn(cache_k.clone(), cache_v.clone(), q.clone(), k_new.clone(), v_new.clone())  # the references read these
    if not isinstance(result, tuple) or len(result) != 3:
        raise ExerciseFailed("return three things: (all keys, all values, attention output)")
    keys, values, out = result
    for value, what in ((keys, "keys"), (values, "values")):
        if isinstance(value, torch.Tensor) and tuple(value.shape) == (1, d_k):
            raise ExerciseFailed(f"the cache was replaced instead of appended: {what} must keep the "
                                 f"{cached} cached rows and add the new one")
        if isinstance(value, torch.Tensor) and tuple(value.shape) == (cached, 2 * d_k):
            raise ExerciseFailed(f"{what} were appended along the feature axis; rows are positions (dim 0)")
        expect_tensor(value, (cached + 1, d_k), f"all {what} after appending one token")
    if _close(keys, torch.cat([k_new, cache_k])):
        raise ExerciseFailed("the new K went in front: the cache keeps positions in order, the newest last")
    if not (_close(keys, torch.cat([cache_k, k_new])) and _close(values, torch.cat([cache_v, v_new]))):
        raise ExerciseFailed("all keys/values should be the cached rows followed by the new token's row")
    out = expect_tensor(out, (1, d_k), "the attention output of one query")
    expected = ref.attend(q, keys, values)[2]
    if _close(out, ref.attend(q, cache_k, cache_v)[2]):
        raise ExerciseFailed("attended over the old cache only: append first, a token attends to itself too")
    if _close(out, (q @ keys.T).softmax(-1) @ values):
        raise ExerciseFailed("scores were not divided by sqrt(d_k)")
    if _close(out, values[:1]):
        raise ExerciseFailed("a prefill-style causal mask hid the past: a decode query sees every cached position")
    if not _close(out, expected):
        raise ExerciseFailed("the output differs from softmax(q K_all^T / sqrt(d_k)) V_all")
    return "appended one row, attended over all cached positions and itself"


# ---- a KV cache that grows ----------------------------------------------------------------------

def _raised(call):
    """(type name, message) of what `call` raised, or None; a student's error crosses as RemoteError."""
    try:
        call()
    except ExerciseFailed:
        raise
    except Exception as error:
        return raised_type(error), str(error)
    return None


def _expect_contents(cache, layer, keys, values, when):
    got = cache.get(layer)
    if not isinstance(got, tuple) or len(got) != 2:
        raise ExerciseFailed(f"get(layer) must return (keys, values), got {type(got).__name__}")
    if isinstance(got[0], torch.Tensor) and got[0].dim() == 3 and got[0].shape[1] == cache.capacity \
            and keys.shape[1] != cache.capacity:
        raise ExerciseFailed(f"{when}: get returned all {cache.capacity} reserved rows; return only the "
                             f"{keys.shape[1]} filled ones (the rest is unused space)")
    for value, want, what in ((got[0], keys, "keys"), (got[1], values, "values")):
        expect_tensor(value, tuple(want.shape), f"{when}: layer {layer}'s {what} [heads, tokens, head_dim]")
        if not torch.equal(value, want):
            raise ExerciseFailed(f"{when}: layer {layer}'s {what} are not the rows appended to it, in order "
                                 "(does every layer have its own storage?)")


def _append(cache, layer, k, v, when, max_len):
    """Append rows the cache has room for; a failure names why it should not have failed."""
    capacity, needed = cache.capacity, cache.seq_len(layer) + k.shape[1]
    failure = _raised(lambda: cache.append(layer, k, v))
    if failure:
        hint = (f"{k.shape[1]} rows do not fit even in a doubled buffer: grow to max(2 * capacity, needed)"
                if needed > 2 * capacity else f"below max_len={max_len} a full buffer must grow")
        raise ExerciseFailed(f"{when} (capacity {capacity}): append raised {failure[0]}: {failure[1][:100]}; "
                             f"{hint}")


def _expect_state(cache, lengths, keys, values, when):
    """Every layer holds exactly the rows appended to it, and reports its own length."""
    for layer, length in enumerate(lengths):
        if cache.seq_len(layer) != length:
            raise ExerciseFailed(f"{when}: seq_len({layer}) should be {length}, got {cache.seq_len(layer)!r} "
                                 f"(the layers hold {lengths} rows: each layer keeps its own length)")
        _expect_contents(cache, layer, keys[layer][:, :length], values[layer][:, :length], when)


def _expect_full(failure, max_len):
    if failure is None:
        raise ExerciseFailed(f"an append past max_len={max_len} rows must raise, not grow past it")
    if failure[0] != "ValueError" or not any(word in failure[1].lower() for word in ("full", "max_len")):
        raise ExerciseFailed(f"a full cache should raise ValueError saying it is full (max_len), got "
                             f"{failure[0]}: {failure[1][:100]}")


@exercise("04", "GrowingKVCache", forbidden=("labkit.cache.kv_cache.PreallocatedKVCache.update",
                                             "labkit_course.worked_example.KVCache.append"))
def growing_kv_cache(ns):
    cls = require(ns, "GrowingKVCache", type)
    layers, heads, head_dim, max_len = 2, 2, 3, 10
    cache = cls(layers, heads, head_dim, capacity=2, max_len=max_len)
    g = seeded_generator(47)
    keys = [torch.randn(heads, max_len, head_dim, generator=g) for _ in range(layers)]
    values = [torch.randn(heads, max_len, head_dim, generator=g) for _ in range(layers)]
    if cache.capacity != 2:
        raise ExerciseFailed(f"a new cache reserves `capacity` rows: expected 2, got {cache.capacity!r}")
    _expect_contents(cache, 0, keys[0][:, :0], values[0][:, :0], "a new cache")
    # (rows appended, capacity expected afterwards): a prefill of 3, two decode steps, a chunk of 4, one more
    length = 0
    for n, capacity in ((3, 4), (1, 4), (1, 8), (4, 10), (1, 10)):
        when = f"after appending {n} to {length} rows"
        for layer in range(layers):
            step = slice(length, length + n)
            _append(cache, layer, keys[layer][:, step], values[layer][:, step], when, max_len)
        length += n
        if cache.capacity != capacity:
            hint = ("never beyond max_len" if cache.capacity > max_len else
                    "grow by doubling (at least to what is needed), so that n appends copy O(n) rows in all"
                    if cache.capacity < capacity else "grow only when the rows do not fit")
            raise ExerciseFailed(f"{when}: capacity should be {capacity}, got {cache.capacity!r}: {hint}")
        _expect_state(cache, [length] * layers, keys, values, when)
    extra_k, extra_v = torch.randn(heads, 1, head_dim, generator=g), torch.randn(heads, 1, head_dim, generator=g)
    _expect_full(_raised(lambda: cache.append(0, extra_k, extra_v)), max_len)
    if cache.seq_len(0) != max_len:
        raise ExerciseFailed("the append that was refused still changed the cache's length: check before updating")
    _expect_contents(cache, 0, keys[0], values[0], "after a refused append")

    # A prompt longer than twice the capacity arrives in one chunk: doubling once is not enough.
    big = cls(layers, heads, head_dim, capacity=2, max_len=5)
    _append(big, 0, keys[0][:, :5], values[0][:, :5], "a 5-row prefill into a new cache of capacity 2", 5)
    if big.capacity != 5:
        raise ExerciseFailed(f"a 5-row prefill into capacity 2 (max_len 5): capacity should be 5, got "
                             f"{big.capacity!r}: grow to max(2 * capacity, needed), capped at max_len")
    _expect_state(big, [5, 0], keys, values, "after a 5-row prefill into layer 0 only")

    # Layers filled unevenly (as during a forward pass), and a refused append that would have grown the buffer.
    uneven = cls(layers, heads, head_dim, capacity=2, max_len=max_len)
    _append(uneven, 0, keys[0][:, :3], values[0][:, :3], "3 rows into layer 0 of a new cache", max_len)
    _append(uneven, 1, keys[1][:, :1], values[1][:, :1], "then 1 row into layer 1", max_len)
    _expect_state(uneven, [3, 1], keys, values, "after 3 rows into layer 0 and 1 into layer 1")
    more_k, more_v = torch.randn(heads, 8, head_dim, generator=g), torch.randn(heads, 8, head_dim, generator=g)
    _expect_full(_raised(lambda: uneven.append(0, more_k, more_v)), max_len)
    when = f"after a refused append of 8 rows to layer 0's 3 (max_len={max_len})"
    if uneven.capacity != 4:
        raise ExerciseFailed(f"{when}: capacity should still be 4, got {uneven.capacity!r}: a refused append "
                             "leaves the cache as it was, so check that the rows fit before growing")
    _expect_state(uneven, [3, 1], keys, values, when)
    _append(uneven, 1, keys[1][:, 1:4], values[1][:, 1:4], "then 3 more rows into layer 1", max_len)
    _expect_state(uneven, [3, 4], keys, values, "after 3 more rows into layer 1")

    small = cls(layers, heads, head_dim, capacity=4, max_len=8)
    bad_inputs = (
        ("a key with head_dim 4 instead of 3", (heads, 1, head_dim + 1), (heads, 1, head_dim + 1)),
        ("a key for 3 heads instead of 2", (heads + 1, 1, head_dim), (heads + 1, 1, head_dim)),
        ("keys for 2 tokens but values for 1", (heads, 2, head_dim), (heads, 1, head_dim)),
        ("a key without the heads dimension", (1, head_dim), (1, head_dim)),
    )
    for what, k_shape, v_shape in bad_inputs:
        k, v = torch.zeros(k_shape), torch.zeros(v_shape)
        failure = _raised(lambda k=k, v=v: small.append(0, k, v))
        if failure is None or failure[0] != "ValueError":
            raise ExerciseFailed(f"{what} should raise ValueError naming the expected shape "
                                 f"[heads, tokens, head_dim], got {'no error' if failure is None else failure[0]}")
        if small.seq_len(0) != 0:
            raise ExerciseFailed(f"{what} was refused but still counted: validate before changing anything")
    return ("appends per layer (each its own length), grows to max(2 x capacity, needed) up to max_len, refuses full "
            "appends and bad shapes leaving the cache as it was")


# ---- the generation loop, timed ----------------------------------------------------------------------



def _reference_generation(prompt, max_new_tokens, eos_id, vocab_size, prefill_ms, step_ms):
    clock = SimulatedClock()
    lm = ScriptedLM(vocab_size, clock, prefill_ms, step_ms)
    arrival, tokens, stamps = clock(), [], []
    token = int(lm(prompt).argmax())
    while True:
        tokens.append(token)
        stamps.append(clock())
        if token == eos_id or len(tokens) == max_new_tokens:
            break
        token = int(lm([token]).argmax())
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return tokens, stamps[0] - arrival, tpot, lm.calls


def _generation_cases():
    vocab, prefill_ms, step_ms = 50, 3.0, [11.0, 9.0, 14.0, 10.0, 12.0]
    prompt = [5, 17, 3, 42, 8]
    free, *_ = _reference_generation(prompt, 12, -1, vocab, prefill_ms, step_ms)
    eos = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])  # first seen after a few tokens
    absent = next(t for t in range(vocab) if t not in free)
    cases = [
        ("stops at EOS", prompt, 12, eos, vocab, prefill_ms, step_ms),
        ("runs to max_new_tokens", prompt, 7, absent, vocab, prefill_ms, step_ms),
        ("one token only", [9, 4], 1, absent, vocab, prefill_ms, step_ms),
        ("EOS first", prompt, 12, free[0], vocab, prefill_ms, step_ms),
    ]
    # Then prompts, models and timings drawn at random, EOS at a random step or never: no answer is known ahead.
    rng = seeded_random(404)
    for _ in range(4):
        vocab = rng.randint(20, 200)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        prefill_ms, step_ms = rng.randint(5, 50) / 10, [rng.randint(20, 300) / 10 for _ in range(rng.randint(1, 6))]
        max_new = rng.randint(2, 16)
        free, *_ = _reference_generation(prompt, max_new, -1, vocab, prefill_ms, step_ms)
        eos = rng.choice(free) if rng.random() < 0.6 else next(t for t in range(vocab) if t not in free)
        cases.append((f"a ScriptedLM of vocab_size {vocab}, prefill_ms {prefill_ms}, step_ms {step_ms}", prompt,
                      max_new, eos, vocab, prefill_ms, step_ms))
    return cases


@exercise("04", "generate_timed", forbidden=("labkit.model.generate.generate", "labkit_course.worked_example.generate",
                                             "labkit_course.grading.labs.lab04._reference_generation"))
def generate_timed(ns):
    fn = require(ns, "generate_timed")
    for name, prompt, max_new, eos, vocab, prefill_ms, step_ms in _generation_cases():
        tokens, ttft, tpot, calls = _reference_generation(prompt, max_new, eos, vocab, prefill_ms, step_ms)
        clock = SimulatedClock()
        lm = ScriptedLM(vocab, clock, prefill_ms, step_ms)
        got = fn(lm, list(prompt), max_new, eos, clock)
        where = f"prompt {prompt}, max_new_tokens={max_new}, eos_id={eos} ({name})"
        if not isinstance(got, tuple) or len(got) != 3:
            raise ExerciseFailed(f"return (tokens, ttft, tpot), got {type(got).__name__}")
        got_tokens, got_ttft, got_tpot = got
        fed = lm.calls
        if fed and fed[0] != prompt:
            if fed[0] == prompt[:1]:
                raise ExerciseFailed(f"{where}: the prompt was fed one token at a time; a prefill runs the "
                                     "whole prompt in one call")
            raise ExerciseFailed(f"{where}: the first call must be the prompt (the prefill), got {fed[0]}")
        if any(len(call) > 1 for call in fed[1:]):
            raise ExerciseFailed(f"{where}: a decode step fed {max(len(c) for c in fed[1:])} tokens; the model "
                                 "keeps its KV cache, so feed it only the newest token, not the whole sequence")
        if len(fed) > 1 and fed[1] == prompt[-1:] and fed[1] != [tokens[0]]:
            raise ExerciseFailed(f"{where}: the first decode step re-fed the prompt's last token; feed the token "
                                 "the prefill just produced")
        if not isinstance(got_tokens, list | tuple) or not all(isinstance(t, int) for t in got_tokens):
            raise ExerciseFailed(f"{where}: tokens should be a list of ints, got {got_tokens!r:.80}")
        got_tokens = list(got_tokens)
        if got_tokens != tokens:
            if got_tokens == tokens[:-1] and tokens[-1] == eos:
                raise ExerciseFailed(f"{where}: EOS was dropped; like the book's loop, append it, then stop")
            if len(got_tokens) > len(tokens) and got_tokens[:len(tokens)] == tokens:
                why = ("kept going after EOS: stop once it is generated" if tokens[-1] == eos else
                       f"generated {len(got_tokens)} tokens: max_new_tokens counts every generated token, "
                       "the one the prefill produces included")
                raise ExerciseFailed(f"{where}: {why}")
            if len(got_tokens) < len(tokens) and got_tokens == tokens[:len(got_tokens)]:
                raise ExerciseFailed(f"{where}: stopped after {len(got_tokens)} tokens, expected {len(tokens)}")
            raise ExerciseFailed(f"{where}: expected the greedy tokens {tokens}, got {got_tokens} (the argmax of "
                                 "each step's logits, each fed back as the next input)")
        if len(fed) != len(calls):
            raise ExerciseFailed(f"{where}: {len(fed)} model calls for {len(tokens)} tokens; one prefill and one "
                                 f"decode step per further token make {len(calls)} (no call after the last token)")
        if not isinstance(got_ttft, int | float) or not math.isclose(got_ttft, ttft, abs_tol=1e-9):
            if isinstance(got_ttft, int | float) and math.isclose(got_ttft, 0.0, abs_tol=1e-9):
                raise ExerciseFailed(f"{where}: TTFT came out 0: read the clock when the request arrives, "
                                     "before the prefill")
            raise ExerciseFailed(f"{where}: TTFT should be {ttft:.4f} s (first token's time minus the arrival), "
                                 f"got {got_ttft!r}")
        n = len(tokens)
        if tpot is None:
            if got_tpot is not None:
                raise ExerciseFailed(f"{where}: one token has no gap after it: its TPOT is None, not {got_tpot!r}")
            continue
        if not isinstance(got_tpot, int | float):
            raise ExerciseFailed(f"{where}: TPOT should be a number of seconds, got {got_tpot!r}")
        if math.isclose(got_tpot, tpot, abs_tol=1e-9):  # before the mistakes: drawn timings can make them agree
            continue
        if math.isclose(got_tpot, tpot * (n - 1) / n, abs_tol=1e-9):
            raise ExerciseFailed(f"{where}: {n} tokens have {n - 1} gaps between them; TPOT divides by n - 1")
        if math.isclose(got_tpot, (ttft + tpot * (n - 1)) / n, abs_tol=1e-9):
            raise ExerciseFailed(f"{where}: TPOT is the pace after the first token; the wait for the first one "
                                 "(TTFT) is not part of it")
        raise ExerciseFailed(f"{where}: TPOT should be {tpot:.4f} s (mean gap between tokens), got {got_tpot!r}")
    return "prefill once, then one token per step until EOS or max_new_tokens; TTFT and TPOT from the clock"


# ---- counting the work ---------------------------------------------------------------------------------

def _score_dot_products(prompt_len, decode_steps, *, cached, square=True, prefill=True, offset=0):
    """Query-key dot products for one head; the keywords reproduce the usual miscounts."""
    total = prompt_len**2 if prefill else 0
    for step in range(1, decode_steps + 1):
        length = prompt_len + step + offset
        total += length if cached or not square else length**2
    return total


@exercise("04", "count_work", forbidden=("labkit_course.worked_example.projection_matvecs",
                                         "labkit_course.grading.labs.lab04._score_dot_products"))
def count_work(ns):
    fn = require(ns, "count_work")
    rng = seeded_random(405)
    cases = [(2, 3), (512, 512), (4096, 64), (64, 4096), (7, 0), (1, 1), (100, 37)] + [
        (rng.randint(1, 3000), rng.randint(0, 3000)) for _ in range(4)]  # and sizes no notebook can know ahead
    for n, m in cases:
        for cached in (True, False):
            got = fn(n, m, cached=cached)
            where = f"count_work({n}, {m}, cached={cached})"
            if not isinstance(got, tuple) or len(got) != 2 or not all(isinstance(v, int) for v in got):
                raise ExerciseFailed(f"{where}: return two ints (projections, score dot products), got {got!r:.80}")
            projections, scores = got
            want_p = ref.projection_matvecs(n, m, cached=cached)
            want_s = _score_dot_products(n, m, cached=cached)
            if projections != want_p:
                if projections == ref.projection_matvecs(n, m, cached=cached, per_token=1):
                    raise ExerciseFailed(f"{where}: {projections} projections counts one per token; each token "
                                         "processed needs three, for Q, K and V")
                if projections == ref.projection_matvecs(n, m, cached=cached, per_token=2):
                    raise ExerciseFailed(f"{where}: {projections} projections counts K and V only; the query "
                                         "is projected too (three per token)")
                if projections == want_p - 3 * n:
                    raise ExerciseFailed(f"{where}: the prefill's projections are missing; count the whole "
                                         "generation, prompt included")
                if not cached and projections == ref.projection_matvecs(n, m, cached=True):
                    raise ExerciseFailed(f"{where}: without a cache each decode step re-projects the whole "
                                         "sequence, n + s tokens at step s")
                raise ExerciseFailed(f"{where}: expected {want_p} projections, got {projections}")
            if scores != want_s:
                if not cached and scores == _score_dot_products(n, m, cached=False, square=False):
                    raise ExerciseFailed(f"{where}: without a cache a step recomputes the whole (n+s) x (n+s) score "
                                         "matrix, not one row: that is where O(m (n+m)^2) comes from")
                if scores == _score_dot_products(n, m, cached=cached, prefill=False):
                    raise ExerciseFailed(f"{where}: the prefill's n x n scores are missing")
                if scores in (_score_dot_products(n, m, cached=cached, offset=-1),
                              _score_dot_products(n, m, cached=cached, offset=1)) and m:
                    raise ExerciseFailed(f"{where}: off by one: at decode step s (1 .. m) the sequence holds n + s "
                                         "tokens, the new one included, and the query sees all of them")
                raise ExerciseFailed(f"{where}: expected {want_s} score dot products, got {scores}")
    return "projections and score dot products, cached O(nm + m^2) and uncached O(m(n+m)^2), exact"


@exercise("04", "knowledge_check")
def knowledge_check(ns):
    from labkit_course.grading.quiz import Choice, Number, grade_answers

    model = ref.load_worked_example()
    _, cache = ref.generate(model, [model.token_id("I"), model.token_id("love")], steps=2)
    return grade_answers(ns, {
        1: Number(len(cache), "Step 3: each step appends one row per head"),
        2: Number(ref.projection_matvecs(512, 512, cached=True), "'The work, counted': with a cache each "
                  "token is projected once"),
        3: Choice("a", "Step 3, on attending over every position"),
        4: Choice("b", "'Proof: the cache changes the cost, not the answer'"),
        5: Choice("b", "the correction of the book's cost formula, after 'The work, counted'"),
        6: Number(1e3 * (0.45 - 0.30) / 3, "'The generation loop': TPOT is the mean gap between consecutive "
                  "tokens, three gaps for four tokens", rel_tol=1e-6),
    })
