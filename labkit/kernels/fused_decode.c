/* A step of a whole Llama-family decoder in one C call, for the quantized and packed dense formats.
 *
 * Why: at batch 1 a decode step multiplies ~100 MB of 4-bit weights, a few milliseconds at memory
 * speed, but the eager model issues ~45 small torch operations per layer (norms, rotary, views,
 * casts), each a few microseconds of Python and dispatch: 30 layers of that cost more than the
 * weights. This file runs the same layer (labkit/model/layers.py) for a batch of new tokens, each
 * attending as a decode row over its own context in the pool (a decode's whole context, a prompt
 * row's causal prefix): RMSNorm, the q/k/v projections, rotary (half-split pairs), the K/V rows
 * stored into the paged pool, paged decode attention (paged_decode.c), the output projection and
 * residual, RMSNorm, the SwiGLU MLP and residual. The residual stream stays float32 throughout (as
 * llama.cpp's does); the linears are int8_dot.c's for the quantized formats, or the packed GEMM of a
 * dense float32 (gemm_f32.c) or bf16 (gemm_bf16.c, AMX or AVX512-BF16) model, reached through a
 * function pointer (those libraries are built on their own, the bf16 one with its own compiler
 * flags). The Python side (labkit/model/fused_decode.py) checks the model and every shape, lays the
 * weights out and owns the workspace; this file trusts its arguments. */
#include "int8_dot.c"
#include "paged_decode.c"

/* Linear kinds beside int8_dot.c's Q4_1 and INT8: gemm_f32.c's panels, or gemm_bf16.c's tile-layout panels, in `a` */
#define F32_PACKED 2
#define BF16_PACKED 3

/* gemm_f32.c's entry point: y [m, n] = x [m, k] (row stride ldx) times the packed weight, plus bias. */
typedef void gemm_f32_fn(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int m,
                         int n, int k);
/* gemm_bf16.c's: y [m, n] = x [m, used] times the weight packed over K inputs; here float32 in and out. */
typedef int gemm_bf16_fn(const void *x, int x_f32, int64_t ldx, const uint16_t *packed, const float *bias, void *y,
                         int y_f32, int64_t m, int64_t n, int64_t K, int64_t used);

/* One packed linear layer: `kind` (Q4_1, INT8, F32_PACKED or BF16_PACKED), its weight arrays (int8_dot.c's
 * layouts, or gemm_f32.c's or gemm_bf16.c's panels in `a`), N outputs, K inputs as stored, n inputs used. */
typedef struct {
    int64_t kind;
    const void *a, *b, *c;
    int64_t N, K, n;
} Linear;

typedef struct {
    Linear q, k, v, o, gate, up, down;
    const float *input_norm, *post_norm;  /* RMSNorm weights, float32 */
    void *k_cache, *v_cache;              /* [num_blocks, block_size, num_kv_heads, head_dim] */
} Layer;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, max_blocks;
    float eps;
    int32_t kv_bf16;
    gemm_f32_fn *gemm_f32;   /* for F32_PACKED linears; NULL when there are none */
    gemm_bf16_fn *gemm_bf16; /* for BF16_PACKED linears; NULL when there are none */
} Shape;

/* y [M, L->N] = the rows x [M, L->n] times a linear. A bf16 linear (BF16_PACKED) reads `xb`, the same
 * rows already rounded to bf16, as the eager bf16 model's activations are; the others read x. */
static int project(const Shape *s, const Linear *L, const float *x, const uint16_t *xb, int64_t M, float *y) {
    if (L->kind == F32_PACKED) {
        s->gemm_f32(x, L->n, (const float *)L->a, NULL, y, (int)M, (int)L->N, (int)L->n);
        return 0;
    }
    if (L->kind == BF16_PACKED)
        return s->gemm_bf16(xb, 0, L->n, (const uint16_t *)L->a, NULL, y, 1, M, L->N, L->K, L->n);
    return linear((int)L->kind, L->a, L->b, L->c, L->N, L->K, L->n, x, 0, M, L->n, y);
}

/* out = x / sqrt(mean(x^2) + eps) * w, row by row. The squares are summed in LANES running sums (a
 * single one is a chain of dependent adds, slower than the rest of the norm put together). */
static void rms_norm(const float *x, const float *w, int64_t M, int64_t H, float eps, float *out) {
    for (int64_t r = 0; r < M; r++) {
        const float *row = x + r * H;
        fvec sums = {0};
        int64_t i = 0;
        for (; i + LANES <= H; i += LANES) {
            const fvec v = loadv(row, i, 0);
            sums += v * v;
        }
        float squares = sumv(sums);
        for (; i < H; i++) squares += row[i] * row[i];
        float inv = 1.0f / sqrtf(squares / (float)H + eps);
        for (i = 0; i < H; i++) out[r * H + i] = row[i] * inv * w[i];
    }
}

/* Rotate the pairs (x[i], x[i + D/2]) of each of `heads` heads of one row by the row's angles. */
static void rotate(float *x, int64_t heads, int64_t D, const float *cos, const float *sin) {
    int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x1 = x + h * D, *x2 = x1 + half;
        for (int64_t i = 0; i < half; i++) {
            float a = x1[i], b = x2[i];
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    }
}

/* gate = silu(gate) * up, LANES at a time. sigmoid(g) is 1 / (1 + e^-g) for g >= 0 and e^g / (1 + e^g)
 * below: either way the exponent is -|g| <= 0, expv_nonpositive's range (libm's expf, one lane at a
 * time, cost a batch-40 step ~9 ms). */
static void swiglu(float *gate, const float *up, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const fvec g = loadv(gate, i, 0), one = (fvec){0} + 1.0f;
        const ivec negative = g < 0;
        const fvec e = expv_nonpositive((fvec)((ivec)g | ((ivec){0} + INT32_MIN)));  /* -|g|: the sign bit set */
        const fvec numerator = (fvec)((negative & (ivec)e) | (~negative & (ivec)one));
        storev(gate, i, g * numerator / (one + e) * loadv(up, i, 0), 0);
    }
    for (; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static void copy_in(const void *src, int64_t n, float *dst, int bf16) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf16 ? bf16_to_float(((const uint16_t *)src)[i]) : ((const float *)src)[i];
}

/* The bytes of the activations a step of M rows needs (fused_decode_step's `work`): float32 h, q,
 * k, v, att, gate, up, o, then bf16 rows of q and the attention's output (a bf16 pool's kernel reads
 * and writes bf16) and the rounded inputs of bf16 linears (a step rounds each input once, not once
 * per linear that reads it). */
int64_t fused_decode_workspace(const Shape *s, int64_t M) {
    int64_t H = s->hidden, QD = s->num_heads * s->head_dim, KD = s->num_kv_heads * s->head_dim, I = s->intermediate;
    int64_t widest = H > I ? H : I;
    return (int64_t)sizeof(float) * M * (2 * H + 2 * QD + 2 * KD + 2 * I) +
           (int64_t)sizeof(uint16_t) * M * ((s->kv_bf16 ? 2 * QD : 0) + (s->gemm_bf16 ? widest : 0));
}

/* x [M, hidden] float32: the residual stream of M new tokens, updated in place through every layer.
 * Each row attends as a decode row: cos, sin [M, head_dim/2]; slots [M]: where each new K/V row goes;
 * block_tables [M, max_blocks] and context_lens [M] (including the new token) as paged_decode.c takes
 * them (a prompt's rows share its table, each with its own causal length). `work`:
 * fused_decode_workspace(s, M) bytes, 64-byte aligned. Returns 0, or -1 when a GEMM could not
 * allocate its copy of the rows. */
int fused_decode_step(const Layer *layers, int64_t num_layers, const Shape *s, int64_t M, float *x,
                      const float *cos, const float *sin, const int64_t *slots, const int32_t *block_tables,
                      const int32_t *context_lens, void *work) {
    int64_t H = s->hidden, D = s->head_dim, QD = s->num_heads * D, KD = s->num_kv_heads * D, I = s->intermediate;
    float *h = work, *q = h + M * H, *k = q + M * QD, *v = k + M * KD, *att = v + M * KD, *gate = att + M * QD;
    float *up = gate + M * I, *o = up + M * I;  /* o: M * H, the attention's or the MLP's output, added to x */
    uint16_t *half = (uint16_t *)(o + M * H);  /* bf16 pool: q, then the attention's output */
    uint16_t *rounded = half + (s->kv_bf16 ? 2 * M * QD : 0);  /* bf16 linears: their input, rounded once */
    int bf16 = s->gemm_bf16 != NULL;
    int status = 0;
    for (int64_t l = 0; l < num_layers && !status; l++) {
        const Layer *L = layers + l;
        rms_norm(x, L->input_norm, M, H, s->eps, h);
        if (bf16) floats_to_bf16(h, M * H, rounded);
        status |= project(s, &L->q, h, rounded, M, q) | project(s, &L->k, h, rounded, M, k) |
                  project(s, &L->v, h, rounded, M, v);
        for (int64_t r = 0; r < M; r++) {
            rotate(q + r * QD, s->num_heads, D, cos + r * D / 2, sin + r * D / 2);
            rotate(k + r * KD, s->num_kv_heads, D, cos + r * D / 2, sin + r * D / 2);
            int64_t offset = slots[r] * KD;
            if (s->kv_bf16) {
                floats_to_bf16(k + r * KD, KD, (uint16_t *)L->k_cache + offset);
                floats_to_bf16(v + r * KD, KD, (uint16_t *)L->v_cache + offset);
            } else {
                memcpy((float *)L->k_cache + offset, k + r * KD, sizeof(float) * (size_t)KD);
                memcpy((float *)L->v_cache + offset, v + r * KD, sizeof(float) * (size_t)KD);
            }
        }
        float scale = 1.0f / sqrtf((float)D);
        if (s->kv_bf16) {
            floats_to_bf16(q, M * QD, half);
            paged_decode_attention_bf16(half, L->k_cache, L->v_cache, block_tables, context_lens, half + M * QD,
                                        (int)M, (int)s->num_heads, (int)s->num_kv_heads, (int)D,
                                        (int)s->block_size, (int)s->max_blocks, scale);
            if (!bf16) copy_in(half + M * QD, M * QD, att, 1);  /* a bf16 o_proj reads the bf16 rows as they are */
        } else {
            paged_decode_attention_f32(q, L->k_cache, L->v_cache, block_tables, context_lens, att, (int)M,
                                       (int)s->num_heads, (int)s->num_kv_heads, (int)D, (int)s->block_size,
                                       (int)s->max_blocks, scale);
        }
        status |= project(s, &L->o, att, half + M * QD, M, o);
        for (int64_t i = 0; i < M * H; i++) x[i] += o[i];
        rms_norm(x, L->post_norm, M, H, s->eps, h);
        if (bf16) floats_to_bf16(h, M * H, rounded);
        status |= project(s, &L->gate, h, rounded, M, gate) | project(s, &L->up, h, rounded, M, up);
        swiglu(gate, up, M * I);
        if (bf16) floats_to_bf16(gate, M * I, rounded);
        status |= project(s, &L->down, gate, rounded, M, o);
        for (int64_t i = 0; i < M * H; i++) x[i] += o[i];
    }
    return status ? -1 : 0;
}
