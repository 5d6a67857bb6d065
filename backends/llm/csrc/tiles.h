/*
 * Register tiles of y = x W^T for a few rows of x, float32, W in its natural (out, in)
 * layout (the layout torch keeps a linear layer's weight in, so nothing is copied or
 * repacked), in three shapes:
 *
 * - Row tiles, for one row (a memory-bound stream of the weights): one input row by 8
 *   weight rows, each weight row's dot product in turn (four chains of 8-wide multiply-adds
 *   along `k`), so the tile's weights, adjacent rows, are read as one stream in address
 *   order. One stream reads memory faster than eight side by side (the hardware
 *   prefetchers follow it): on two cores 10-14% in a microbenchmark of 88 MB, and a quarter
 *   less time per decode step of the 26M benchmark Llama.
 * - Multi-row tiles, for two to five rows (a verify step of speculative decoding, a few
 *   streams): the same stream of weights, each 8 weights loaded once for every row of a
 *   group whose inputs fit L1. Row tiles per input row were bound by the load ports (two
 *   loads a multiply-add); four weight rows side by side against the rows ran at half the
 *   memory bandwidth.
 *
 * Both read the next tile's weights ahead (a software prefetch a cache line, the same
 * column of the tile 8 weight rows on, which the same thread computes next), so that the
 * memory stream goes on while the multiply-adds of a few rows run: without it a tile's
 * compute and its reads took turns, and each row past the first added its own compute to
 * the stream's time. On two cores, the trained target's projections (18M weights) at one
 * and five rows took 1.17 and 1.53 ms before, 1.10-1.14 and 1.18-1.20 ms with it.
 * - Panel tiles, from six rows on (compute-bound): the input rows are first packed
 *   transposed, 16 rows to a panel ((k, 16) floats), and a tile is 16 rows by 6 weight rows
 *   with the rows along the vector lanes: per step of k, two panel loads and six broadcast
 *   weights feed 12 multiply-adds into 12 accumulators, with no sums across lanes at the
 *   end. That runs near the core's multiply-add peak where row tiles, loading as often as
 *   they multiply, reach about two thirds of it. Built for AVX-512 (32 vector registers of
 *   16 floats), a tile is 16 rows by 12 weight rows: per step of k one panel load and twelve
 *   broadcast weights feed twelve 16-wide multiply-adds, twice the floats an instruction.
 */
#ifndef HUB_TILES_H
#define HUB_TILES_H

#include "vec.h"

/* Weight rows of a row tile. */
#define ROW_COLUMNS 8

/* Read the weights at p ahead. `stream`: the model's weights are larger than the last-level
 * cache, so a step reads every byte from memory and none is still there at the next step;
 * the read-ahead is then non-temporal, which keeps the weights from evicting what the
 * caches do hold from step to step: the engine's Python between two steps, the event loop
 * streaming the tokens, a client on the same cores, a draft model's weights. Run cold after
 * a step that had swept the caches, that code took 1.2-1.6x its time. A model that fits keeps
 * its weights cached between steps. (The panel tiles, which reuse a block of weight rows
 * across panels, read ahead as usual.) */
static inline void prefetch_weights(const void *p, int stream) {
    if (stream)
        __builtin_prefetch(p, 0, 0);
    else
        __builtin_prefetch(p, 0, 3);
}

/* x . w over k, four chains of 8-wide multiply-adds along k: the row's bytes in address
 * order; `ahead` (or NULL) is read ahead as far as w is read. */
static inline float row_dot_ahead(const float *x, const float *w, int64_t k,
                                  const float *ahead, int stream) {
    v8 b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        if (ahead) prefetch_weights(ahead + i, stream), prefetch_weights(ahead + i + 16, stream);
        b0 += load8(x + i) * load8(w + i);
        b1 += load8(x + i + 8) * load8(w + i + 8);
        b2 += load8(x + i + 16) * load8(w + i + 16);
        b3 += load8(x + i + 24) * load8(w + i + 24);
    }
    for (; i + 8 <= k; i += 8) b0 += load8(x + i) * load8(w + i);
    float s = hsum8((b0 + b1) + (b2 + b3));
    for (; i < k; i++) s += x[i] * w[i];
    return s;
}

/* x . w over k (also each weight row of a product that no whole tile covers). */
static inline float row_dot(const float *x, const float *w, int64_t k) {
    return row_dot_ahead(x, w, k, NULL, 0);
}

/* out[c] = x . w_c over k for the ROW_COLUMNS weight rows w_c = w + c * k, one row after
 * the other: the tile's weights are one stream in address order (its rows are adjacent),
 * which the hardware prefetchers follow at more of memory's bandwidth than eight streams
 * side by side; x stays in L1 across the rows. The next tile's rows are read ahead. */
__attribute__((noinline)) static void row_tile(const float *x, const float *w, int64_t k,
                                               float *out, int stream) {
    for (int c = 0; c < ROW_COLUMNS; c++)
        out[c] = row_dot_ahead(x, w + c * k, k, w + (ROW_COLUMNS + c) * k, stream);
}

/* Input rows a multi-row tile takes at once: the most a projection below PANEL_MIN_ROWS has
 * (ten accumulators and two weight vectors, of AVX2's 16 vector registers). */
#define MULTI_ROWS 5
/* Bytes of input rows a group may hold: they stay in L1 (32 KiB a core) while the weights
 * stream past them. With the weights read ahead, the five rows of the trained target's
 * down projection (5 x 1,408 floats) as one group beat groups of two, two and one (a
 * verify step of five rows 1.61-1.64 against 1.83-1.84 ms); without reading ahead it had
 * been the other way round (three rows took a third again the time of two and one). */
#define MULTI_X_BYTES 28672

/* out[r * ldo + c] = x_r . w_c over k for R input rows x_r = x + r * ldx and the
 * ROW_COLUMNS weight rows w_c = w + c * k, one weight row after the other (the weights one
 * stream in address order, as in row_tile): each 8 weights loaded feed all R rows, two
 * chains a row along k, the inputs read from L1. A step of 16 along k is then 2 + 2R loads
 * for 2R multiply-adds, where a row tile per input row loads twice for every multiply-add:
 * a few rows (a verify step of speculative decoding) were bound by the load ports. The
 * accumulators are named variables, not arrays: kept as arrays, GCC spilled them to the
 * stack around every weight row, and the tile ran at half its speed or full speed depending
 * on where the stack lay (the same binary under two names: 4.1-4.8 against 2.1-2.6 ms for
 * five rows of the trained target's projections). */
#define MULTI_TILE(R)                                                                           \
    __attribute__((noinline)) static void multi_tile_##R(const float *x, int64_t ldx,          \
                                                         const float *w, int64_t k, float *out, \
                                                         int64_t ldo, int stream) {             \
        const int64_t body = k - k % 16;                                                        \
        const float *x0 = x, *x1 = x + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx, *x4 = x3 + ldx;    \
        for (int c = 0; c < ROW_COLUMNS; c++) {                                                 \
            const float *wc = w + c * k, *ahead = wc + ROW_COLUMNS * k;                         \
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0};                                \
            v8 b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0}, b4 = {0};                                \
            for (int64_t i = 0; i < body; i += 16) {                                            \
                prefetch_weights(ahead + i, stream);                                            \
                const v8 w0 = load8(wc + i), w1 = load8(wc + i + 8);                            \
                a0 += load8(x0 + i) * w0, b0 += load8(x0 + i + 8) * w1;                        \
                a1 += load8(x1 + i) * w0, b1 += load8(x1 + i + 8) * w1;                        \
                if (R > 2) a2 += load8(x2 + i) * w0, b2 += load8(x2 + i + 8) * w1;             \
                if (R > 3) a3 += load8(x3 + i) * w0, b3 += load8(x3 + i + 8) * w1;             \
                if (R > 4) a4 += load8(x4 + i) * w0, b4 += load8(x4 + i + 8) * w1;             \
            }                                                                                   \
            const v8 sums[5] = {a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4};                   \
            for (int r = 0; r < R; r++) {                                                       \
                const float *xr = x + r * ldx;                                                  \
                float sum = hsum8(sums[r]);                                                     \
                for (int64_t i = body; i < k; i++) sum += xr[i] * wc[i];                        \
                out[r * ldo + c] = sum;                                                         \
            }                                                                                   \
        }                                                                                       \
    }
MULTI_TILE(2)
MULTI_TILE(3)
MULTI_TILE(4)
MULTI_TILE(5)

/* out (m rows of ROW_COLUMNS, row-major) = x_r . w_c for the m rows x_r = x + r * ldx and
 * the ROW_COLUMNS weight rows of a block, up to MULTI_ROWS input rows at a time (a block's
 * weights stay in cache while later groups take their turn). */
static inline void multi_rows(const float *x, int64_t ldx, int64_t m, const float *w, int64_t k,
                              float *out, int stream) {
    int64_t most = MULTI_X_BYTES / (4 * k);
    most = most < 2 ? 2 : most > MULTI_ROWS ? MULTI_ROWS : most;
    for (int64_t r = 0; r < m;) {
        const int64_t left = m - r, rows = left < most ? left : most;
        const float *xr = x + r * ldx;
        float *o = out + r * ROW_COLUMNS;
        switch (rows) {
        case 1: row_tile(xr, w, k, o, stream); break;
        case 2: multi_tile_2(xr, ldx, w, k, o, ROW_COLUMNS, stream); break;
        case 3: multi_tile_3(xr, ldx, w, k, o, ROW_COLUMNS, stream); break;
        case 4: multi_tile_4(xr, ldx, w, k, o, ROW_COLUMNS, stream); break;
        default: multi_tile_5(xr, ldx, w, k, o, ROW_COLUMNS, stream); break;
        }
        r += rows;
    }
}

/* Rows of a panel (a narrow one for what is left after whole panels, when that is at most
 * half a panel), and weight rows of a panel tile. */
#define PANEL 16
#define NARROW_PANEL 8
#ifdef __AVX512F__
/* With AVX-512 a panel row (16 floats) is one register and there are 32 of them: a tile of
 * twelve weight rows keeps twelve independent multiply-add chains going on one load a step. */
#define PANEL_COLUMNS 12
#else
#define PANEL_COLUMNS 6
#endif

/* How m rows are laid out in panels: `full` panels of PANEL rows (the last padded with
 * zero rows where more than NARROW_PANEL rows are left for it), then one narrow panel of
 * NARROW_PANEL rows holding the last `tail` rows (0: none). */
struct panels {
    int64_t full, tail;
};

static inline struct panels panel_layout(int64_t m) {
    struct panels p = {m / PANEL, m % PANEL};
    if (p.tail > NARROW_PANEL) p.full += 1, p.tail = 0;
    return p;
}

/* Panel b of the layout of m rows: its first row, rows in use, and width (PANEL or
 * NARROW_PANEL); k floats a row, transposed: (k, width) floats at xt + first * k. */
static inline int64_t panel_count(struct panels p) { return p.full + (p.tail > 0); }

static inline int64_t panel_width(struct panels p, int64_t b) {
    return b < p.full ? PANEL : NARROW_PANEL;
}

/* Panel b of xt = rows [0, m) of x, transposed into the panels of layout p; a panel's rows
 * past m are zeros. */
static inline void pack_panel(const float *x, int64_t ldx, int64_t m, int64_t k, float *xt,
                              struct panels p, int64_t b) {
    const int64_t first = b * PANEL, width = panel_width(p, b);
    float *panel = xt + first * k;
    const int64_t rows = m - first < width ? m - first : width;
    for (int64_t i = 0; i < k; i++) {
        for (int64_t r = 0; r < rows; r++) panel[i * width + r] = x[(first + r) * ldx + i];
        for (int64_t r = rows; r < width; r++) panel[i * width + r] = 0.0f;
    }
}

static inline v8 broadcast8(float f) { return (v8){f, f, f, f, f, f, f, f}; }

/* The next panel tile's weight rows at column i, a cache line each: the weights stream from
 * memory, and six short rows (a few KiB each) at a time leave the hardware prefetchers too
 * little run to get ahead. A prefetch past the weights' end never faults. */
static inline void prefetch_next(const float *w, int64_t k, int64_t i) {
    for (int c = 0; c < PANEL_COLUMNS; c++) __builtin_prefetch(w + (PANEL_COLUMNS + c) * k + i);
}

/* The tiles are kept out of line (noinline): inlined into a large caller, they lost registers
 * to it, and a spilled accumulator or pointer in the inner loop cost a third of the speed. */

/* Declares w0 .. w11, the weight rows w + c * k of a panel tile of `columns` (at most
 * PANEL_COLUMNS): a part tile repeats its last row rather than read past the weights, and
 * its extra columns are left to be ignored. */
#define PANEL_WEIGHT_ROWS(w, k, columns)                                                        \
    const float *wc[12];                                                                        \
    for (int64_t c = 0; c < 12; c++) wc[c] = (w) + (c < (columns) ? c : (columns) - 1) * (k);   \
    const float *w0 = wc[0], *w1 = wc[1], *w2 = wc[2], *w3 = wc[3], *w4 = wc[4], *w5 = wc[5];   \
    const float *w6 = wc[6], *w7 = wc[7], *w8 = wc[8], *w9 = wc[9], *w10 = wc[10];              \
    const float *w11 = wc[11];                                                                  \
    (void)w6, (void)w7, (void)w8, (void)w9, (void)w10, (void)w11

#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));

static inline v16 broadcast16(float f) {
    return (v16){f, f, f, f, f, f, f, f, f, f, f, f, f, f, f, f};
}

/* The low and high eight lanes of a. */
static inline void halves16(v16 a, v8 out[2]) {
    out[0] = (v8){a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]};
    out[1] = (v8){a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]};
}

/* acc[c] (two vectors: the panel's 16 rows) = panel rows . w_c over k, for the weight rows
 * w_c = w + c * k, c < columns (at most PANEL_COLUMNS; a part tile repeats its last row
 * rather than read past the weights, and its extra columns are left to be ignored). The
 * panel's 16 rows are one 16-wide vector here: per step of k one load and twelve broadcast
 * weights feed twelve multiply-adds. Against the 8-wide tile of six weight rows, 1.5x the
 * multiply-adds a second on one core of the AVX-512 machine this was measured on (200
 * against 131 GFLOP/s, a 128-row prefill's panels against 2,808 weight rows of 512). */
__attribute__((noinline)) static void panel_tile(const float *panel, const float *w, int64_t k,
                                                 int64_t columns, v8 acc[][2]) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0};
    v16 a6 = {0}, a7 = {0}, a8 = {0}, a9 = {0}, a10 = {0}, a11 = {0};
    PANEL_WEIGHT_ROWS(w, k, columns);
    for (int64_t i = 0; i < k; i++) {
        if (i % 16 == 0) prefetch_next(w, k, i);
        v16 x;
        memcpy(&x, panel + i * PANEL, sizeof x);
        a0 += broadcast16(w0[i]) * x, a1 += broadcast16(w1[i]) * x;
        a2 += broadcast16(w2[i]) * x, a3 += broadcast16(w3[i]) * x;
        a4 += broadcast16(w4[i]) * x, a5 += broadcast16(w5[i]) * x;
        a6 += broadcast16(w6[i]) * x, a7 += broadcast16(w7[i]) * x;
        a8 += broadcast16(w8[i]) * x, a9 += broadcast16(w9[i]) * x;
        a10 += broadcast16(w10[i]) * x, a11 += broadcast16(w11[i]) * x;
    }
    /* Each accumulator handed out by value: gathered into an array (or their address taken)
     * first, GCC kept all twelve on the stack through the loop, at 0.4x the speed. */
    halves16(a0, acc[0]), halves16(a1, acc[1]), halves16(a2, acc[2]), halves16(a3, acc[3]);
    halves16(a4, acc[4]), halves16(a5, acc[5]), halves16(a6, acc[6]), halves16(a7, acc[7]);
    halves16(a8, acc[8]), halves16(a9, acc[9]), halves16(a10, acc[10]), halves16(a11, acc[11]);
}

#else
/* acc[c] (two vectors: the panel's 16 rows) = panel rows . w_c over k, for the weight rows
 * w_c = w + c * k, c < columns (at most PANEL_COLUMNS; a part tile repeats its last row
 * rather than read past the weights, and its extra columns are left to be ignored). */
__attribute__((noinline)) static void panel_tile(const float *panel, const float *w, int64_t k,
                                                 int64_t columns, v8 acc[][2]) {
    v8 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0};
    v8 a30 = {0}, a31 = {0}, a40 = {0}, a41 = {0}, a50 = {0}, a51 = {0};
    PANEL_WEIGHT_ROWS(w, k, columns);
    for (int64_t i = 0; i < k; i++) {
        if (i % 16 == 0) prefetch_next(w, k, i);
        const v8 x0 = load8(panel + i * PANEL), x1 = load8(panel + i * PANEL + 8);
        v8 b = broadcast8(w0[i]);
        a00 += b * x0, a01 += b * x1;
        b = broadcast8(w1[i]);
        a10 += b * x0, a11 += b * x1;
        b = broadcast8(w2[i]);
        a20 += b * x0, a21 += b * x1;
        b = broadcast8(w3[i]);
        a30 += b * x0, a31 += b * x1;
        b = broadcast8(w4[i]);
        a40 += b * x0, a41 += b * x1;
        b = broadcast8(w5[i]);
        a50 += b * x0, a51 += b * x1;
    }
    acc[0][0] = a00, acc[0][1] = a01, acc[1][0] = a10, acc[1][1] = a11;
    acc[2][0] = a20, acc[2][1] = a21, acc[3][0] = a30, acc[3][1] = a31;
    acc[4][0] = a40, acc[4][1] = a41, acc[5][0] = a50, acc[5][1] = a51;
}

#endif

/* panel_tile on a narrow panel: acc[c][0] only (its 8 rows). One panel load and
 * PANEL_COLUMNS broadcasts a step feed as many multiply-adds (the accumulators past six are
 * compiled only where a tile has twelve columns). */
__attribute__((noinline)) static void narrow_tile(const float *panel, const float *w, int64_t k,
                                                  int64_t columns, v8 acc[][2]) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0};
    v8 a6 = {0}, a7 = {0}, a8 = {0}, a9 = {0}, a10 = {0}, a11 = {0};
    PANEL_WEIGHT_ROWS(w, k, columns);
    for (int64_t i = 0; i < k; i++) {
        if (i % 16 == 0) prefetch_next(w, k, i);
        const v8 x = load8(panel + i * NARROW_PANEL);
        a0 += broadcast8(w0[i]) * x, a1 += broadcast8(w1[i]) * x;
        a2 += broadcast8(w2[i]) * x, a3 += broadcast8(w3[i]) * x;
        a4 += broadcast8(w4[i]) * x, a5 += broadcast8(w5[i]) * x;
        if (PANEL_COLUMNS > 6) {
            a6 += broadcast8(w6[i]) * x, a7 += broadcast8(w7[i]) * x;
            a8 += broadcast8(w8[i]) * x, a9 += broadcast8(w9[i]) * x;
            a10 += broadcast8(w10[i]) * x, a11 += broadcast8(w11[i]) * x;
        }
    }
    /* By value, not through an array of the accumulators (see panel_tile). */
    acc[0][0] = a0, acc[1][0] = a1, acc[2][0] = a2, acc[3][0] = a3, acc[4][0] = a4;
    acc[5][0] = a5;
    if (PANEL_COLUMNS > 6) {
        acc[6][0] = a6, acc[7][0] = a7, acc[8][0] = a8, acc[9][0] = a9, acc[10][0] = a10;
        acc[11][0] = a11;
    }
}

/* The tile of panel b of layout p (rows b * PANEL ..) against weight rows w .. */
static inline void any_panel_tile(const float *xt, struct panels p, int64_t b, const float *w,
                                  int64_t k, int64_t columns, v8 acc[][2]) {
    if (panel_width(p, b) == PANEL)
        panel_tile(xt + b * PANEL * k, w, k, columns, acc);
    else
        narrow_tile(xt + b * PANEL * k, w, k, columns, acc);
}

#endif
