/* Paged decode attention on a CPU: one query token per sequence against its whole context, read
 * straight from the block pool through the block table (no gathered copy of the context).
 *
 * Layouts (all contiguous, element offsets):
 *   q, out            [num_seqs, num_heads, head_dim]
 *   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables      [num_seqs, max_blocks] int32, context_lens [num_seqs] int32
 * Element type: float32 or bfloat16 (q, caches and out alike); every sum is in float32.
 *
 * Blocks are visited in table order, the next one's rows prefetched meanwhile; each token's K (and
 * V) row of a KV head is read once for the group of query heads sharing it (GQA). On AVX-512 the
 * scores of 16 tokens are summed across lanes together (sum_lanes16), elsewhere one at a time. Each
 * query head keeps the online softmax of the PagedAttention lesson ("Block-wise Softmax
 * Computation"): a running max, a running denominator and a running weighted sum of values, rescaled
 * when the max grows, so no block needs another in memory.
 *
 * Single-threaded: the engine runs one thread per process in its tests and benchmarks. The caller
 * (labkit/attention/cpu_decode.py) validates every shape, dtype and block id before calling; this
 * file trusts its arguments. No fast-math flags are needed: every reduction spells out its order.
 */
#include <float.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* LANES floats as GCC/clang vector extensions, LANES set by the build for this CPU (16 for AVX-512,
 * 8 for AVX2, 4 for NEON and SSE2): one register of the ISA, no intrinsics per ISA. head_dim must be
 * a multiple of 16 (the caller checks). */
#ifndef LANES
#define LANES 16
#endif
#if LANES == 16
#include <immintrin.h> /* AVX-512: a few steps below are spelled in its intrinsics */
#endif
typedef float fvec __attribute__((vector_size(4 * LANES)));
typedef int32_t ivec __attribute__((vector_size(4 * LANES)));
typedef uint32_t uvec __attribute__((vector_size(4 * LANES)));
typedef uint16_t u16vec __attribute__((vector_size(2 * LANES)));

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
        uvec bits;
        memcpy(&bits, &v, sizeof bits);
        bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest even (outputs are finite) */
        const u16vec top = __builtin_convertvector(bits >> 16, u16vec);
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

/* The max of the lanes (once per block and head: plain scalar compares will do). */
INLINE float hmaxv(fvec v) {
    float m = v[0];
    for (int j = 1; j < LANES; j++)
        m = v[j] > m ? v[j] : m;
    return m;
}
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

/* Ask for one token's row (all KV heads) at element offset `at` of a pool, into L2 (prefetcht1): the
 * rows come from memory, since a step's weights have swept the caches since the last layer, and a
 * core has more outstanding misses to L2 than to L1. Measured on AMD Zen 4 with 30 layers' pools cold:
 * 7.4 GB/s of K and V read with prefetcht0, 10-11 with prefetcht1, no change with the pools in cache. */
INLINE void prefetch_row(const void *pool, int64_t at, int64_t row, int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t line = 0; line < row * size; line += 64)
        __builtin_prefetch((const char *)pool + at * size + line, 0, 2);
}

INLINE void decode(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                   const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
                   int chunks, int block_size, int max_blocks, float scale, int bf16) {
    const int group = num_heads / num_kv_heads, dim = LANES * chunks;
    const int64_t row = (int64_t)num_kv_heads * dim; /* one token's K (or V) for all KV heads */
    /* Per query head: its scaled query, running max, denominator and weighted sum of values, and the
     * current block's scores (then weights). Query head i uses KV head i / group. */
    fvec query[num_heads][chunks], acc[num_heads][chunks], kv_row[chunks];
    const int padded_block = (block_size + 15) / 16 * 16; /* a block's scores, padded to whole vectors */
    float weight[num_heads][padded_block] __attribute__((aligned(64)));
    float running_max[num_heads], denom[num_heads];

    for (int s = 0; s < num_seqs; s++) {
        const int len = context_lens[s];
        const int32_t *table = block_tables + (int64_t)s * max_blocks;
        for (int i = 0; i < num_heads; i++) {
            for (int c = 0; c < chunks; c++) {
                query[i][c] = loadv(q, ((int64_t)s * num_heads + i) * dim + LANES * c, bf16) * scale;
                acc[i][c] = (fvec){0};
            }
            running_max[i] = -FLT_MAX;
            denom[i] = 0.0f;
        }
        /* Block by block, token by token, KV head by KV head: the block's K (then V) is read in memory
         * order, each row once for the group of query heads that shares it. */
        for (int b = 0; b * block_size < len; b++) {
            const int n = len - b * block_size < block_size ? len - b * block_size : block_size;
            const int64_t block = (int64_t)table[b] * block_size * row;
            /* the next block's K and V rows are asked for one token at a time, beside this block's V rows
             * below: blocks lie wherever the allocator put them, so the hardware prefetcher, which
             * follows sequential addresses, cannot guess them; asked for all at once they filled the
             * core's miss buffers and stalled the compute (measured: over half the kernel's time) */
            int next_n = 0;
            const int64_t next = next_block(block_tables, context_lens, num_seqs, max_blocks, block_size, row, s, b,
                                            &next_n);
#if LANES == 16 /* 16 tokens' dot products summed at once (sum_lanes16) */
            for (int t0 = 0; t0 < n; t0 += 16)
                for (int h = 0; h < num_kv_heads; h++) {
                    fvec dots[group][16];
                    for (int t = 0; t < 16; t++) {
                        if (t0 + t >= n) {
                            for (int g = 0; g < group; g++)
                                dots[g][t] = (fvec){0};
                            continue;
                        }
                        for (int c = 0; c < chunks; c++)
                            kv_row[c] = loadv(k_cache, block + (t0 + t) * row + h * dim + LANES * c, bf16);
                        for (int g = 0; g < group; g++) {
                            const int i = h * group + g;
                            fvec dot = query[i][0] * kv_row[0];
                            for (int c = 1; c < chunks; c++)
                                dot += query[i][c] * kv_row[c];
                            dots[g][t] = dot;
                        }
                    }
                    for (int g = 0; g < group; g++)
                        storev(weight[h * group + g], t0, sum_lanes16(dots[g]), 0);
                }
#else
            for (int t = 0; t < n; t++)
                for (int h = 0; h < num_kv_heads; h++) {
                    for (int c = 0; c < chunks; c++)
                        kv_row[c] = loadv(k_cache, block + t * row + h * dim + LANES * c, bf16);
                    for (int i = h * group; i < (h + 1) * group; i++) {
                        fvec dot = query[i][0] * kv_row[0];
                        for (int c = 1; c < chunks; c++)
                            dot += query[i][c] * kv_row[c];
                        weight[i][t] = sumv(dot);
                    }
                }
#endif
            const int used = (n + 15) / 16 * 16;
            for (int i = 0; i < num_heads; i++) { /* online softmax: fold this block into the running sums */
                float *scores = weight[i];
                for (int t = n; t < used; t++)
                    scores[t] = -FLT_MAX; /* padding of a partly filled last block: weighs e^-87, */
                fvec max_lanes = loadv(scores, 0, 0);
                for (int t = LANES; t < used; t += LANES)
                    max_lanes = maxv(max_lanes, loadv(scores, t, 0));
                const float block_max = hmaxv(max_lanes);
                const float new_max = block_max > running_max[i] ? block_max : running_max[i];
                fvec sum_lanes = {0};
                for (int t = 0; t < used; t += LANES) {
                    const fvec p = expv_nonpositive(loadv(scores, t, 0) - new_max);
                    storev(scores, t, p, 0);
                    sum_lanes += p; /* which vanishes next to the max's weight of 1 */
                }
                const float alpha = exp_nonpositive(running_max[i] - new_max);
                denom[i] = denom[i] * alpha + sumv(sum_lanes);
                for (int c = 0; c < chunks; c++)
                    acc[i][c] *= alpha;
                running_max[i] = new_max;
            }
            for (int t = 0; t < n; t++) {
                if (next >= 0 && t < next_n) {
                    prefetch_row(k_cache, next + t * row, row, bf16);
                    prefetch_row(v_cache, next + t * row, row, bf16);
                }
                for (int h = 0; h < num_kv_heads; h++) {
                    for (int c = 0; c < chunks; c++)
                        kv_row[c] = loadv(v_cache, block + t * row + h * dim + LANES * c, bf16);
                    for (int i = h * group; i < (h + 1) * group; i++)
                        for (int c = 0; c < chunks; c++)
                            acc[i][c] += weight[i][t] * kv_row[c];
                }
            }
        }
        for (int i = 0; i < num_heads; i++)
            for (int c = 0; c < chunks; c++)
                storev(out, ((int64_t)s * num_heads + i) * dim + LANES * c, acc[i][c] * (1.0f / denom[i]), bf16);
    }
}

/* head_dim 64 and 128 (most models') get copies with the vector count fixed, which the compiler
 * unrolls; other multiples of 16 take the general loop. */
#define ENTRY_POINT(name, bf16)                                                                            \
    void name(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,      \
              const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,      \
              int dim, int block_size, int max_blocks, float scale) {                                    \
        if (dim == 64)                                                                                    \
            decode(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads, \
                   64 / LANES, block_size, max_blocks, scale, bf16);                                      \
        else if (dim == 128)                                                                              \
            decode(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads, \
                   128 / LANES, block_size, max_blocks, scale, bf16);                                     \
        else                                                                                              \
            decode(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads, \
                   dim / LANES, block_size, max_blocks, scale, bf16);                                     \
    }

ENTRY_POINT(paged_decode_attention_f32, 0)
ENTRY_POINT(paged_decode_attention_bf16, 1)
