/* y = x W^T + b with bf16 weights on one CPU core: on AMX's tile unit (Intel Sapphire Rapids and
 * later), or with AVX512-BF16's pair dot products (AMD Zen 4 and later, Intel Cooper Lake).
 *
 * Why: oneDNN's bf16 GEMM reaches the hardware's rate on a prefill's thousands of rows, but a decode
 * step multiplies a few dozen rows by each weight, where each oneDNN call spends ~30-100 us around its
 * arithmetic (measured on AMX at 40 rows: ~500 of the ~1,200 GFLOP/s it reaches at 512), and it cannot
 * be called from C, so a bf16 model could not decode in one C call (fused_decode.c) as the fp32 and
 * quantized ones do. This kernel keeps the weight in AMX's own operand layout, packed once at load,
 * so a call only streams it through the multiply units. The same file builds for either extension
 * (the build passes -mamx-bf16 or -mavx512bf16); the packed layout is the same for both.
 *
 * Both multiply bf16 pairs: AMX's `tdpbf16ps C, A, B` adds to C (16 x 16 float32) the product of A
 * (16 rows x 32 bf16 of x) and B (32 bf16 of k x 16 columns, stored as 16 rows of 16 (k, k+1) pairs:
 * the "VNNI" layout); AVX512-BF16's `vdpbf16ps` adds to 16 float32 lanes the dot products of a (k,
 * k+1) pair of x, broadcast, with one row of such a B tile. Every product of two bf16 is exact in
 * float32 and the sums are float32, as in oneDNN's and torch's bf16 GEMMs.
 *
 * Layouts (element offsets; K = in_features padded to a multiple of 32 with zero weights):
 *   packed  [panels, K/32, 2, 16, 32] bf16: panel p holds output columns p*32 .. p*32+31 as two B
 *           tiles per step of 32 inputs (columns +0..15, then +16..31), k-pair by k-pair, so a call
 *           reads each panel as one sequential stream; columns past n are zeros
 *   x       [m, k] rows `ldx` elements apart, bf16 or float32 (float32 is rounded to bf16 first,
 *           to nearest even, as torch's .to(torch.bfloat16) does)
 *   bias    [n] float32 or NULL
 *   y       [m, n] contiguous, float32 or bf16
 *
 * Single-threaded, like the engine; the caller (labkit/model/packed_linear.py) checks shapes and
 * dtypes, this file trusts them.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"

#define STEP 32        /* inputs per tile product: 64 bytes of bf16 */
#define PANEL 32       /* output columns per weight panel: two B tiles of 16 */
#define TILE_VALUES (16 * STEP)

int gemm_bf16_panel_width(void) { return PANEL; }

/* rows x [count, used] (bf16 or float32, stride ldx) into dst [count, K] bf16, zero past `used`. */
static void copy_rows(const void *x, int x_f32, int64_t ldx, int64_t count, int64_t used, int64_t K, uint16_t *dst) {
    for (int64_t r = 0; r < count; r++) {
        uint16_t *row = dst + r * K;
        if (x_f32)
            floats_to_bf16((const float *)x + r * ldx, used, row);
        else
            memcpy(row, (const uint16_t *)x + r * ldx, sizeof(uint16_t) * (size_t)used);
        memset(row + used, 0, sizeof(uint16_t) * (size_t)(K - used));
    }
}


#ifdef __AMX_BF16__
/* AMX. Tiles: 0-3 accumulate a 32 x 32 block of y, 4-5 hold two 16-row slices of x, 6-7 a panel's two B
 * tiles; per step of 32 inputs, four loads feed four tile products. Rows are taken in slices that
 * stay in L2 (SLICE_ROWS), each slice running over every panel. Linux hands out the tile state per
 * process on request (gemm_bf16_init). */
#define SLICE_ROWS 256 /* rows of x per slice: 768 KiB at 1,536 inputs, beside a panel in a 2 MiB L2 */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

const char *gemm_bf16_extension(void) { return "AMX-BF16"; }

/* Ask Linux for the AMX tile state (once per process; oneDNN asks the same). 0 on success. */
int gemm_bf16_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

/* One 16- or 32-row block of y times panel `b` over K inputs into acc [32][PANEL] float32. `next`:
 * the panel to prefetch meanwhile (NULL: none), a step's share of it per step: the tile loads alone
 * left the weight stream at a quarter of the memory's bandwidth. */
INLINE void block(const uint16_t *a0, const uint16_t *a1, int64_t lda, const uint16_t *b, const uint16_t *next,
                  int64_t K, int two, float *acc) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t s = 0; s < K / STEP; s++, b += 2 * TILE_VALUES) {
        if (next)
            for (int line = 0; line < 2 * TILE_VALUES * 2; line += 64)
                _mm_prefetch((const char *)(next + s * 2 * TILE_VALUES) + line, _MM_HINT_T0);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + TILE_VALUES, 64);
        _tile_loadd(4, a0 + s * STEP, lda * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a1 + s * STEP, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc, PANEL * 4);
    _tile_stored(1, acc + 16, PANEL * 4);
    if (two) {
        _tile_stored(2, acc + 16 * PANEL, PANEL * 4);
        _tile_stored(3, acc + 16 * PANEL + 16, PANEL * 4);
    }
}

/* acc rows [rows][PANEL] into y's columns col .. col+width-1, plus bias, as float32 or bf16. */
static void write_out(const float *acc, int64_t rows, int64_t width, const float *bias, void *y, int y_f32,
                      int64_t n, int64_t row, int64_t col) {
    float line[PANEL];
    if (width == PANEL && !bias) {  /* the common case, inline: a call per row cost ~30% of a small-K block */
        for (int64_t r = 0; r < rows; r++) {
            if (y_f32)
                memcpy((float *)y + (row + r) * n + col, acc + r * PANEL, sizeof(float) * PANEL);
            else
                floats_to_bf16(acc + r * PANEL, PANEL, (uint16_t *)y + (row + r) * n + col);
        }
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *src = acc + r * PANEL;
        if (bias) {
            for (int64_t j = 0; j < width; j++) line[j] = src[j] + bias[col + j];
            src = line;
        }
        if (y_f32)
            memcpy((float *)y + (row + r) * n + col, src, sizeof(float) * (size_t)width);
        else
            floats_to_bf16(src, width, (uint16_t *)y + (row + r) * n + col);
    }
}

/* y [m, n] = x [m, used] W^T + bias, W packed as above with K (a multiple of 32) >= used inputs.
 * Returns 0, or -1 when a buffer could not be allocated. */
int gemm_bf16(const void *x, int x_f32, int64_t ldx, const uint16_t *packed, const float *bias, void *y,
              int y_f32, int64_t m, int64_t n, int64_t K, int64_t used) {
    /* x is read in place when its rows are bf16 without padding; otherwise (float32 rows, or inputs
     * padded to K) it is first copied into bf16 rows of K. The last block of fewer than 16 rows is
     * always copied, zero-filled to 16: a tile load reads 16 whole rows. */
    int direct = !x_f32 && used == K;
    int64_t whole = direct ? m / 16 * 16 : 0, copied = ((m - whole) + 15) / 16 * 16;
    uint16_t *scratch = copied ? aligned_alloc(64, sizeof(uint16_t) * (size_t)(copied * K)) : NULL;
    if (copied && !scratch) return -1;
    if (copied) {
        copy_rows(x_f32 ? (const void *)((const float *)x + whole * ldx) : (const void *)((const uint16_t *)x + whole * ldx),
                  x_f32, ldx, m - whole, used, K, scratch);
        memset(scratch + (m - whole) * K, 0, sizeof(uint16_t) * (size_t)((copied - (m - whole)) * K));
    }
    TileConfig config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.bytes_per_row[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
    float acc[32 * PANEL] __attribute__((aligned(64)));
    int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t r0 = 0; r0 < m; r0 += SLICE_ROWS) {
        int64_t r1 = r0 + SLICE_ROWS < m ? r0 + SLICE_ROWS : m;
        for (int64_t p = 0; p < panels; p++) {
            const uint16_t *b = packed + p * K * PANEL, *next = p + 1 < panels ? b + K * PANEL : NULL;
            int64_t col = p * PANEL, width = n - col < PANEL ? n - col : PANEL;
            for (int64_t r = r0; r < r1; r += 32) {
                /* rows r.. of x: in place below `whole`, else from the scratch copy */
                const uint16_t *a0 = r < whole ? (const uint16_t *)x + r * ldx : scratch + (r - whole) * K;
                int64_t lda0 = r < whole ? ldx : K;
                int two = r + 16 < r1;
                const uint16_t *a1 = r + 16 < whole ? (const uint16_t *)x + (r + 16) * ldx : scratch + (r + 16 - whole) * K;
                int64_t lda1 = r + 16 < whole ? ldx : K;
                const uint16_t *fetch = r == r0 ? next : NULL;  /* the panel's first block fetches the next */
                if (two && lda0 == lda1)
                    block(a0, a1, lda0, b, fetch, K, 1, acc);
                else if (two) {  /* the block straddles x and the scratch copy: its halves one at a time */
                    block(a0, a0, lda0, b, fetch, K, 0, acc);
                    block(a1, a1, lda1, b, NULL, K, 0, acc + 16 * PANEL);
                } else
                    block(a0, a0, lda0, b, fetch, K, 0, acc);
                int64_t rows = r1 - r < 32 ? r1 - r : 32;
                write_out(acc, rows, width, bias, y, y_f32, n, r, col);
            }
        }
    }
    _tile_release();
    free(scratch);
    return 0;
}
#else
/* AVX512-BF16. A tile of y, mr rows x np panels (2 vectors of 16 columns each), stays in vector
 * registers over all of K: per (k, k+1) pair it loads np*2 rows of B tiles, broadcasts each row's
 * pair of x, and issues mr*np*2 `vdpbf16ps`. Blocks of MR rows take 2 panels (24 accumulators of 32
 * registers); fewer rows take more panels, so that even one row has 8 independent sums to hide the
 * instruction's latency. The tiles' order and the weight's prefetch: gemm_tiles.h, as gemm_f32.c's. */
#define MR 6
#define PANELS(mr) ((mr) <= 2 ? 4 : (mr) == 3 ? 3 : 2)
#define SLICE_BYTES (256 * 1024) /* a slice of x's rows: a quarter of a 1 MiB L2 */
#define GROUP_BYTES (192 * 1024) /* a panel group's weight, fetched into L2 while the previous computes */
#define X uint16_t
#define W uint16_t
#define NR PANEL
#define VEC __m512
#define VECS 2               /* two B tiles of 16 columns per panel */
#define STEPS(K) ((K) / 2)   /* a tile prefetches once per (k, k+1) pair */
#include "gemm_tiles.h"

const char *gemm_bf16_extension(void) { return "AVX512-BF16"; }

/* Needs no state from Linux: nothing to ask. */
int gemm_bf16_init(void) { return 0; }

/* The micro-kernel: see gemm_tiles.h's tile_fn. acc: the caller's fixed-size array of mr*np*2 vectors. */
INLINE void tile(const int mr, const int np, __m512 *acc, const uint16_t *a, int64_t lda, const uint16_t *b,
                 int64_t panel_stride, int64_t K, const float *bias, void *y, int y_f32, int64_t ldy, int cols,
                 ahead_t *ahead) {
    const char *fetch = ahead->next;
    const int lines = ahead->lines_per_step;
    UNROLL for (int j = 0; j < mr * np * 2; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t s = 0; s < K / STEP; s++) {
        const uint16_t *step = b + s * 2 * TILE_VALUES;
        for (int pair = 0; pair < STEP / 2; pair++) {
            if (fetch < ahead->end) {
                for (int l = 0; l < lines; l++) _mm_prefetch(fetch + 64 * l, _MM_HINT_T1);
                fetch += 64 * lines;
            }
            __m512bh bv[8];
            UNROLL for (int j = 0; j < np * 2; j++)
                bv[j] = (__m512bh)_mm512_loadu_si512(step + (j / 2) * panel_stride + (j % 2) * TILE_VALUES + pair * 32);
            const int64_t kk = s * STEP + 2 * pair;
            UNROLL for (int i = 0; i < mr; i++) {
                int32_t two;
                memcpy(&two, a + i * lda + kk, sizeof two);
                const __m512bh ai = (__m512bh)_mm512_set1_epi32(two);
                UNROLL for (int j = 0; j < np * 2; j++) acc[i * np * 2 + j] = _mm512_dpbf16_ps(acc[i * np * 2 + j], ai, bv[j]);
            }
        }
    }
    ahead->next = fetch;
    UNROLL for (int j = 0; j < np * 2; j++) {
        const int left = cols - j * 16;
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        const __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + j * 16) : _mm512_setzero_ps();
        UNROLL for (int i = 0; i < mr; i++) {
            const __m512 v = _mm512_add_ps(acc[i * np * 2 + j], add);
            if (y_f32)
                _mm512_mask_storeu_ps((float *)y + i * ldy + j * 16, mask, v);
            else
                _mm256_mask_storeu_epi16((uint16_t *)y + i * ldy + j * 16, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

TILE(1, 4) TILE(2, 4) TILE(3, 3) TILE(4, 2) TILE(5, 2) TILE(6, 2)
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1)
/* `wide` takes PANELS(mr) panels at once, `narrow` one (a group's rest) */
static tile_fn *const wide[MR + 1] = {0, tile_1_4, tile_2_4, tile_3_3, tile_4_2, tile_5_2, tile_6_2};
static tile_fn *const narrow[MR + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1};

/* y [m, n] = x [m, used] W^T + bias, W packed as above with K (a multiple of 32) >= used inputs.
 * Returns 0, or -1 when a buffer could not be allocated. */
int gemm_bf16(const void *x, int x_f32, int64_t ldx, const uint16_t *packed, const float *bias, void *y,
              int y_f32, int64_t m, int64_t n, int64_t K, int64_t used) {
    /* x is read in place when its rows are bf16 without padding; otherwise (float32 rows, or inputs
     * padded to K) it is first copied into bf16 rows of K */
    uint16_t *scratch = NULL;
    if (x_f32 || used != K) {
        scratch = aligned_alloc(64, sizeof(uint16_t) * (size_t)(m * K) + 64);
        if (!scratch) return -1;
        copy_rows(x, x_f32, ldx, m, used, K, scratch);
        x = scratch, ldx = K;
    }
    gemm_tiles(wide, narrow, x, ldx, packed, K * PANEL, bias, y, y_f32, m, n, K);
    free(scratch);
    return 0;
}
#endif
