/* Paged decode attention on a CPU: one query token per sequence against its whole context, read
 * straight from the block pool through the block table (no gathered copy of the context).
 *
 * Layouts (all contiguous, element offsets):
 *   q, out            [num_seqs, num_heads, head_dim]
 *   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables      [num_seqs, max_blocks] int32, context_lens [num_seqs] int32
 * Element type: float32 or bfloat16 (q, caches and out alike); every sum is in float32.
 *
 * Blocks are visited in table order, the next one's rows prefetched meanwhile. A block is scored,
 * then its values summed, one KV head at a time: each token's K (and V) row of a KV head is read once
 * for the group of query heads sharing it (GQA), and the group's sums stay in registers for the whole
 * block (1.3-1.5x faster with the pools in cache than keeping every head's sums in memory, the same
 * results bit for bit). On AVX-512 the scores of 16 tokens are summed across lanes together
 * (sum_lanes16), elsewhere one at a time. Each query head keeps the online softmax of the
 * PagedAttention lesson ("Block-wise Softmax Computation"): a running max, a running denominator and
 * a running weighted sum of values, rescaled when the max grows, so no block needs another in memory.
 *
 * Single-threaded: the engine runs one thread per process in its tests and benchmarks. The caller
 * (labkit/attention/cpu_decode.py) validates every shape, dtype and block id before calling; this
 * file trusts its arguments. No fast-math flags are needed: every reduction spells out its order.
 */
#include <float.h>

#include "simd.h" /* head_dim must be a multiple of 16 (the caller checks): whole vectors on every ISA */
#if LANES == 16
#include <immintrin.h> /* AVX-512: a few steps below are spelled in its intrinsics */
#endif

/* LANES elements from i of a float32 (bf16 = 0) or bfloat16 (bf16 = 1) array. bf16 is a compile-time
 * constant at every call site, so each exported entry point gets its own branch-free kernel. */
INLINE fvec loadv(const void *base, int64_t i, int bf16) {
    fvec v;
#if LANES == 16 /* AVX-512: one widening load (the generic code below compiled to two halves and a merge) */
    if (bf16) {
        const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i))), 16);
        memcpy(&v, &bits, sizeof v);
        return v;
    }
#endif
    if (bf16) {
        u16vec raw;
        memcpy(&raw, (const uint16_t *)base + i, sizeof raw);
        const uvec bits = __builtin_convertvector(raw, uvec) << 16; /* bf16 is float32's top half */
        memcpy(&v, &bits, sizeof v);
    } else {
        memcpy(&v, (const float *)base + i, sizeof v);
    }
    return v;
}

INLINE void storev(void *base, int64_t i, fvec v, int bf16) {
    if (bf16) {
        const u16vec top = fvec_to_bf16(v);
        memcpy((uint16_t *)base + i, &top, sizeof top);
    } else {
        memcpy((float *)base + i, &v, sizeof v);
    }
}

/* Lane-wise a > b ? a : b, as a bit select (C has no ?: on vectors). */
INLINE fvec maxv(fvec a, fvec b) {
    const ivec take_a = a > b;
    return (fvec)((take_a & (ivec)a) | (~take_a & (ivec)b));
}

/* The sum of the lanes. AVX-512: halves added together, 16 -> 8 -> 4 -> 1, in vector registers;
 * narrower vectors lane by lane. */
#if LANES == 16
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
INLINE float sumv(fvec v) {
    f32x8 low, high;
    memcpy(&low, &v, sizeof low);
    memcpy(&high, (const char *)&v + sizeof low, sizeof high);
    low += high;
    f32x4 a, b;
    memcpy(&a, &low, sizeof a);
    memcpy(&b, (const char *)&low + sizeof a, sizeof b);
    a += b;
    return (a[0] + a[2]) + (a[1] + a[3]);
}
#else
INLINE float sumv(fvec v) {
    float sum = v[0];
    for (int j = 1; j < LANES; j++)
        sum += v[j];
    return sum;
}
#endif

#if LANES == 16
/* Lane t of the result: the sum of the lanes of v[t], for 16 vectors at once. A transposing tree of
 * 45 shuffles and adds, where sumv took ~12 instructions a vector; AVX-512 only. */
INLINE fvec sum_lanes16(const fvec *v) {
    __m512 pairs[8], quads[4];
    for (int j = 0; j < 8; j++) { /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of v[2j], v[2j+1] */
        __m512 x, y;
        memcpy(&x, v + 2 * j, sizeof x);
        memcpy(&y, v + 2 * j + 1, sizeof y);
        pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    for (int j = 0; j < 4; j++) { /* per 128-bit lane k: the sums over that lane of v[4j .. 4j+3] */
        const __m512d x = _mm512_castps_pd(pairs[2 * j]), y = _mm512_castps_pd(pairs[2 * j + 1]);
        quads[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 halves[2];
    for (int j = 0; j < 2; j++) /* 128-bit lanes 0+1 and 2+3 of quads[2j], then of quads[2j+1] */
        halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
    fvec out;
    memcpy(&out, &sums, sizeof out);
    return out;
}
#endif

/* e^x lane-wise for x <= 0 (softmax weights after subtracting the max), without libm: x = n ln2 + r
 * with |r| <= ln2 / 2, Cephes' expf polynomial for e^r (about 1 ulp), 2^n built in the exponent
 * bits. Clamped at -87, near the smallest normal float: weights that small vanish next to the max's
 * weight of 1. */
INLINE fvec expv_nonpositive(fvec x) {
    x = maxv(x, (fvec){0} - 87.0f);
    const ivec n = __builtin_convertvector(x * 1.44269504f - 0.5f, ivec); /* truncation: round(x / ln2) */
    const fvec nf = __builtin_convertvector(n, fvec);
    const fvec r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
    fvec p = (fvec){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (fvec)((n + 127) << 23);
}

INLINE float exp_nonpositive(float x) { return expv_nonpositive((fvec){0} + x)[0]; }

/* Where the block after (s, b) starts in the pools (element offset) in the order the kernel reads
 * them (a sequence's blocks, then the next sequence's), and its token count in *n; -1 after the last. */
INLINE int64_t next_block(const int32_t *block_tables, const int32_t *context_lens, int num_seqs, int max_blocks,
                          int block_size, int64_t row, int s, int b, int *n) {
    if (++b * block_size >= context_lens[s]) {
        if (++s == num_seqs) return -1;
        b = 0;
    }
    const int rest = context_lens[s] - b * block_size;
    *n = rest < block_size ? rest : block_size;
    return (int64_t)block_tables[(int64_t)s * max_blocks + b] * block_size * row;
}

/* Ask for KV head h's part of one token's row, at element offset `at` of a pool, into L2 (prefetcht1):
 * the rows come from memory, since a step's weights have swept the caches since the last layer, and a
 * core has more outstanding misses to L2 than to L1. Measured on AMD Zen 4 with 30 layers' pools cold:
 * 7.4 GB/s of K and V read with prefetcht0, 10-11 with prefetcht1, no change with the pools in cache. */
INLINE void prefetch_part(const void *pool, int64_t at, int dim, int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t line = 0; line < dim * size; line += 64)
        __builtin_prefetch((const char *)pool + at * size + line, 0, 2);
}

/* The max of the lanes: AVX-512's reduction, elsewhere lane by lane. */
#if LANES == 16
INLINE float max_lanes(fvec v) {
    __m512 m;
    memcpy(&m, &v, sizeof m);
    return _mm512_reduce_max_ps(m);
}
#else
INLINE float max_lanes(fvec v) {
    float m = v[0];
    for (int j = 1; j < LANES; j++)
        m = v[j] > m ? v[j] : m;
    return m;
}
#endif

/* dots[g * step] = query head g of the group (qh) times token `token`'s K row of head h, lane by lane
 * (the score is the sum of the lanes), asking meanwhile for the same head's part of the next block's
 * row `token` (`next`: its offset, -1 when none). kv: the caller's array of `chunks` vectors. */
INLINE void token_dots(fvec *dots, int step, fvec *kv, const fvec *qh, const void *k_cache, int64_t block,
                       int64_t next, int next_n, int64_t row, int h, int token, int group, int chunks, int bf16) {
    const int dim = LANES * chunks;
    if (next >= 0 && token < next_n)
        prefetch_part(k_cache, next + token * row + h * dim, dim, bf16);
    UNROLL for (int c = 0; c < chunks; c++)
        kv[c] = loadv(k_cache, block + token * row + h * dim + LANES * c, bf16);
    UNROLL for (int g = 0; g < group; g++) {
        fvec dot = qh[g * chunks] * kv[0];
        UNROLL for (int c = 1; c < chunks; c++)
            dot += qh[g * chunks + c] * kv[c];
        dots[g * step] = dot;
    }
}

/* The scores of KV head h's group of query heads against the n tokens of one block (K rows from
 * element offset `block`), into weight[i * stride + t] for query head i. */
INLINE void block_scores(fvec *kv, const fvec *query, const void *k_cache, int64_t block, int64_t next,
                         int next_n, int64_t row, int h, int n, int group, int chunks, float *weight, int stride,
                         int bf16) {
    const fvec *qh = query + (int64_t)h * group * chunks;
#if LANES == 16 /* 16 tokens' dot products summed across lanes at once (sum_lanes16) */
    for (int t0 = 0; t0 < n; t0 += 16) {
        fvec dots[group][16];
        for (int t = 0; t < 16; t++) {
            if (t0 + t < n) {
                token_dots(&dots[0][t], 16, kv, qh, k_cache, block, next, next_n, row, h, t0 + t, group, chunks, bf16);
            } else {
                UNROLL for (int g = 0; g < group; g++)
                    dots[g][t] = (fvec){0};
            }
        }
        for (int g = 0; g < group; g++)
            storev(weight + (int64_t)(h * group + g) * stride, t0, sum_lanes16(dots[g]), 0);
    }
#else
    fvec dots[group];
    for (int t = 0; t < n; t++) {
        token_dots(dots, 1, kv, qh, k_cache, block, next, next_n, row, h, t, group, chunks, bf16);
        UNROLL for (int g = 0; g < group; g++)
            weight[(int64_t)(h * group + g) * stride + t] = sumv(dots[g]);
    }
#endif
}

/* acc of KV head h's group of query heads += the block's weights times its n V rows, the group's
 * sums held in the caller's array `sums` (group * chunks vectors, kept in registers where both are
 * constants) for the whole block; asks for the next block's rows as above. */
INLINE void block_values(fvec *sums, fvec *kv, fvec *acc, const void *v_cache, int64_t block, int64_t next,
                         int next_n, int64_t row, int h, int n, int group, int chunks, const float *weight,
                         int stride, int bf16) {
    const int dim = LANES * chunks;
    fvec *ah = acc + (int64_t)h * group * chunks;
    UNROLL for (int j = 0; j < group * chunks; j++)
        sums[j] = ah[j];
    for (int t = 0; t < n; t++) {
        if (next >= 0 && t < next_n)
            prefetch_part(v_cache, next + t * row + h * dim, dim, bf16);
        UNROLL for (int c = 0; c < chunks; c++)
            kv[c] = loadv(v_cache, block + t * row + h * dim + LANES * c, bf16);
        UNROLL for (int g = 0; g < group; g++) {
            const float w = weight[(int64_t)(h * group + g) * stride + t];
            UNROLL for (int c = 0; c < chunks; c++)
                sums[g * chunks + c] += w * kv[c];
        }
    }
    UNROLL for (int j = 0; j < group * chunks; j++)
        ah[j] = sums[j];
}

/* The two per-block steps for one (group, head_dim, dtype) as functions of their own, with arrays of
 * constant size (GCC keeps such an array in registers once every loop over it is unrolled; a
 * variable-length one stays in memory), and one general pair for other shapes. */
typedef void scores_fn(const fvec *query, const void *k_cache, int64_t block, int64_t next, int next_n, int64_t row,
                       int h, int n, int group, int chunks, float *weight, int stride);
typedef void values_fn(fvec *acc, const void *v_cache, int64_t block, int64_t next, int next_n, int64_t row, int h,
                       int n, int group, int chunks, const float *weight, int stride);
#define BLOCK_STEPS(suffix, bf16, group_, chunks_)                                                        \
    static void scores_##suffix(const fvec *query, const void *k_cache, int64_t block, int64_t next,         \
                                int next_n, int64_t row, int h, int n, int group, int chunks, float *weight,  \
                                int stride) {                                                                \
        (void)group, (void)chunks; /* the fixed pairs use their constants */                                 \
        fvec kv[chunks_];                                                                                    \
        block_scores(kv, query, k_cache, block, next, next_n, row, h, n, group_, chunks_, weight, stride,    \
                     bf16);                                                                                  \
    }                                                                                                        \
    static void values_##suffix(fvec *acc, const void *v_cache, int64_t block, int64_t next, int next_n,     \
                                int64_t row, int h, int n, int group, int chunks, const float *weight,       \
                                int stride) {                                                                \
        (void)group, (void)chunks;                                                                           \
        fvec kv[chunks_], sums[group_ * chunks_];                                                            \
        block_values(sums, kv, acc, v_cache, block, next, next_n, row, h, n, group_, chunks_, weight, stride, \
                     bf16);                                                                                  \
    }
/* The (GQA group, head_dim) pairs compiled with both fixed: most models' shapes. */
#define FIXED_SHAPES(X) X(1, 64) X(2, 64) X(3, 64) X(4, 64) X(8, 64) X(1, 128) X(2, 128) X(3, 128) X(4, 128) X(8, 128)
#define FIXED_STEPS(group, dim)                                                                              \
    BLOCK_STEPS(f32_##group##_##dim, 0, group, dim / LANES)                                                  \
    BLOCK_STEPS(bf16_##group##_##dim, 1, group, dim / LANES)
FIXED_SHAPES(FIXED_STEPS)
BLOCK_STEPS(f32_any, 0, group, chunks)
BLOCK_STEPS(bf16_any, 1, group, chunks)

/* The block steps for this shape and dtype: a fixed pair where one was compiled, else the general. */
static void pick_steps(int group, int dim, int bf16, scores_fn **scores, values_fn **values) {
#define PICK(g, d)                                                                                           \
    if (group == g && dim == d) {                                                                            \
        *scores = bf16 ? scores_bf16_##g##_##d : scores_f32_##g##_##d;                                       \
        *values = bf16 ? values_bf16_##g##_##d : values_f32_##g##_##d;                                       \
        return;                                                                                              \
    }
    FIXED_SHAPES(PICK)
#undef PICK
    *scores = bf16 ? scores_bf16_any : scores_f32_any;
    *values = bf16 ? values_bf16_any : values_f32_any;
}

/* Folds a block's scores (scores[0:n]) into one query head's online softmax: the block's weights
 * replace its scores in place, and the running sums are rescaled when the max grows. */
INLINE void block_softmax(float *scores, int n, float *running_max, float *denom, fvec *acc, int chunks) {
    const int used = (n + LANES - 1) / LANES * LANES;
    /* padding of a partly filled block: weighs e^-87, which vanishes next to the max's weight of 1 */
    for (int t = n; t < used; t++)
        scores[t] = -FLT_MAX;
    fvec lanes = loadv(scores, 0, 0);
    for (int t = LANES; t < used; t += LANES)
        lanes = maxv(lanes, loadv(scores, t, 0));
    const float block_max = max_lanes(lanes);
    const float new_max = block_max > *running_max ? block_max : *running_max;
    fvec sum = {0};
    for (int t = 0; t < used; t += LANES) {
        const fvec p = expv_nonpositive(loadv(scores, t, 0) - new_max);
        storev(scores, t, p, 0);
        sum += p;
    }
    const float alpha = exp_nonpositive(*running_max - new_max);
    *denom = *denom * alpha + sumv(sum);
    for (int c = 0; c < chunks; c++)
        acc[c] *= alpha;
    *running_max = new_max;
}

INLINE void decode(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                   const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads, int dim,
                   int block_size, int max_blocks, float scale, int bf16) {
    const int group = num_heads / num_kv_heads, chunks = dim / LANES;
    const int64_t row = (int64_t)num_kv_heads * dim; /* one token's K (or V) for all KV heads */
    scores_fn *scores;
    values_fn *values;
    pick_steps(group, dim, bf16, &scores, &values);
    /* Per query head: its scaled query, running max, denominator and weighted sum of values, and the
     * current block's scores (then weights). Query head i uses KV head i / group. */
    fvec query[num_heads * chunks], acc[num_heads * chunks];
    const int stride = (block_size + 15) / 16 * 16; /* a block's scores, padded to whole vectors */
    float weight[num_heads * stride] __attribute__((aligned(64)));
    float running_max[num_heads], denom[num_heads];

    for (int s = 0; s < num_seqs; s++) {
        const int len = context_lens[s];
        const int32_t *table = block_tables + (int64_t)s * max_blocks;
        for (int i = 0; i < num_heads * chunks; i++) {
            query[i] = loadv(q, (int64_t)s * num_heads * dim + LANES * i, bf16) * scale;
            acc[i] = (fvec){0};
        }
        for (int i = 0; i < num_heads; i++) {
            running_max[i] = -FLT_MAX;
            denom[i] = 0.0f;
        }
        /* Block by block, KV head by KV head: each K (then V) row of a head is read once for the group
         * of query heads that shares it. The next block's rows are asked for a head's part at a time
         * beside this block's reads: blocks lie wherever the allocator put them, so the hardware
         * prefetcher, which follows sequential addresses, cannot guess them, and asked for all at once
         * they filled the core's miss buffers and stalled the compute. */
        for (int b = 0; b * block_size < len; b++) {
            const int n = len - b * block_size < block_size ? len - b * block_size : block_size;
            const int64_t block = (int64_t)table[b] * block_size * row;
            int next_n = 0;
            const int64_t next = next_block(block_tables, context_lens, num_seqs, max_blocks, block_size, row, s, b,
                                            &next_n);
            for (int h = 0; h < num_kv_heads; h++)
                scores(query, k_cache, block, next, next_n, row, h, n, group, chunks, weight, stride);
            for (int i = 0; i < num_heads; i++) /* online softmax: fold this block into the running sums */
                block_softmax(weight + (int64_t)i * stride, n, running_max + i, denom + i, acc + i * chunks, chunks);
            for (int h = 0; h < num_kv_heads; h++)
                values(acc, v_cache, block, next, next_n, row, h, n, group, chunks, weight, stride);
        }
        for (int i = 0; i < num_heads; i++)
            for (int c = 0; c < chunks; c++)
                storev(out, ((int64_t)s * num_heads + i) * dim + LANES * c, acc[i * chunks + c] * (1.0f / denom[i]),
                       bf16);
    }
}

#define ENTRY_POINT(name, bf16)                                                                            \
    void name(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,      \
              const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,      \
              int dim, int block_size, int max_blocks, float scale) {                                    \
        decode(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads,   \
               dim, block_size, max_blocks, scale, bf16);                                                 \
    }

ENTRY_POINT(paged_decode_attention_f32, 0)
ENTRY_POINT(paged_decode_attention_bf16, 1)
