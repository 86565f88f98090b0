/* Weight-only quantized linear layers on a CPU with integer dot products: y = x W^T for W stored
 * as Q4_1 blocks or as int8 rows, x quantized on the fly to int8 per group of 32 (llama.cpp's way).
 *
 * Why integers: batch-1 decode reads every weight once per token, so its speed is bytes / bandwidth,
 * and a 4-bit weight is an eighth of fp32's bytes. Widening the codes to floats before multiplying
 * costs more instructions than the memory saves; multiplying 4-bit codes by int8 activations with
 * one instruction per 64 pairs (AVX-512 VNNI's vpdpbusd: u8 x s8 summed four at a time into int32)
 * keeps the kernel at memory speed.
 *
 * Layouts (prepared once by labkit/kernels/int8_dot.py; K is in_features padded to a multiple of 64,
 * G = K / 32 groups, padding weights and activations are zero):
 *   Q4_1:  codes [N, K/2] uint8: for each 64 inputs, byte j = code[j] | code[j + 32] << 4;
 *          d, m [N, G] float32: w = d * code + m per group of 32.
 *   int8:  codes [N, K] int8; wsum [N, G] int32: the sum of each group's codes; scale [N] float32.
 *   x      [M, in] float32 or bfloat16 rows, `x_stride` elements apart; y [M, N] the same dtype.
 * Activations: llama.cpp's Q8_1 blocks. Per row and group of 32, a = round(x / s) in -127..127 with
 * s = max|x| / 127, and S = s * sum(a) (the Q4_1 offset m multiplies every x of its group alike);
 * s and S are rounded to float16 as llama.cpp stores them, so both engines round alike. x / s is
 * computed as llama.cpp's build for the same CPU computes it: x * (127 / max|x|) where it compiles
 * with AVX, x * (1 / s) elsewhere. The two differ in the last bit for some x, and where that moves a
 * code across a rounding boundary the layer's output moves by a whole step (measured on SmolLM2, fed
 * llama.cpp's own activations: projections off by up to 5e-3, against 1e-5 with the same formula).
 *
 * Q4_1:  y = sum_g d_g s_g (codes . a)_g + m_g S_g
 * int8:  y = scale * sum_g s_g (codes . a)_g; vpdpbusd takes u8 x s8, so a is shifted to a + 128
 *        (u8) and 128 * wsum is taken back: (codes . (a + 128)) - 128 wsum = codes . a.
 *
 * Single-threaded, like the engine. The Python side checks every shape and dtype; this file trusts
 * its arguments.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define GROUP 32

/* f rounded to the nearest float16 (ties to even), returned as a float: llama.cpp keeps its
 * activation scales in float16, and matching it keeps greedy decoding on llama.cpp's tokens. */
static inline float fp16_round(float f) {
    float magnitude = fabsf(f);
    if (magnitude < 0x1p-14f)  /* float16's subnormals: multiples of 2^-24 */
        return copysignf(nearbyintf(magnitude * 0x1p24f) * 0x1p-24f, f);
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits = (bits + 0x0fffu + ((bits >> 13) & 1)) & ~0x1fffu;  /* keep 10 of float32's 23 mantissa bits */
    memcpy(&f, &bits, 4);
    return f;
}

/* One row of x (length n, float32 or bf16) into llama.cpp's Q8_1 blocks: per group of 32, codes
 * round(x / s) with s = max|x| / 127, and s and s * sum(codes), both rounded to float16. */
static void quantize_row(const void *x, int x_bf16, int64_t n, int64_t K, int8_t *q, float *s, float *sum) {
    float buf[GROUP];
    for (int64_t g = 0; g < K / GROUP; g++) {
        float amax = 0.0f;
        for (int j = 0; j < GROUP; j++) {
            int64_t i = g * GROUP + j;
            float v = i >= n ? 0.0f : x_bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
            buf[j] = v;
            amax = fmaxf(amax, fabsf(v));
        }
        float scale = amax / 127.0f;
#if defined(__AVX__)
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
#else
        float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
#endif
        int32_t codes = 0;
        for (int j = 0; j < GROUP; j++) {
            q[g * GROUP + j] = (int8_t)lrintf(buf[j] * inv);
            codes += q[g * GROUP + j];
        }
        s[g] = fp16_round(scale);
        sum[g] = fp16_round((float)codes * scale);
    }
}

/* Each kernel computes ROWS output rows at once for one activation row: the activations are loaded
 * once for all of them, and the rows' independent sums keep the core busy while each waits on its
 * last multiply-add. `out[i]` = row i's dot product, without the Q4_1 offsets or int8 corrections,
 * which `group_dot` adds. */
#define ROWS 4

#if defined(__AVX512VNNI__)
#define KERNEL_NAME "AVX-512 VNNI"

/* Scales of two consecutive groups spread over the int32 lanes vpdpbusd fills: 0-7 and 8-15. */
static inline __m512 pair_scale(const float *scale) {
    return _mm512_insertf32x8(_mm512_set1_ps(scale[0]), _mm256_set1_ps(scale[1]), 1);
}

static void q4_1_dots(const uint8_t *codes, int64_t row_bytes, const float *d, int64_t G, const int8_t *a,
                      const float *s, int64_t K, float out[ROWS]) {
    __m512 acc[ROWS];
    for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int64_t k = 0, g = 0; k < K; k += 64, g += 2) {
        __m512i x = _mm512_loadu_si512(a + k);
        __m512 x_scale = pair_scale(s + g);
        for (int i = 0; i < ROWS; i++) {
            __m256i packed = _mm256_loadu_si256((const __m256i *)(codes + i * row_bytes + k / 2));
            __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, low)),
                                           _mm256_and_si256(_mm256_srli_epi16(packed, 4), low), 1);
            __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x));
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dot, x_scale), pair_scale(d + i * G + g), acc[i]);
        }
    }
    for (int i = 0; i < ROWS; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}

static void int8_dots(const int8_t *codes, int64_t row_bytes, const int8_t *a, const float *s, int64_t K,
                      float out[ROWS]) {
    __m512 acc[ROWS];
    for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi8((char)0x80);  /* a + 128 as u8: flip the sign bit */
    for (int64_t k = 0, g = 0; k < K; k += 64, g += 2) {
        __m512i shifted = _mm512_xor_si512(_mm512_loadu_si512(a + k), flip);
        __m512 x_scale = pair_scale(s + g);
        for (int i = 0; i < ROWS; i++) {
            __m512i w = _mm512_loadu_si512(codes + i * row_bytes + k);
            __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), shifted, w));
            acc[i] = _mm512_fmadd_ps(dot, x_scale, acc[i]);
        }
    }
    for (int i = 0; i < ROWS; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}
#define INT8_DOT_IS_SHIFTED 1

/* sum_g u[g] * v[g] (v as float, or int32 converted when v_int) over G groups, 16 at a time. */
static inline float group_dot(const float *u, const void *v, int v_int, int64_t G) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g += 16) {
        __mmask16 mask = G - g >= 16 ? 0xffff : (__mmask16)((1u << (G - g)) - 1);
        __m512 vv = v_int ? _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, (const int32_t *)v + g))
                          : _mm512_maskz_loadu_ps(mask, (const float *)v + g);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, u + g), vv, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

#elif defined(__AVX2__)
#define KERNEL_NAME "AVX2"
static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* 32 products of u8 x s8 summed into 8 int32 (vpmaddubsw's int16 pairs cannot overflow here: the
 * callers keep the u8 side <= 127). */
static inline __m256 dot32(__m256i u, __m256i v) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1)));
}

static void q4_1_dots(const uint8_t *codes, int64_t row_bytes, const float *d, int64_t G, const int8_t *a,
                      const float *s, int64_t K, float out[ROWS]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int i = 0; i < ROWS; i++) {
        const uint8_t *row = codes + i * row_bytes;
        const float *d_i = d + i * G;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0, g = 0; k < K; k += 64, g += 2) {
            __m256i packed = _mm256_loadu_si256((const __m256i *)(row + k / 2));
            __m256i w0 = _mm256_and_si256(packed, low), w1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
            acc = _mm256_fmadd_ps(dot32(w0, _mm256_loadu_si256((const __m256i *)(a + k))),
                                  _mm256_set1_ps(d_i[g] * s[g]), acc);
            acc = _mm256_fmadd_ps(dot32(w1, _mm256_loadu_si256((const __m256i *)(a + k + 32))),
                                  _mm256_set1_ps(d_i[g + 1] * s[g + 1]), acc);
        }
        out[i] = hsum(acc);
    }
}

static void int8_dots(const int8_t *codes, int64_t row_bytes, const int8_t *a, const float *s, int64_t K,
                      float out[ROWS]) {
    /* |w| (u8 <= 127) times a with w's sign moved onto it: no int16 overflow, no offset to undo. */
    for (int i = 0; i < ROWS; i++) {
        const int8_t *row = codes + i * row_bytes;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0, g = 0; k < K; k += 32, g++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(row + k));
            __m256i x = _mm256_loadu_si256((const __m256i *)(a + k));
            acc = _mm256_fmadd_ps(dot32(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), _mm256_set1_ps(s[g]), acc);
        }
        out[i] = hsum(acc);
    }
}
#define INT8_DOT_IS_SHIFTED 0

#else
#define KERNEL_NAME "generic"
static void q4_1_dots(const uint8_t *codes, int64_t row_bytes, const float *d, int64_t G, const int8_t *a,
                      const float *s, int64_t K, float out[ROWS]) {
    for (int i = 0; i < ROWS; i++) {
        const uint8_t *row = codes + i * row_bytes;
        float total = 0.0f;
        for (int64_t k = 0, g = 0; k < K; k += 64, g += 2) {
            int32_t dot0 = 0, dot1 = 0;
            for (int j = 0; j < 32; j++) {
                dot0 += (row[k / 2 + j] & 0x0f) * a[k + j];
                dot1 += (row[k / 2 + j] >> 4) * a[k + 32 + j];
            }
            total += d[i * G + g] * s[g] * (float)dot0 + d[i * G + g + 1] * s[g + 1] * (float)dot1;
        }
        out[i] = total;
    }
}

static void int8_dots(const int8_t *codes, int64_t row_bytes, const int8_t *a, const float *s, int64_t K,
                      float out[ROWS]) {
    for (int i = 0; i < ROWS; i++) {
        float total = 0.0f;
        for (int64_t k = 0, g = 0; k < K; k += 32, g++) {
            int32_t dot = 0;
            for (int j = 0; j < 32; j++) dot += codes[i * row_bytes + k + j] * a[k + j];
            total += s[g] * (float)dot;
        }
        out[i] = total;
    }
}
#define INT8_DOT_IS_SHIFTED 0
#endif

#ifndef __AVX512VNNI__
static inline float group_dot(const float *u, const void *v, int v_int, int64_t G) {
    float total = 0.0f;
    for (int64_t g = 0; g < G; g++) total += u[g] * (v_int ? (float)((const int32_t *)v)[g] : ((const float *)v)[g]);
    return total;
}
#endif

const char *int8_dot_kernel_name(void) { return KERNEL_NAME; }

/* The activations of M rows, quantized once and shared by every output row. */
typedef struct { int8_t *q; float *s, *sum; } Activations;

static int quantize(const void *x, int x_bf16, int64_t M, int64_t n, int64_t x_stride, int64_t K, Activations *out) {
    int64_t G = K / GROUP;
    out->q = malloc((size_t)(M * K));
    out->s = malloc(sizeof(float) * (size_t)(M * G));
    out->sum = malloc(sizeof(float) * (size_t)(M * G));
    if (!out->q || !out->s || !out->sum) {
        free(out->q), free(out->s), free(out->sum);
        return -1;
    }
    size_t elem = x_bf16 ? 2 : 4;
    for (int64_t r = 0; r < M; r++)
        quantize_row((const char *)x + (size_t)(r * x_stride) * elem, x_bf16, n, K, out->q + r * K,
                     out->s + r * G, out->sum + r * G);
    return 0;
}

static inline void store(void *y, int y_bf16, int64_t i, float v) {
    if (y_bf16) ((uint16_t *)y)[i] = float_to_bf16(v);
    else ((float *)y)[i] = v;
}

enum { Q4_1 = 0, INT8 = 1 };  /* the weight formats, as fused_decode.c names them too */

/* How far ahead of the row block being multiplied its codes are asked for. The codes are read once,
 * in order, yet the hardware prefetcher alone left batch-1 decode at a third of the memory's
 * bandwidth (AMD Zen 4: each block's dot products wait on its loads); asking 4 KiB ahead took the
 * Q4_1 model from ~80 to ~120-130 tokens/s and the int8 lm_head from ~3.9 to ~1 ms. */
#define AHEAD_BYTES 4096

/* y = x W^T for W in either format: `codes` and `per_group` (Q4_1: d; int8: the code sums) are
 * [N, ...] padded to a multiple of ROWS with zero rows (the packing does it), so every block of ROWS
 * is whole; `per_row` is Q4_1's m [N, G] or int8's scale [N]. Only the first N outputs are written.
 * Returns 0, or -1 when the activation buffer could not be allocated. */
static int linear(int kind, const void *codes, const void *per_group, const float *per_row, int64_t N, int64_t K,
                  int64_t n, const void *x, int x_bf16, int64_t M, int64_t x_stride, void *y) {
    Activations act;
    if (quantize(x, x_bf16, M, n, x_stride, K, &act)) return -1;
    int64_t G = K / GROUP;
    float dots[ROWS];
    const int64_t row_bytes = kind == Q4_1 ? K / 2 : K;
    for (int64_t o = 0; o < N; o += ROWS) {
        if ((o + ROWS) * row_bytes + AHEAD_BYTES <= N * row_bytes)  /* this block's bytes, AHEAD_BYTES on */
            for (int64_t line = 0; line < ROWS * row_bytes; line += 64)
                __builtin_prefetch((const char *)codes + o * row_bytes + AHEAD_BYTES + line);
        for (int64_t r = 0; r < M; r++) {
            const int8_t *a = act.q + r * K;
            const float *s = act.s + r * G;
            if (kind == Q4_1)
                q4_1_dots((const uint8_t *)codes + o * (K / 2), K / 2, (const float *)per_group + o * G, G, a, s, K,
                          dots);
            else
                int8_dots((const int8_t *)codes + o * K, K, a, s, K, dots);
            for (int64_t i = 0; i < ROWS && o + i < N; i++) {
                float v;
                if (kind == Q4_1) {
                    v = dots[i] + group_dot(per_row + (o + i) * G, act.sum + r * G, 0, G);
                } else {
                    const int32_t *wsum = (const int32_t *)per_group + (o + i) * G;
                    v = per_row[o + i] * (dots[i] - (INT8_DOT_IS_SHIFTED ? 128.0f * group_dot(s, wsum, 1, G) : 0.0f));
                }
                store(y, x_bf16, r * N + o + i, v);
            }
        }
    }
    free(act.q), free(act.s), free(act.sum);
    return 0;
}

int q4_1_linear(const uint8_t *codes, const float *d, const float *m, int64_t N, int64_t K, int64_t n,
                const void *x, int x_bf16, int64_t M, int64_t x_stride, void *y) {
    return linear(Q4_1, codes, d, m, N, K, n, x, x_bf16, M, x_stride, y);
}

int int8_linear(const int8_t *codes, const int32_t *wsum, const float *scale, int64_t N, int64_t K, int64_t n,
                const void *x, int x_bf16, int64_t M, int64_t x_stride, void *y) {
    return linear(INT8, codes, wsum, scale, N, K, n, x, x_bf16, M, x_stride, y);
}

/* The float weight [N, n] (float32 or bfloat16) of packed weights, for batches large enough that a
 * float GEMM beats multiplying row by row: prefill chunks. One row at a time through a float32
 * buffer, in loops the compiler vectorizes. Returns 0, or -1 when the buffer could not be allocated. */
static void store_row(const float *row, int64_t n, void *w, int w_bf16, int64_t o) {
    if (w_bf16)
        floats_to_bf16(row, n, (uint16_t *)w + o * n);
    else
        memcpy((float *)w + o * n, row, sizeof(float) * (size_t)n);
}

int q4_1_dequantize(const uint8_t *codes, const float *d, const float *m, int64_t N, int64_t K, int64_t n,
                    void *w, int w_bf16) {
    int64_t G = K / GROUP;
    float *row = malloc(sizeof(float) * (size_t)K);
    if (!row) return -1;
    for (int64_t o = 0; o < N; o++) {
        const uint8_t *bytes = codes + o * (K / 2);
        const float *d_o = d + o * G, *m_o = m + o * G;
        for (int64_t run = 0; run < K / 64; run++) {
            float d0 = d_o[2 * run], m0 = m_o[2 * run], d1 = d_o[2 * run + 1], m1 = m_o[2 * run + 1];
            for (int j = 0; j < 32; j++) {
                row[run * 64 + j] = d0 * (float)(bytes[run * 32 + j] & 0x0f) + m0;
                row[run * 64 + 32 + j] = d1 * (float)(bytes[run * 32 + j] >> 4) + m1;
            }
        }
        store_row(row, n, w, w_bf16, o);
    }
    free(row);
    return 0;
}

int int8_dequantize(const int8_t *codes, const int32_t *wsum, const float *scale, int64_t N, int64_t K, int64_t n,
                    void *w, int w_bf16) {
    (void)wsum;
    float *row = malloc(sizeof(float) * (size_t)K);
    if (!row) return -1;
    for (int64_t o = 0; o < N; o++) {
        for (int64_t i = 0; i < n; i++) row[i] = scale[o] * (float)codes[o * K + i];
        store_row(row, n, w, w_bf16, o);
    }
    free(row);
    return 0;
}
