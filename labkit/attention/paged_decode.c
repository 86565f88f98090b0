/* Paged decode attention on a CPU: one query token per sequence against its whole context, read
 * straight from the block pool through the block table (no gathered copy of the context).
 *
 * Layouts (all contiguous, element offsets):
 *   q, out            [num_seqs, num_heads, head_dim]
 *   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables      [num_seqs, max_blocks] int32, context_lens [num_seqs] int32
 * Element type: float32 or bfloat16 (q, caches and out alike); every sum is in float32.
 *
 * Per (sequence, KV head) the group of query heads sharing that KV head is processed together, so
 * each K and V row is read once for the whole group (GQA). Blocks are visited in table order with
 * the online softmax of the PagedAttention lesson ("Block-wise Softmax Computation"): a running
 * max, a running denominator and a running weighted sum of values, rescaled when the max grows.
 *
 * Single-threaded: the engine runs one thread per process in its tests and benchmarks. The caller
 * (labkit/attention/cpu_decode.py) validates every shape, dtype and block id before calling; this
 * file trusts its arguments. No fast-math flags are needed: every reduction spells out its order.
 */
#include <float.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* Sixteen lanes as GCC/clang vector extensions: the compiler maps them onto this CPU's registers
 * (one AVX-512 register, two AVX2 or four NEON ones) without intrinsics per ISA. head_dim must be a
 * multiple of 16 (the caller checks). */
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

/* 16 elements from i of a float32 (bf16 = 0) or bfloat16 (bf16 = 1) array. bf16 is a compile-time
 * constant at every call site, so each exported entry point gets its own branch-free kernel. */
INLINE f32x16 load16(const void *base, int64_t i, int bf16) {
    f32x16 v;
    if (bf16) {
        u16x16 raw;
        memcpy(&raw, (const uint16_t *)base + i, sizeof raw);
        const u32x16 bits = __builtin_convertvector(raw, u32x16) << 16; /* bf16 is float32's top half */
        memcpy(&v, &bits, sizeof v);
    } else {
        memcpy(&v, (const float *)base + i, sizeof v);
    }
    return v;
}

INLINE void store16(void *base, int64_t i, f32x16 v, int bf16) {
    if (bf16) {
        u32x16 bits;
        memcpy(&bits, &v, sizeof bits);
        bits += 0x7FFFu + ((bits >> 16) & 1u); /* round to nearest even (outputs are finite) */
        const u16x16 top = __builtin_convertvector(bits >> 16, u16x16);
        memcpy((uint16_t *)base + i, &top, sizeof top);
    } else {
        memcpy((float *)base + i, &v, sizeof v);
    }
}

/* Lane-wise a > b ? a : b, as a bit select (C has no ?: on vectors). */
INLINE f32x16 max16(f32x16 a, f32x16 b) {
    const i32x16 take_a = a > b;
    return (f32x16)((take_a & (i32x16)a) | (~take_a & (i32x16)b));
}

/* The sum (or max) of the 16 lanes, halving the width each step. */
#define REDUCE16(name, op)                                                                                \
    INLINE float name(f32x16 v) {                                                                        \
        float lanes[16];                                                                                  \
        memcpy(lanes, &v, sizeof lanes);                                                                  \
        for (int width = 8; width > 0; width /= 2)                                                        \
            for (int j = 0; j < width; j++)                                                               \
                lanes[j] = op(lanes[j], lanes[j + width]);                                                \
        return lanes[0];                                                                                  \
    }
#define ADD(a, b) ((a) + (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))
REDUCE16(sum16, ADD)
REDUCE16(hmax16, MAX)

/* e^x lane-wise for x <= 0 (softmax weights after subtracting the max), without libm: x = n ln2 + r
 * with |r| <= ln2 / 2, Cephes' expf polynomial for e^r (about 1 ulp), 2^n built in the exponent
 * bits. Clamped at -87, near the smallest normal float: weights that small vanish next to the max's
 * weight of 1. */
INLINE f32x16 exp16_nonpositive(f32x16 x) {
    x = max16(x, (f32x16){0} - 87.0f);
    const i32x16 n = __builtin_convertvector(x * 1.44269504f - 0.5f, i32x16); /* truncation: round(x / ln2) */
    const f32x16 nf = __builtin_convertvector(n, f32x16);
    const f32x16 r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
    f32x16 p = (f32x16){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (f32x16)((n + 127) << 23);
}

INLINE float exp_nonpositive(float x) { return exp16_nonpositive((f32x16){0} + x)[0]; }

INLINE void decode(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                   const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,
                   int chunks, int block_size, int max_blocks, float scale, int bf16) {
    const int group = num_heads / num_kv_heads, dim = 16 * chunks;
    const int64_t row = (int64_t)num_kv_heads * dim; /* one token's K (or V) for all KV heads */
    /* Per query head: its scaled query, running max, denominator and weighted sum of values, and the
     * current block's scores (then weights). Query head i uses KV head i / group. */
    f32x16 query[num_heads][chunks], acc[num_heads][chunks], kv_row[chunks];
    const int weight_chunks = (block_size + 15) / 16; /* a block's scores, padded to whole vectors */
    f32x16 weight[num_heads][weight_chunks];
    float running_max[num_heads], denom[num_heads];

    for (int s = 0; s < num_seqs; s++) {
        const int len = context_lens[s];
        const int32_t *table = block_tables + (int64_t)s * max_blocks;
        for (int i = 0; i < num_heads; i++) {
            for (int c = 0; c < chunks; c++) {
                query[i][c] = load16(q, ((int64_t)s * num_heads + i) * dim + 16 * c, bf16) * scale;
                acc[i][c] = (f32x16){0};
            }
            running_max[i] = -FLT_MAX;
            denom[i] = 0.0f;
        }
        /* Block by block, token by token, KV head by KV head: the block's K (then V) is read in memory
         * order, each row once for the group of query heads that shares it. */
        for (int b = 0; b * block_size < len; b++) {
            const int n = len - b * block_size < block_size ? len - b * block_size : block_size;
            const int64_t block = (int64_t)table[b] * block_size * row;
            for (int t = 0; t < n; t++)
                for (int h = 0; h < num_kv_heads; h++) {
                    for (int c = 0; c < chunks; c++)
                        kv_row[c] = load16(k_cache, block + t * row + h * dim + 16 * c, bf16);
                    for (int i = h * group; i < (h + 1) * group; i++) {
                        f32x16 dot = query[i][0] * kv_row[0];
                        for (int c = 1; c < chunks; c++)
                            dot += query[i][c] * kv_row[c];
                        weight[i][t / 16][t % 16] = sum16(dot);
                    }
                }
            const int used_chunks = (n + 15) / 16;
            for (int i = 0; i < num_heads; i++) { /* online softmax: fold this block into the running sums */
                float *scores = (float *)weight[i];
                for (int t = n; t < 16 * used_chunks; t++)
                    scores[t] = -FLT_MAX; /* padding of a partly filled last block: weighs e^-87, */
                f32x16 max_lanes = weight[i][0];
                for (int c = 1; c < used_chunks; c++)
                    max_lanes = max16(max_lanes, weight[i][c]);
                const float block_max = hmax16(max_lanes);
                const float new_max = block_max > running_max[i] ? block_max : running_max[i];
                for (int c = 0; c < used_chunks; c++)
                    weight[i][c] = exp16_nonpositive(weight[i][c] - new_max);
                f32x16 sum_lanes = weight[i][0];
                for (int c = 1; c < used_chunks; c++)
                    sum_lanes += weight[i][c]; /* which vanishes next to the max's weight of 1 */
                const float alpha = exp_nonpositive(running_max[i] - new_max);
                denom[i] = denom[i] * alpha + sum16(sum_lanes);
                for (int c = 0; c < chunks; c++)
                    acc[i][c] *= alpha;
                running_max[i] = new_max;
            }
            for (int t = 0; t < n; t++)
                for (int h = 0; h < num_kv_heads; h++) {
                    for (int c = 0; c < chunks; c++)
                        kv_row[c] = load16(v_cache, block + t * row + h * dim + 16 * c, bf16);
                    for (int i = h * group; i < (h + 1) * group; i++)
                        for (int c = 0; c < chunks; c++)
                            acc[i][c] += weight[i][t / 16][t % 16] * kv_row[c];
                }
        }
        for (int i = 0; i < num_heads; i++)
            for (int c = 0; c < chunks; c++)
                store16(out, ((int64_t)s * num_heads + i) * dim + 16 * c, acc[i][c] * (1.0f / denom[i]), bf16);
    }
}

/* head_dim 64 and 128 (most models') get copies with the chunk count fixed, which the compiler
 * unrolls; other multiples of 16 take the general loop. */
#define ENTRY_POINT(name, bf16)                                                                            \
    void name(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,      \
              const int32_t *context_lens, void *out, int num_seqs, int num_heads, int num_kv_heads,      \
              int dim, int block_size, int max_blocks, float scale) {                                    \
        const int chunks = dim / 16;                                                                      \
        if (chunks == 4)                                                                                  \
            decode(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads, \
                   4, block_size, max_blocks, scale, bf16);                                               \
        else if (chunks == 8)                                                                             \
            decode(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads, \
                   8, block_size, max_blocks, scale, bf16);                                               \
        else                                                                                              \
            decode(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads, \
                   chunks, block_size, max_blocks, scale, bf16);                                          \
    }

ENTRY_POINT(paged_decode_attention_f32, 0)
ENTRY_POINT(paged_decode_attention_bf16, 1)
