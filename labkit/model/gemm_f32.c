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
 * single row still has 12 independent chains to hide the FMA latency.
 *
 * Loop order: x is taken in slices of rows that stay in L2 (SLICE_FLOATS); in a slice, panel group by
 * panel group (GROUP_BYTES of weight), every row block runs over the group while it is in L2, and the
 * next group is prefetched meanwhile, so each weight panel comes from memory once per slice (once per
 * call for up to a few hundred rows) without stalling the first row block.
 *
 * Single-threaded: the engine runs one thread per process. The caller (labkit/model/packed_f32.py)
 * checks shapes and dtypes; this file trusts its arguments. No fast-math: each output's sum runs over
 * k in order, as a dot product does.
 */
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 32") /* every loop over a tile's registers: acc must stay in registers */

/* LANES floats as GCC/clang vector extensions, set by the build for this CPU (16 for AVX-512, 8 for
 * AVX2, 4 for NEON and SSE2). Register budgets: 32 vector registers on AVX-512, 16 elsewhere. */
#ifndef LANES
#define LANES 16
#endif
typedef float fvec __attribute__((vector_size(4 * LANES)));

#define NV 3              /* vectors per panel */
#define NR (NV * LANES)   /* columns per panel */
#if LANES >= 16
#define MR 8              /* rows per block: 8 x 3 = 24 accumulators */
#define PANELS(mr) ((mr) == 1 ? 4 : (mr) <= 3 ? 2 : 1)
#else
#define MR 4              /* 4 x 3 = 12 accumulators of 16 registers */
#define PANELS(mr) ((mr) == 1 ? 2 : 1)
#endif
#define GROUP 4           /* the most panels a tile takes at once */
#ifndef GROUP_BYTES
#define GROUP_BYTES (256 * 1024) /* a panel group's weight: it and the next one's fit in L2 beside x */
#endif
#define SLICE_FLOATS (128 * 1024) /* a slice of x's rows: 512 KiB, a quarter of a 2 MiB L2 */

INLINE fvec loadv(const float *p) {
    fvec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The next panel group's bytes, fetched into L2 a few lines per k while this group computes, so
 * that the weight streams from memory during all of a group's row blocks instead of stalling the
 * first one (which alone would need more bandwidth than a core gets). */
typedef struct {
    const char *next, *end;
    int lines_per_k;
} ahead_t;

/* y[0:mr, 0:cols] = the rows a (row stride lda) times np panels from b, plus bias; cols: the valid
 * columns of these panels (fewer than np*NR only in the last panel). acc: the caller's fixed-size
 * array of mr*np*NV vectors, which the compiler keeps in registers once every loop is unrolled. */
INLINE void tile(const int mr, const int np, fvec *acc, const float *a, int64_t lda, const float *b,
                 int64_t panel_stride, const float *bias, float *y, int64_t ldy, int k, int cols, ahead_t *ahead) {
    const char *fetch = ahead->next;
    const int lines = ahead->lines_per_k;
    UNROLL for (int j = 0; j < np * NV; j++) {
        const fvec init = bias ? loadv(bias + j * LANES) : (fvec){0};
        UNROLL for (int i = 0; i < mr; i++)
            acc[i * np * NV + j] = init;
    }
    for (int kk = 0; kk < k; kk++) {
        if (fetch < ahead->end) {
            for (int l = 0; l < lines; l++)
                __builtin_prefetch(fetch + 64 * l, 0, 2);
            fetch += 64 * lines;
        }
        fvec bv[GROUP * NV];
        UNROLL for (int j = 0; j < np * NV; j++)
            bv[j] = loadv(b + (j / NV) * panel_stride + (int64_t)kk * NR + (j % NV) * LANES);
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

/* One tile size as its own function, with its accumulators in an array of constant size. */
#define TILE(r, p)                                                                                        \
    static void tile_##r##_##p(const float *a, int64_t lda, const float *b, int64_t panel_stride, const float *bias,   \
                               float *y, int64_t ldy, int k, int cols, ahead_t *ahead) {                  \
        fvec acc[r * p * NV];                                                                             \
        tile(r, p, acc, a, lda, b, panel_stride, bias, y, ldy, k, cols, ahead);                                \
    }

typedef void tile_fn(const float *a, int64_t lda, const float *b, int64_t panel_stride, const float *bias, float *y,
                     int64_t ldy, int k, int cols, ahead_t *ahead);

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

/* How many tiles a block of mr rows takes over `panels` panels. */
static int tiles(int mr, int panels) { return panels / PANELS(mr) + panels % PANELS(mr); }

/* One block of mr rows (at a, row stride lda) against `panels` panels from panel p. */
static void row_block(int mr, const float *a, int64_t lda, const float *packed, const float *bias, float *y,
                      int n, int k, int p, int panels, ahead_t *ahead) {
    const int64_t panel_stride = (int64_t)k * NR;
    const int np = PANELS(mr);
    for (int q = 0; q < panels;) {
        const int take = q + np <= panels ? np : 1, col = (p + q) * NR;
        (take == np ? wide : narrow)[mr](a, lda, packed + (p + q) * panel_stride, panel_stride,
                                         bias ? bias + col : NULL, y + col, n, k,
                                         n - col < take * NR ? n - col : take * NR, ahead);
        q += take;
    }
}

int gemm_f32_panel_width(void) { return NR; }

void gemm_f32(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int m, int n, int k) {
    const int panels = (n + NR - 1) / NR;
    int slice = k > 0 ? SLICE_FLOATS / k / MR * MR : m;
    if (slice < MR)
        slice = MR;
    if (slice > m)
        slice = m;
    for (int r0 = 0; r0 < m; r0 += slice) {
        const int rows = m - r0 < slice ? m - r0 : slice;
        /* panels per group: GROUP_BYTES of weight, or what one tile takes (a few rows take several) */
        int per_group = (int)(GROUP_BYTES / ((int64_t)k * NR * sizeof(float) + 1));
        if (per_group < PANELS(rows < MR ? rows : MR))
            per_group = PANELS(rows < MR ? rows : MR);
        for (int p = 0; p < panels; p += per_group) {
            const int group = panels - p < per_group ? panels - p : per_group;
            const int after = panels - p - group < per_group ? panels - p - group : per_group;
            int count = 0;
            for (int b = 0; b < rows; b += MR)
                count += tiles(rows - b < MR ? rows - b : MR, group);
            const int64_t lines = (int64_t)after * k * NR * sizeof(float) / 64, steps = (int64_t)count * k;
            ahead_t ahead = {(const char *)(packed + (int64_t)(p + group) * k * NR), NULL,
                             steps ? (int)((lines + steps - 1) / steps) : 0};
            ahead.end = ahead.next + 64 * lines;
            for (int b = 0; b < rows; b += MR)
                row_block(rows - b < MR ? rows - b : MR, x + (int64_t)(r0 + b) * ldx, ldx, packed, bias,
                          y + (int64_t)(r0 + b) * n, n, k, p, group, &ahead);
        }
    }
}
