/*
 * Decode attention over a paged KV cache on the CPU, float32: each single-token sequence
 * attends over exactly its own context, read in place from the cache blocks (no gathered
 * copy of its keys and values, which costs more than the attention itself).
 *
 * Layouts (all contiguous):
 *   q      (batch, kv_heads, group, head_dim)  queries, already scaled
 *   cache  (2, num_blocks, block_size, kv_heads, head_dim)  keys, then values
 *   tables block ids of every sequence, concatenated; sequence r's start at table_starts[r]
 *   lens   context length of every sequence (its own token included)
 *   out    (batch, kv_heads, group, head_dim)
 *
 * Rows row_start, row_start + row_step, ... are computed. Built with OpenMP (against the
 * runtime torch has loaded), `threads` threads share them; built without, callers split the
 * batch over threads of their own. window > 0 limits each query to its last `window` keys;
 * softcap > 0 caps the logits as softcap * tanh(logit / softcap) before the softmax.
 * Returns 0, or -1 when scratch memory could not be allocated.
 *
 * Speed: a dot product of one query with one key is a chain of dependent multiply-adds
 * whose latency, not the arithmetic, bounds it; so keys are taken eight tokens at a time
 * (eight independent chains), and the weighted sum of values keeps 64 output lanes in
 * registers while it runs over a block's tokens; the softmax's exponentials are a vector
 * polynomial, not one libm call per logit (which alone cost more than the dot products).
 * The portable vector type (GCC and Clang vector extensions) compiles to whatever SIMD the
 * target has.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

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
#else
static inline v8 hsum8_x8(v8 a0, v8 a1, v8 a2, v8 a3, v8 a4, v8 a5, v8 a6, v8 a7) {
    const v8 out = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3),
                    hsum8(a4), hsum8(a5), hsum8(a6), hsum8(a7)};
    return out;
}
#endif

typedef int32_t v8i __attribute__((vector_size(32)));

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
 * below that, subnormal values down to about -87.7 and 0 beyond (harmless in a softmax). */
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

/* s[0:len] = exp(s - max(s)) / sum, in place. */
static void softmax(float *s, int64_t len) {
    int64_t i = 0;
    float m = -INFINITY;
    if (len >= 8) {
        v8 mv = load8(s);
        for (i = 8; i + 8 <= len; i += 8) {
            const v8 x = load8(s + i);
            mv = select8(x > mv, x, mv);
        }
        for (int k = 0; k < 8; k++) m = mv[k] > m ? mv[k] : m;
    }
    for (; i < len; i++) m = s[i] > m ? s[i] : m;
    v8 sums = {0};
    float tail = 0.0f;
    for (i = 0; i + 8 <= len; i += 8) {
        const v8 e = exp8(load8(s + i) - m);
        store8(s + i, e);
        sums += e;
    }
    for (; i < len; i++) {
        s[i] = expf(s[i] - m);
        tail += s[i];
    }
    const float inv = 1.0f / (hsum8(sums) + tail);
    for (i = 0; i < len; i++) s[i] *= inv;
}

static float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float tail = 0.0f;
    v8 acc = {0};
    for (; i + 8 <= n; i += 8) acc += load8(a + i) * load8(b + i);
    for (; i < n; i++) tail += a[i] * b[i];
    return hsum8(acc) + tail;
}

/* out[j] = q . k_j for eight keys k_j = k + j * stride (head_dim a multiple of 8). */
static void dot_x8(const float *q, const float *k, int64_t stride, int64_t head_dim,
                   float *out) {
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    for (int64_t c = 0; c < head_dim; c += 8) {
        const v8 qv = load8(q + c);
        a0 += qv * load8(k + c);
        a1 += qv * load8(k + stride + c);
        a2 += qv * load8(k + 2 * stride + c);
        a3 += qv * load8(k + 3 * stride + c);
        a4 += qv * load8(k + 4 * stride + c);
        a5 += qv * load8(k + 5 * stride + c);
        a6 += qv * load8(k + 6 * stride + c);
        a7 += qv * load8(k + 7 * stride + c);
    }
    store8(out, hsum8_x8(a0, a1, a2, a3, a4, a5, a6, a7));
}

/* acc[0:width] += sum_j p[j] * v_j[0:width] over `count` values
 * v_j = v + j * stride; width a multiple of 8, at most 64 (kept in registers). */
static void weighted_sum(float *acc, int64_t width, const float *p, const float *v,
                         int64_t stride, int64_t count) {
    if (width == 64) {
        v8 o0 = load8(acc), o1 = load8(acc + 8), o2 = load8(acc + 16), o3 = load8(acc + 24);
        v8 o4 = load8(acc + 32), o5 = load8(acc + 40), o6 = load8(acc + 48);
        v8 o7 = load8(acc + 56);
        for (int64_t j = 0; j < count; j++) {
            const float w = p[j];
            const float *x = v + j * stride;
            o0 += w * load8(x);
            o1 += w * load8(x + 8);
            o2 += w * load8(x + 16);
            o3 += w * load8(x + 24);
            o4 += w * load8(x + 32);
            o5 += w * load8(x + 40);
            o6 += w * load8(x + 48);
            o7 += w * load8(x + 56);
        }
        store8(acc, o0), store8(acc + 8, o1), store8(acc + 16, o2), store8(acc + 24, o3);
        store8(acc + 32, o4), store8(acc + 40, o5), store8(acc + 48, o6);
        store8(acc + 56, o7);
        return;
    }
    for (int64_t c = 0; c < width; c += 8) {
        v8 o = load8(acc + c);
        for (int64_t j = 0; j < count; j++) o += p[j] * load8(v + j * stride + c);
        store8(acc + c, o);
    }
}

struct layout {
    const float *keys, *values;
    int64_t block_size, kv_heads, group, head_dim, token_stride, scores_stride;
    int64_t window;
    float softcap;
};

/* One sequence: out = softmax(q K^T) V over its context. scores holds (heads, L) floats
 * `scores_stride` apart, acc heads * head_dim floats. */
static void decode_row(const struct layout *lay, const float *q, const int64_t *table, int64_t n,
                       float *scores, float *acc, float *out) {
    const int64_t bs = lay->block_size, kv_heads = lay->kv_heads, group = lay->group;
    const int64_t head_dim = lay->head_dim, stride = lay->token_stride;
    const int64_t ss = lay->scores_stride, heads = kv_heads * group;
    const int vector_dims = head_dim % 8 == 0;
    const int64_t first = (lay->window > 0 && n > lay->window) ? n - lay->window : 0;
    const int64_t len = n - first;

    /* Logits, in runs of tokens that sit next to each other in one block. */
    for (int64_t t = first; t < n;) {
        const int64_t offset = t % bs;
        const int64_t run = bs - offset < n - t ? bs - offset : n - t;
        const float *k = lay->keys + (table[t / bs] * bs + offset) * stride;
        int64_t j = 0;
        if (vector_dims)
            for (; j + 8 <= run; j += 8)
                for (int64_t head = 0; head < heads; head++)
                    dot_x8(q + head * head_dim, k + j * stride + head / group * head_dim, stride,
                           head_dim, scores + head * ss + (t - first + j));
        for (; j < run; j++)
            for (int64_t head = 0; head < heads; head++)
                scores[head * ss + (t - first + j)] =
                    dot(q + head * head_dim, k + j * stride + head / group * head_dim, head_dim);
        t += run;
    }
    /* Softmax weights, in place. */
    for (int64_t head = 0; head < heads; head++) {
        float *s = scores + head * ss;
        const float cap = lay->softcap;
        if (cap > 0.0f)
            for (int64_t i = 0; i < len; i++) s[i] = cap * tanhf(s[i] / cap);
        softmax(s, len);
    }
    /* Weighted values, block run by block run. */
    memset(acc, 0, sizeof(float) * (size_t)(heads * head_dim));
    for (int64_t t = first; t < n;) {
        const int64_t offset = t % bs;
        const int64_t run = bs - offset < n - t ? bs - offset : n - t;
        const float *v = lay->values + (table[t / bs] * bs + offset) * stride;
        for (int64_t head = 0; head < heads; head++) {
            float *a = acc + head * head_dim;
            const float *p = scores + head * ss + (t - first);
            const float *vh = v + head / group * head_dim;
            if (vector_dims) {
                for (int64_t c = 0; c < head_dim; c += 64) {
                    const int64_t width = head_dim - c < 64 ? head_dim - c : 64;
                    weighted_sum(a + c, width, p, vh + c, stride, run);
                }
            } else {
                for (int64_t j = 0; j < run; j++)
                    for (int64_t i = 0; i < head_dim; i++) a[i] += p[j] * vh[j * stride + i];
            }
        }
        t += run;
    }
    memcpy(out, acc, sizeof(float) * (size_t)(heads * head_dim));
}

/* 1 when built with OpenMP: then `threads` threads of the process's OpenMP runtime (the one
 * torch runs on) share the rows, and callers need no threads of their own. */
int hub_paged_decode_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int hub_paged_decode_f32(
    const float *q, const float *cache, int64_t num_blocks, int64_t block_size,
    int64_t kv_heads, int64_t group, int64_t head_dim, const int64_t *tables,
    const int64_t *table_starts, const int64_t *lens, int64_t batch, int64_t row_start,
    int64_t row_step, int64_t window, float softcap, int threads, float *out) {
    const int64_t heads = kv_heads * group;
    int64_t longest = 1;
    for (int64_t r = row_start; r < batch; r += row_step)
        if (lens[r] > longest) longest = lens[r];
    if (window > 0 && longest > window) longest = window;
    const struct layout lay = {
        .keys = cache,
        .values = cache + num_blocks * block_size * kv_heads * head_dim,
        .block_size = block_size,
        .kv_heads = kv_heads,
        .group = group,
        .head_dim = head_dim,
        .token_stride = kv_heads * head_dim,
        .scores_stride = longest,
        .window = window,
        .softcap = softcap,
    };
    const int64_t rows = row_start < batch ? (batch - row_start + row_step - 1) / row_step : 0;
    int failed = 0;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads > 1 && rows > 1 ? threads : 1) reduction(| : failed)
#endif
    {
        float *scores = malloc(sizeof(float) * (size_t)(heads * longest));
        float *acc = malloc(sizeof(float) * (size_t)(heads * head_dim));
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t i = 0; i < rows; i++) {
            const int64_t r = row_start + i * row_step;
            if (!scores || !acc) {
                failed = 1;
                continue;
            }
            decode_row(&lay, q + r * heads * head_dim, tables + table_starts[r], lens[r], scores,
                       acc, out + r * heads * head_dim);
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
