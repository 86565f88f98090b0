/* The tile driver both packed GEMMs share (gemm_f32.c, and gemm_bf16.c's AVX512-BF16 build): which
 * tiles of y run in which order, and the prefetch that streams the weight from memory meanwhile.
 *
 * The weight is packed in panels of NR output columns, panel_stride elements apart, each read by a
 * register-blocked micro-kernel as one sequential stream. A tile is mr rows of x times np panels,
 * its accumulators in vector registers over all of k; blocks of MR rows take PANELS(MR) panels at
 * once (the "wide" tile), and the few rows of a decode step's last block take more, so that even one
 * row has enough independent sums to hide the multiply-add latency. A group's last panels that fill
 * no wide tile go one at a time (the "narrow" tile).
 *
 * Loop order: x is taken in slices of rows that stay in L2 (SLICE_BYTES); in a slice, panel group by
 * panel group (GROUP_BYTES of weight, whole wide tiles), every row block runs over the group while it
 * is in L2, and the next group is prefetched meanwhile, a few lines per step of every tile, so each
 * panel comes from memory once per slice (once per call for up to a few hundred rows) without
 * stalling the first row block (which alone would need more bandwidth than a core gets).
 *
 * The including file defines, before including:
 *   X, W            x's and the packed weight's element types
 *   NR              output columns per panel
 *   MR, PANELS(mr)  rows per row block; the panels a block of mr rows takes at once
 *   VEC, VECS       the accumulators' vector type, and vectors per panel
 *   SLICE_BYTES, GROUP_BYTES
 *   STEPS(k)        the steps of a tile's loop over k inputs (the prefetch asks for lines_per_step per step)
 * and after it the micro-kernel, `tile(mr, np, acc, <tile_fn's arguments>)`, its sizes as functions
 * (TILE), and the `wide` and `narrow` tables of them that it passes to gemm_tiles.
 */
#ifndef LABKIT_GEMM_TILES_H
#define LABKIT_GEMM_TILES_H

#include "simd.h"

/* The next panel group's bytes, fetched into L2 a few lines per step while this group computes. */
typedef struct {
    const char *next, *end;
    int lines_per_step;
} ahead_t;

/* y[0:mr, 0:cols] (row stride ldy; float32 if y_f32, else bf16) = the rows a (row stride lda) times np
 * panels from b (panel_stride apart) over k inputs, plus bias (or NULL). */
typedef void tile_fn(const X *a, int64_t lda, const W *b, int64_t panel_stride, int64_t k, const float *bias,
                     void *y, int y_f32, int64_t ldy, int cols, ahead_t *ahead);

/* One tile size as its own function, with its accumulators in an array of constant size, which the
 * compiler keeps in registers once every loop over it is unrolled. */
#define TILE(r, p)                                                                                           \
    static void tile_##r##_##p(const X *a, int64_t lda, const W *b, int64_t panel_stride, int64_t k,           \
                               const float *bias, void *y, int y_f32, int64_t ldy, int cols, ahead_t *ahead) { \
        VEC acc[r * p * VECS];                                                                               \
        tile(r, p, acc, a, lda, b, panel_stride, k, bias, y, y_f32, ldy, cols, ahead);                       \
    }

/* y [m, n] = x [m, k] (row stride ldx) times the packed weight, plus bias (or NULL), with the tiles
 * wide[mr] (PANELS(mr) panels) and narrow[mr] (one) for a block of mr rows. */
INLINE void gemm_tiles(tile_fn *const *wide, tile_fn *const *narrow, const X *x, int64_t ldx, const W *packed,
                       int64_t panel_stride, const float *bias, void *y, int y_f32, int64_t m, int64_t n, int64_t k) {
    const int64_t panels = (n + NR - 1) / NR, panel_bytes = panel_stride * (int64_t)sizeof(W);
    const int64_t y_size = y_f32 ? sizeof(float) : sizeof(uint16_t);
    int64_t slice = k > 0 ? SLICE_BYTES / (k * (int64_t)sizeof(X)) / MR * MR : m;
    if (slice < MR) slice = MR;
    for (int64_t r0 = 0; r0 < m; r0 += slice) {
        const int64_t rows = m - r0 < slice ? m - r0 : slice;
        const int first = rows < MR ? (int)rows : MR;
        int64_t per_group = GROUP_BYTES / (panel_bytes > 0 ? panel_bytes : 1) / PANELS(first) * PANELS(first);
        if (per_group < PANELS(first)) per_group = PANELS(first);
        for (int64_t p = 0; p < panels; p += per_group) {
            const int64_t group = panels - p < per_group ? panels - p : per_group;
            const int64_t after = panels - p - group < per_group ? panels - p - group : per_group;
            int64_t count = 0; /* the tiles this group takes: they share the next group's prefetch */
            for (int64_t b = 0; b < rows; b += MR) {
                const int mr = rows - b < MR ? (int)(rows - b) : MR;
                count += group / PANELS(mr) + group % PANELS(mr);
            }
            const int64_t lines = after * panel_bytes / 64, steps = count * STEPS(k);
            ahead_t ahead = {(const char *)(packed + (p + group) * panel_stride), NULL,
                             steps ? (int)((lines + steps - 1) / steps) : 0};
            ahead.end = ahead.next + 64 * lines;
            for (int64_t b = 0; b < rows; b += MR) {
                const int mr = rows - b < MR ? (int)(rows - b) : MR, np = PANELS(mr);
                for (int64_t q = 0; q < group;) {
                    const int take = q + np <= group ? np : 1;
                    const int64_t col = (p + q) * NR, cols = n - col < take * NR ? n - col : take * NR;
                    (take == np ? wide : narrow)[mr](x + (r0 + b) * ldx, ldx, packed + (p + q) * panel_stride,
                                                     panel_stride, k, bias ? bias + col : NULL,
                                                     (char *)y + ((r0 + b) * n + col) * y_size, y_f32, n, (int)cols,
                                                     &ahead);
                    q += take;
                }
            }
        }
    }
}

#endif
