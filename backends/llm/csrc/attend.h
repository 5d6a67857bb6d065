/*
 * One query token's attention over its own context in a paged KV cache, float32, for one
 * key/value head and the query heads that share it: what the decode kernel and the fused
 * step both run.
 *
 * Cache layout: keys, then values, each (num_blocks, block_size, kv_heads, head_dim);
 * `table` lists the sequence's block ids, `n` is its context length (the token itself
 * included).
 *
 * Speed: a dot product of one query with one key is a chain of dependent multiply-adds
 * whose latency, not the arithmetic, bounds it; so keys are taken eight tokens at a time
 * (eight independent chains), and the weighted sum of values keeps 64 output lanes in
 * registers while it runs over a block's tokens; the softmax's exponentials are a vector
 * polynomial, not one libm call per logit (which alone cost more than the dot products).
 */
#ifndef HUB_ATTEND_H
#define HUB_ATTEND_H

#include "vec.h"

/* max(s[0:len]), len >= 1. */
static float row_max(const float *s, int64_t len) {
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
    return m;
}

/* s[0:len] = exp(s - m), in place; returns their sum. */
static float exp_shifted(float *s, int64_t len, float m) {
    int64_t i = 0;
    v8 sums = {0};
    float tail = 0.0f;
    for (; i + 8 <= len; i += 8) {
        const v8 e = exp8(load8(s + i) - m);
        store8(s + i, e);
        sums += e;
    }
    for (; i < len; i++) {
        s[i] = expf(s[i] - m);
        tail += s[i];
    }
    return hsum8(sums) + tail;
}

/* s[0:len] = exp(s - max(s)) / sum, in place. */
static void softmax(float *s, int64_t len) {
    const float inv = 1.0f / exp_shifted(s, len, row_max(s, len));
    for (int64_t i = 0; i < len; i++) s[i] *= inv;
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
    int64_t block_size, kv_heads, group, head_dim;
    int64_t window; /* > 0: each query sees its last `window` keys */
    float softcap;  /* > 0: logits capped as softcap * tanh(logit / softcap) */
};

/* Tokens whose logits attention holds at once: a longer context is taken in chunks of this
 * many, with a running maximum and sum per head (an online softmax), so its scratch does not
 * grow with the context. */
#define ATTEND_CHUNK 512

/* Floats of `scores` attend_heads needs for `heads` query heads over at most `longest`
 * tokens. */
static inline int64_t attend_scratch(int64_t heads, int64_t longest) {
    return longest > ATTEND_CHUNK ? heads * (ATTEND_CHUNK + 2) : heads * longest;
}

/* scores[h * ld + (t - from)] = q_h . k_t for tokens [from, to), in runs of tokens that sit
 * next to each other in one block. */
static void logits(const struct layout *lay, const float *q, const float *keys,
                   const int64_t *table, int64_t heads, int64_t from, int64_t to,
                   float *scores, int64_t ld) {
    const int64_t bs = lay->block_size, group = lay->group, head_dim = lay->head_dim;
    const int64_t stride = lay->kv_heads * head_dim;
    for (int64_t t = from; t < to;) {
        const int64_t offset = t % bs;
        const int64_t run = bs - offset < to - t ? bs - offset : to - t;
        const float *k = keys + (table[t / bs] * bs + offset) * stride;
        int64_t j = 0;
        if (head_dim % 8 == 0)
            for (; j + 8 <= run; j += 8)
                for (int64_t h = 0; h < heads; h++)
                    dot_x8(q + h * head_dim, k + j * stride + h / group * head_dim, stride,
                           head_dim, scores + h * ld + (t - from + j));
        for (; j < run; j++)
            for (int64_t h = 0; h < heads; h++)
                scores[h * ld + (t - from + j)] =
                    dot(q + h * head_dim, k + j * stride + h / group * head_dim, head_dim);
        t += run;
    }
}

/* out_h += sum_t p_h[t - from] v_t over tokens [from, to), p_h = weights + h * ld, block
 * run by block run. */
static void weigh_values(const struct layout *lay, const float *values, const int64_t *table,
                         int64_t heads, int64_t from, int64_t to, const float *weights,
                         int64_t ld, float *out) {
    const int64_t bs = lay->block_size, group = lay->group, head_dim = lay->head_dim;
    const int64_t stride = lay->kv_heads * head_dim;
    for (int64_t t = from; t < to;) {
        const int64_t offset = t % bs;
        const int64_t run = bs - offset < to - t ? bs - offset : to - t;
        const float *v = values + (table[t / bs] * bs + offset) * stride;
        for (int64_t h = 0; h < heads; h++) {
            float *a = out + h * head_dim;
            const float *p = weights + h * ld + (t - from);
            const float *vh = v + h / group * head_dim;
            if (head_dim % 8 == 0) {
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
}

static void cap_logits(float *s, int64_t len, float cap) {
    if (cap > 0.0f)
        for (int64_t i = 0; i < len; i++) s[i] = cap * tanhf(s[i] / cap);
}

/* The query heads of KV heads [kv0, kv1) of one token (q: their (kv1 - kv0) * group *
 * head_dim floats, already scaled) over the first `n` tokens of the context whose blocks
 * `table` lists: out (same shape) = softmax(q K^T) V. Each run of keys (and of values) in a
 * block is read for all these heads at once: with every KV head, a token's keys are one
 * contiguous stretch of memory. `scores` holds `attend_scratch(heads, n)` floats. */
static void attend_heads(const struct layout *lay, const float *q, const int64_t *table,
                         int64_t n, int64_t kv0, int64_t kv1, float *scores, float *out) {
    const int64_t head_dim = lay->head_dim, heads = (kv1 - kv0) * lay->group;
    const int64_t first = (lay->window > 0 && n > lay->window) ? n - lay->window : 0;
    const int64_t len = n - first;
    const float *keys = lay->keys + kv0 * head_dim, *values = lay->values + kv0 * head_dim;
    memset(out, 0, sizeof(float) * (size_t)(heads * head_dim));
    if (len <= ATTEND_CHUNK) { /* the whole context's weights at once */
        logits(lay, q, keys, table, heads, first, n, scores, len);
        for (int64_t h = 0; h < heads; h++) {
            cap_logits(scores + h * len, len, lay->softcap);
            softmax(scores + h * len, len);
        }
        weigh_values(lay, values, table, heads, first, n, scores, len, out);
        return;
    }
    /* Chunk by chunk: the values weighed by exp(logit - the running maximum), the sums so
     * far rescaled whenever the maximum grows, and divided by the total at the end. */
    float *maxima = scores + heads * ATTEND_CHUNK, *sums = maxima + heads;
    for (int64_t h = 0; h < heads; h++) maxima[h] = -INFINITY, sums[h] = 0.0f;
    for (int64_t from = first; from < n; from += ATTEND_CHUNK) {
        const int64_t to = n - from < ATTEND_CHUNK ? n : from + ATTEND_CHUNK;
        logits(lay, q, keys, table, heads, from, to, scores, ATTEND_CHUNK);
        for (int64_t h = 0; h < heads; h++) {
            float *s = scores + h * ATTEND_CHUNK;
            cap_logits(s, to - from, lay->softcap);
            const float chunk = row_max(s, to - from);
            const float m = chunk > maxima[h] ? chunk : maxima[h];
            if (m == -INFINITY) { /* nothing seen yet that weighs anything */
                memset(s, 0, sizeof(float) * (size_t)(to - from));
                continue;
            }
            if (m > maxima[h] && sums[h] > 0.0f) {
                const float rescale = expf(maxima[h] - m);
                for (int64_t i = 0; i < head_dim; i++) out[h * head_dim + i] *= rescale;
                sums[h] *= rescale;
            }
            maxima[h] = m;
            sums[h] += exp_shifted(s, to - from, m);
        }
        weigh_values(lay, values, table, heads, from, to, scores, ATTEND_CHUNK, out);
    }
    for (int64_t h = 0; h < heads; h++) {
        const float inv = 1.0f / sums[h];
        for (int64_t i = 0; i < head_dim; i++) out[h * head_dim + i] *= inv;
    }
}

#endif
