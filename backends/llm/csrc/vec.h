/*
 * Eight-float vectors for the CPU kernels: loads and stores, horizontal sums, a vector exp.
 * The portable vector type (GCC and Clang vector extensions) compiles to whatever SIMD the
 * target has (two SSE registers, one AVX register, half an AVX-512 one).
 */
#ifndef HUB_VEC_H
#define HUB_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

static inline float hsum8(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUFFLE __builtin_shufflevector
/* Lane pairs summed, for two inputs at once: a's (0,1) (2,3), b's (0,1) (2,3), then the same
 * for the upper 128-bit halves. */
static inline v8 pair_sums(v8 a, v8 b) {
    return SHUFFLE(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* The eight lane sums of a0..a7 as one vector, by a transposing tree of adds (no scalars). */
static inline v8 hsum8_x8(v8 a0, v8 a1, v8 a2, v8 a3, v8 a4, v8 a5, v8 a6, v8 a7) {
    const v8 c0 = pair_sums(pair_sums(a0, a1), pair_sums(a2, a3));
    const v8 c1 = pair_sums(pair_sums(a4, a5), pair_sums(a6, a7));
    /* c0 lanes: a0..a3 low-half sums, then a0..a3 high-half sums (c1 the same for a4..a7) */
    return SHUFFLE(c0, c1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(c0, c1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* The lane sums of a0..a3 into out[0..3]. */
static inline void hsum8_x4(v8 a0, v8 a1, v8 a2, v8 a3, float *out) {
    const v8 c = pair_sums(pair_sums(a0, a1), pair_sums(a2, a3));
    out[0] = c[0] + c[4];
    out[1] = c[1] + c[5];
    out[2] = c[2] + c[6];
    out[3] = c[3] + c[7];
}
#else
static inline v8 hsum8_x8(v8 a0, v8 a1, v8 a2, v8 a3, v8 a4, v8 a5, v8 a6, v8 a7) {
    const v8 out = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3),
                    hsum8(a4), hsum8(a5), hsum8(a6), hsum8(a7)};
    return out;
}

static inline void hsum8_x4(v8 a0, v8 a1, v8 a2, v8 a3, float *out) {
    out[0] = hsum8(a0);
    out[1] = hsum8(a1);
    out[2] = hsum8(a2);
    out[3] = hsum8(a3);
}
#endif

/* Lane-wise a where mask is set (all ones), else b. */
static inline v8 select8(v8i mask, v8 a, v8 b) {
    v8i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    const v8i r = (mask & ai) | (~mask & bi);
    v8 out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* exp of eight floats: Cephes' expf (range reduction by ln 2, a degree-6 polynomial, the
 * exponent set directly), within 1 ulp of exp over the arguments softmax meets, [-87, 0];
 * below that, subnormal values down to about -87.7 and 0 beyond (harmless in a softmax);
 * above 88.38, exp(88.38). */
static inline v8 exp8(v8 x) {
    const v8 hi = {88.3762626647949f, 88.3762626647949f, 88.3762626647949f, 88.3762626647949f,
                   88.3762626647949f, 88.3762626647949f, 88.3762626647949f, 88.3762626647949f};
    x = select8(x > hi, hi, x);
    x = select8(x < -hi, -hi, x);
    v8 fx = x * 1.44269504088896341f + 0.5f;
    v8i n = __builtin_convertvector(fx, v8i); /* truncates towards zero */
    v8 fn = __builtin_convertvector(n, v8);
    const v8i too_big = fn > fx; /* floor: step down where truncation went up */
    n += too_big;                /* too_big lanes are -1 */
    fn = __builtin_convertvector(n, v8);
    x = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    v8 y = 1.9875691500e-4f * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + x + 1.0f;
    const v8i scale_bits = (n + 127) << 23;
    v8 scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    return y * scale;
}

#endif
