/*
 * A linear layer of the fused step over one thread's share of its outputs: y = x W^T (+ b),
 * W float32 or int8 with a scale per output row, through the tiles of tiles.h.
 *
 * Outputs are computed a column block at a time (PANEL_COLUMNS or ROW_COLUMNS weight rows):
 * the block's weight rows as float32 (int8 ones dequantized into this thread's scratch,
 * times their scale, while the next block's bytes are prefetched), then every input row
 * against them into a small row-major block, which the caller's epilogue writes out (plain,
 * added to a residual, or SwiGLU's silu(gate) * up).
 */
#ifndef HUB_PROJECT_H
#define HUB_PROJECT_H

#include "tiles.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

/* Eight int8 values as floats: with AVX2 one widening load and one convert (GCC turns the
 * generic conversion of an int8 vector into eight scalar ones). */
static inline v8 widen8(const int8_t *p) {
#ifdef __AVX2__
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    v8 out;
    memcpy(&out, &f, sizeof out);
    return out;
#else
    const v8 out = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
    return out;
#endif
}

/* A linear layer's weights as torch keeps them: (out, in) float32, or int8 with one float32
 * scale per output row (backends/llm/quantization.py); a bias or NULL. */
struct hub_weight {
    const float *f32;
    const int8_t *i8;
    const float *scale;
    const float *bias;
};

/* Rows from which a projection packs its input into panels; below, one row takes row tiles
 * and 2-5 rows multi-row tiles (which beat panels up to five rows on the trained target's
 * shapes: 1.9-2.3 against 2.6-2.8 ms for its projections at four and five rows, two
 * threads). int8 weights are widened in registers by row tiles and into scratch for panels,
 * which pays from more rows on (the widening into scratch costs more than it saves below
 * about ten rows). */
#define PANEL_MIN_ROWS 6
#define INT8_PANEL_MIN_ROWS 10

static inline int64_t panel_min_rows(const struct hub_weight *w) {
    return w->i8 ? INT8_PANEL_MIN_ROWS : PANEL_MIN_ROWS;
}
/* Weight rows of a column block, either way: at most this many (PANEL_COLUMNS, ROW_COLUMNS). */
#define BLOCK_COLUMNS 16
_Static_assert(PANEL_COLUMNS <= BLOCK_COLUMNS && ROW_COLUMNS <= BLOCK_COLUMNS,
               "a column block fits the scratch sized by BLOCK_COLUMNS");

/* The input of a projection: m rows of k floats, ldx apart; the same rows packed into panels
 * when there are enough of them (else NULL), shared by the team; this thread's scratch for
 * dequantized weight rows (2 * BLOCK_COLUMNS * k floats) and for blocks of outputs
 * (2 * BLOCK_COLUMNS * m). */
struct operand {
    const float *x, *panels;
    float *weights, *blocks;
    int64_t ldx, m, k;
    int stream; /* the weights' read-ahead is non-temporal (prefetch_weights) */
};

/* The operand for rows x against weights like w; packs them into `panels` when that pays.
 * Every thread of the team calls it alike: the panels are shared out among them (an
 * orphaned `omp for`), each packed once, all of them before any thread goes on. */
static struct operand operand(const float *x, int64_t ldx, int64_t m, int64_t k,
                              const struct hub_weight *w, float *panels, float *weights,
                              float *blocks, int stream) {
    const int pack = m >= panel_min_rows(w);
    const struct operand a = {x, pack ? panels : NULL, weights, blocks, ldx, m, k, stream};
    if (pack) {
        const struct panels p = panel_layout(m);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t b = 0; b < panel_count(p); b++) pack_panel(x, ldx, m, k, panels, p, b);
    }
    return a;
}

/* Columns of one block: panel tiles take PANEL_COLUMNS at a time, row tiles ROW_COLUMNS. */
static inline int64_t block_columns(const struct operand *a) {
    return a->panels ? PANEL_COLUMNS : ROW_COLUMNS;
}

/* Weight rows [n, n + count) as float32, k floats each: the weights themselves, or int8
 * ones times their row's scale, written to `scratch`. */
static const float *weight_rows(const struct hub_weight *w, int64_t n, int64_t count, int64_t k,
                                float *scratch) {
    if (w->f32) return w->f32 + n * k;
    for (int64_t c = 0; c < count; c++) {
        const int8_t *q = w->i8 + (n + c) * k;
        const float s = w->scale[n + c];
        float *d = scratch + c * k;
        int64_t i = 0;
        for (; i + 8 <= k; i += 8) {
            if (i % 64 == 0) __builtin_prefetch(q + count * k + i); /* the next block's row */
            store8(d + i, widen8(q + i) * s);
        }
        for (; i < k; i++) d[i] = (float)q[i] * s;
    }
    return scratch;
}

/* out[c] = (x . q_c) * scale[c] for the ROW_COLUMNS int8 weight rows q_c = q + c * k: the
 * row tile of int8 weights, widened in registers (a few rows read them once, so widening
 * them into scratch first would cost more than the products). */
__attribute__((noinline)) static void row_tile_i8(const float *x, const int8_t *q,
                                                  const float *scale, int64_t k, float *out,
                                                  int stream) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    const int64_t body = k - k % 8;
    for (int64_t i = 0; i < body; i += 8) {
        if (i % 64 == 0)
            for (int c = 0; c < ROW_COLUMNS; c++)
                prefetch_weights(q + (ROW_COLUMNS + c) * k + i, stream);
        const v8 xv = load8(x + i);
        a0 += xv * widen8(q + i);
        a1 += xv * widen8(q + k + i);
        a2 += xv * widen8(q + 2 * k + i);
        a3 += xv * widen8(q + 3 * k + i);
        a4 += xv * widen8(q + 4 * k + i);
        a5 += xv * widen8(q + 5 * k + i);
        a6 += xv * widen8(q + 6 * k + i);
        a7 += xv * widen8(q + 7 * k + i);
    }
    store8(out, hsum8_x8(a0, a1, a2, a3, a4, a5, a6, a7) * load8(scale));
    for (int64_t i = body; i < k; i++)
        for (int c = 0; c < ROW_COLUMNS; c++) out[c] += x[i] * (float)q[c * k + i] * scale[c];
}

/* out (m rows of `columns`, row-major) = x . w_c for every row of `a` and the weight rows
 * w_c = wt + c * k, c < columns (at most block_columns(a)). */
static void column_block(const struct operand *a, const float *wt, int64_t columns, float *out) {
    const int64_t k = a->k, m = a->m;
    if (a->panels) {
        v8 acc[PANEL_COLUMNS][2];
        const struct panels p = panel_layout(m);
        for (int64_t b = 0; b < panel_count(p); b++) {
            any_panel_tile(a->panels, p, b, wt, k, columns, acc);
            const int64_t first = b * PANEL, width = panel_width(p, b);
            const int64_t rows = m - first < width ? m - first : width;
            for (int64_t c = 0; c < columns; c++) {
                float t[PANEL];
                store8(t, acc[c][0]);
                if (width == PANEL) store8(t + 8, acc[c][1]);
                for (int64_t r = 0; r < rows; r++) out[(first + r) * columns + c] = t[r];
            }
        }
        return;
    }
    if (m > 1 && columns == ROW_COLUMNS) {
        multi_rows(a->x, a->ldx, m, wt, k, out, a->stream);
        return;
    }
    for (int64_t r = 0; r < m; r++) {
        const float *xr = a->x + r * a->ldx;
        if (columns == ROW_COLUMNS) {
            row_tile(xr, wt, k, out + r * columns, a->stream);
        } else {
            for (int64_t c = 0; c < columns; c++) out[r * columns + c] = row_dot(xr, wt + c * k, k);
        }
    }
}

/* out (m rows of `columns`) = x . W_n for weight rows [n, n + columns) of w, whatever their
 * type; `scratch` holds dequantized weights where a tile needs them as float32. */
static void block(const struct operand *a, const struct hub_weight *w, int64_t n,
                  int64_t columns, float *scratch, float *out) {
    const int64_t k = a->k;
    if (w->i8 && !a->panels && columns == ROW_COLUMNS) {
        for (int64_t r = 0; r < a->m; r++)
            row_tile_i8(a->x + r * a->ldx, w->i8 + n * k, w->scale + n, k, out + r * columns,
                        a->stream);
        return;
    }
    column_block(a, weight_rows(w, n, columns, k, scratch), columns, out);
}

/* y[r, n] = x_r . W_n + bias[n] (add: y[r, n] += that) for every row r of `a` and weight
 * rows [n0, n1); y rows ldy apart. */
static void project(const struct operand *a, const struct hub_weight *w, int64_t n0, int64_t n1,
                    float *y, int64_t ldy, int add) {
    const int64_t m = a->m;
    for (int64_t n = n0; n < n1; n += block_columns(a)) {
        const int64_t columns = n1 - n < block_columns(a) ? n1 - n : block_columns(a);
        block(a, w, n, columns, a->weights, a->blocks);
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < columns; c++) {
                float *d = y + r * ldy + n + c;
                const float v = a->blocks[r * columns + c] + (w->bias ? w->bias[n + c] : 0.0f);
                *d = add ? *d + v : v;
            }
    }
}

static inline v8 silu_times(v8 g, v8 u) { return g / (1.0f + exp8(-g)) * u; }

/* act[r, n] = silu(x_r . G_n + gb[n]) * (x_r . U_n + ub[n]) for weight rows [n0, n1); act
 * rows ld apart. */
static void gated(const struct operand *a, const struct hub_weight *gate,
                  const struct hub_weight *up, int64_t n0, int64_t n1, float *act, int64_t ld) {
    const int64_t k = a->k, m = a->m, cols = block_columns(a);
    float *g = a->blocks, *u = a->blocks + m * BLOCK_COLUMNS;
    float *gw = a->weights, *uw = a->weights + BLOCK_COLUMNS * k;
    for (int64_t n = n0; n < n1; n += cols) {
        const int64_t columns = n1 - n < cols ? n1 - n : cols;
        block(a, gate, n, columns, gw, g);
        block(a, up, n, columns, uw, u);
        for (int64_t r = 0; r < m; r++) {
            float gr[BLOCK_COLUMNS] = {0}, ur[BLOCK_COLUMNS] = {0};
            for (int64_t c = 0; c < columns; c++) {
                gr[c] = g[r * columns + c] + (gate->bias ? gate->bias[n + c] : 0.0f);
                ur[c] = u[r * columns + c] + (up->bias ? up->bias[n + c] : 0.0f);
            }
            for (int64_t c = 0; c < columns; c += 8)
                store8(gr + c, silu_times(load8(gr + c), load8(ur + c)));
            memcpy(act + r * ld + n, gr, sizeof(float) * (size_t)columns);
        }
    }
}

#endif
