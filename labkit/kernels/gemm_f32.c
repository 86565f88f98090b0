/* y = x W^T + b in float32 on one CPU core, with W packed once into column panels.
 *
 * Layouts (element offsets):
 *   x       [m, k], row stride ldx (columns contiguous)
 *   packed  [panels, k, NR]: panel p holds output columns p*NR .. p*NR+NR-1, one k after another, so
 *           the micro-kernel reads it as one sequential stream; the columns past n are zeros
 *   bias    [panels * NR] (zero-padded like the panels) or NULL
 *   y       [m, n], contiguous
 *
 * The weight is the big operand (the engine's decode steps multiply a few dozen rows by it), so it is
 * laid out once, at load, in the order the micro-kernel reads it: torch's GEMM re-lays it out on
 * every call. x is read in place, row by row (packing it too measured no faster, and slower when the
 * output is narrow).
 *
 * The micro-kernel keeps an mr x (np panels of NR columns) tile of y in vector registers over the
 * whole k (no partial sums written back): per k it loads np*NV vectors of the panel and broadcasts mr
 * values of x, mr*np*NV fused multiply-adds. Row blocks of MR rows use one panel (AVX-512: 8 x 48,
 * 24 accumulators); the few rows of a decode step's last block use more panels at once, so that a
 * single row still has 12 independent chains to hide the FMA latency. Which tiles run in which order,
 * and the weight's prefetch: gemm_tiles.h, shared with gemm_bf16.c.
 *
 * Single-threaded: the engine runs one thread per process. The caller (labkit/model/packed_linear.py)
 * checks shapes and dtypes; this file trusts its arguments. No fast-math: each output's sum runs over
 * k in order, as a dot product does.
 */
/* LANES floats per vector (simd.h). Register budgets: 32 vector registers on AVX-512, 16 elsewhere. */
#include "simd.h"

#define NV 3              /* vectors per panel */
#define NR (NV * LANES)   /* columns per panel */
#if LANES >= 16
#define MR 8              /* rows per block: 8 x 3 = 24 accumulators */
#define PANELS(mr) ((mr) == 1 ? 4 : (mr) <= 3 ? 2 : 1)
#else
#define MR 4              /* 4 x 3 = 12 accumulators of 16 registers */
#define PANELS(mr) ((mr) == 1 ? 2 : 1)
#endif
#define MAX_PANELS 4      /* the most panels a tile takes at once */
#ifndef GROUP_BYTES
#define GROUP_BYTES (256 * 1024) /* a panel group's weight: it and the next one's fit in L2 beside x */
#endif
#define SLICE_BYTES (512 * 1024) /* a slice of x's rows: a quarter of a 2 MiB L2 */
#define X float
#define W float
#define VEC fvec
#define VECS NV
#define STEPS(k) (k)      /* a tile prefetches once per input */
#include "gemm_tiles.h"

INLINE fvec loadv(const float *p) {
    fvec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The micro-kernel: see gemm_tiles.h's tile_fn. acc: the caller's fixed-size array of mr*np*NV vectors. */
INLINE void tile(const int mr, const int np, fvec *acc, const float *a, int64_t lda, const float *b,
                 int64_t panel_stride, int64_t k, const float *bias, void *out, int y_f32, int64_t ldy, int cols,
                 ahead_t *ahead) {
    (void)y_f32; /* float32 always */
    float *y = out;
    const char *fetch = ahead->next;
    const int lines = ahead->lines_per_step;
    UNROLL for (int j = 0; j < np * NV; j++) {
        const fvec init = bias ? loadv(bias + j * LANES) : (fvec){0};
        UNROLL for (int i = 0; i < mr; i++)
            acc[i * np * NV + j] = init;
    }
    for (int64_t kk = 0; kk < k; kk++) {
        if (fetch < ahead->end) {
            for (int l = 0; l < lines; l++)
                __builtin_prefetch(fetch + 64 * l, 0, 2);
            fetch += 64 * lines;
        }
        fvec bv[MAX_PANELS * NV];
        UNROLL for (int j = 0; j < np * NV; j++)
            bv[j] = loadv(b + (j / NV) * panel_stride + kk * NR + (j % NV) * LANES);
        UNROLL for (int i = 0; i < mr; i++) {
            const fvec ai = a[i * lda + kk] - (fvec){0}; /* a broadcast (x - 0 is x, even -0) */
            UNROLL for (int j = 0; j < np * NV; j++)
                acc[i * np * NV + j] += ai * bv[j];
        }
    }
    ahead->next = fetch;
    UNROLL for (int i = 0; i < mr; i++)
        UNROLL for (int j = 0; j < np * NV; j++) {
            const int left = cols - j * LANES;
            const fvec v = acc[i * np * NV + j]; /* a copy: taking acc's address would keep it in memory */
            if (left >= LANES)
                memcpy(y + i * ldy + j * LANES, &v, sizeof v);
            else if (left > 0)
                memcpy(y + i * ldy + j * LANES, &v, left * sizeof(float));
        }
}

/* The tiles of each row count: `wide` takes PANELS(mr) panels at once, `narrow` one (the group's rest). */
#if MR == 8
TILE(1, 4) TILE(2, 2) TILE(3, 2)
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1) TILE(7, 1) TILE(8, 1)
static tile_fn *const wide[MR + 1] = {0, tile_1_4, tile_2_2, tile_3_2, tile_4_1, tile_5_1, tile_6_1, tile_7_1,
                                      tile_8_1};
static tile_fn *const narrow[MR + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1, tile_7_1,
                                        tile_8_1};
#else
TILE(1, 2) TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1)
static tile_fn *const wide[MR + 1] = {0, tile_1_2, tile_2_1, tile_3_1, tile_4_1};
static tile_fn *const narrow[MR + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1};
#endif

int gemm_f32_panel_width(void) { return NR; }

void gemm_f32(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int m, int n, int k) {
    gemm_tiles(wide, narrow, x, ldx, packed, (int64_t)k * NR, bias, y, 1, m, n, k);
}
