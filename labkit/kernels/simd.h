/* What every kernel of this folder shares: inlining and unrolling, the CPU's float vector, and the
 * bf16 <-> float32 conversions.
 *
 * Vectors are GCC/clang vector extensions of LANES floats, one register of the ISA the build targets
 * (labkit/kernels/build.py sets LANES: 16 for AVX-512, 8 for AVX2, 4 for NEON and SSE2), so most code
 * needs no intrinsics per ISA. bf16 is float32's top half: widening is a shift, and narrowing rounds
 * to nearest even as torch's .to(torch.bfloat16) does, a NaN staying a (quiet) NaN.
 */
#ifndef LABKIT_SIMD_H
#define LABKIT_SIMD_H

#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
/* On loops over a tile's or a group's vectors: fully unrolled, an array indexed by them stays in registers. */
#define UNROLL _Pragma("GCC unroll 64")

#ifndef LANES
#define LANES 16
#endif
typedef float fvec __attribute__((vector_size(4 * LANES)));
typedef int32_t ivec __attribute__((vector_size(4 * LANES)));
typedef uint32_t uvec __attribute__((vector_size(4 * LANES)));
typedef uint16_t u16vec __attribute__((vector_size(2 * LANES)));

INLINE float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

INLINE uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* LANES floats to bf16 at once, rounded as float_to_bf16 rounds each. */
INLINE u16vec fvec_to_bf16(fvec v) {
    uvec bits;
    memcpy(&bits, &v, sizeof bits);
    const uvec nan = (uvec)((bits & 0x7fffffffu) > 0x7f800000u);
    const uvec rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16, quiet = (bits >> 16) | 0x40u;
    return __builtin_convertvector((nan & quiet) | (~nan & rounded), u16vec);
}

/* n floats to bf16, LANES at a time (one at a time, a 2,048-row prompt step of the fused decoder
 * spent ~0.1 s a step converting). */
INLINE void floats_to_bf16(const float *src, int64_t n, uint16_t *dst) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        fvec v;
        memcpy(&v, src + i, sizeof v);
        const u16vec top = fvec_to_bf16(v);
        memcpy(dst + i, &top, sizeof top);
    }
    for (; i < n; i++) dst[i] = float_to_bf16(src[i]);
}

#endif
