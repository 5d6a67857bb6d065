/*
 * A linear layer for a few rows on the CPU, float32: y = x W^T (+ bias), the product a decode
 * step at a small batch spends most of its time in. With one to a few rows it is a stream of
 * the weights through the cores (each weight used once per row), bound by memory bandwidth,
 * and torch's BLAS path for it runs on one core; here the output rows are split over
 * `threads` OpenMP threads (the runtime torch has loaded), which together read the weights
 * at close to twice the rate of one.
 *
 * Layouts (all contiguous): x (m, in), w (out, in), bias (out) or NULL, y (m, out).
 *
 * Four output rows are computed at a time: for each input row, four independent chains of
 * 8-wide multiply-adds (the portable vector type compiles to whatever SIMD the target has)
 * over `in`; the four weight rows stay in the core's cache while the input rows take turns.
 *
 * Returns HUB_OK, or HUB_BAD_SHAPE (having done nothing) for a size out of range or a
 * missing input, weight or output.
 */
#include <stdint.h>
#include <string.h>

#include "check.h"

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum8(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

int hub_linear_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Output rows o .. o + 3 of every input row. */
static void four_rows(const float *x, int64_t m, const float *w, const float *bias, float *y,
                      int64_t in, int64_t out, int64_t o) {
    const float *w0 = w + o * in, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
    int64_t body = in - in % 8;
    for (int64_t j = 0; j < m; j++) {
        const float *xj = x + j * in;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t i = 0; i < body; i += 8) {
            v8 xv = load8(xj + i);
            a0 += load8(w0 + i) * xv;
            a1 += load8(w1 + i) * xv;
            a2 += load8(w2 + i) * xv;
            a3 += load8(w3 + i) * xv;
        }
        float s0 = sum8(a0), s1 = sum8(a1), s2 = sum8(a2), s3 = sum8(a3);
        for (int64_t i = body; i < in; i++) {
            s0 += w0[i] * xj[i];
            s1 += w1[i] * xj[i];
            s2 += w2[i] * xj[i];
            s3 += w3[i] * xj[i];
        }
        float *yj = y + j * out + o;
        yj[0] = s0 + (bias ? bias[o] : 0.0f);
        yj[1] = s1 + (bias ? bias[o + 1] : 0.0f);
        yj[2] = s2 + (bias ? bias[o + 2] : 0.0f);
        yj[3] = s3 + (bias ? bias[o + 3] : 0.0f);
    }
}

/* Output row o of every input row (the last out % 4 rows). */
static void one_row(const float *x, int64_t m, const float *w, const float *bias, float *y,
                    int64_t in, int64_t out, int64_t o) {
    const float *wo = w + o * in;
    int64_t body = in - in % 16;
    for (int64_t j = 0; j < m; j++) {
        const float *xj = x + j * in;
        v8 a0 = {0}, a1 = {0};
        for (int64_t i = 0; i < body; i += 16) {
            a0 += load8(wo + i) * load8(xj + i);
            a1 += load8(wo + i + 8) * load8(xj + i + 8);
        }
        float s = sum8(a0 + a1);
        for (int64_t i = body; i < in; i++) s += wo[i] * xj[i];
        y[j * out + o] = s + (bias ? bias[o] : 0.0f);
    }
}

int hub_linear_f32(const float *x, int64_t m, const float *w, const float *bias, float *y,
                   int64_t in, int64_t out, int threads) {
    if (m < 0 || in < 1 || out < 0 || ((!x || !w || !y) && m > 0 && out > 0))
        return HUB_BAD_SHAPE;
    int64_t blocks = out / 4;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads > 1 && blocks > 1 ? threads : 1) schedule(static)
#endif
    for (int64_t b = 0; b < blocks; b++) four_rows(x, m, w, bias, y, in, out, 4 * b);
    for (int64_t o = 4 * blocks; o < out; o++) one_row(x, m, w, bias, y, in, out, o);
    return HUB_OK;
}
