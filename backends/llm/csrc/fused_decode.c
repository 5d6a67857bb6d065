/*
 * One step of a Llama-shaped decoder for the packed tokens of one engine step, on the CPU
 * (float32 activations; float32 or int8 weights), in one call: embeddings, every layer (RMS norms, q/k/v projections with optional biases and
 * per-head norms, rotary embedding, the K/V writes into the paged cache, attention over each
 * token's own context, the output projection, the SwiGLU MLP, residual adds), the final
 * norm and the LM head for the rows that sample.
 *
 * Why: at a few rows, a step is a stream of the weights through the cores, and what torch
 * adds around the products (a few hundred small operators a step, each a dispatch and a
 * pass over memory, and an OpenMP team meeting at the end of each) costs as much again; at
 * many rows, the products' register tiles (tiles.h) run faster than torch's here.
 * Here one OpenMP team (the runtime torch has loaded) works the whole step, meeting only
 * where the data needs it: after each norm, projection and attention stage.
 *
 * Every token is a row with its own position, cache slot and context (its sequence's block
 * table and its length, itself included), so decodes and short prompt chunks share a step:
 * all K/V writes of a layer happen before any of its attention reads them.
 *
 * Layouts (all contiguous float32 unless said):
 *   weights  as torch keeps them: linear (out, in) float32 or int8 with a scale per row
 *            (project.h), norms (n), embeddings (vocab, hidden)
 *   cache    per layer (2, num_blocks, block_size, kv_heads, head_dim)
 *   cos/sin  the model's rotary tables, (n, head_dim); row r's at rope_rows[r]
 *   work     hub_fused_work_floats(...) floats of scratch
 *   logits   (samples, vocab)
 */
#include <stdint.h>
#include <stdlib.h>

#include "attend.h"
#include "check.h"
#include "project.h"

#ifdef _OPENMP
#include <omp.h>
#endif

struct hub_layer {
    const float *input_norm, *post_norm;            /* (hidden) */
    struct hub_weight q, k, v, o;                   /* (heads*D, hidden) .. (hidden, heads*D) */
    const float *q_norm, *k_norm;                   /* (head_dim) per-head norms, or NULL */
    struct hub_weight gate, up, down;               /* (inter, hidden), (hidden, inter) */
    float *cache;                                   /* (2, blocks, block_size, kv_heads, D) */
    int64_t window;                                 /* sliding window, or 0 */
    float scaling;                                  /* of the attention logits */
};

struct hub_model {
    int64_t hidden, heads, kv_heads, head_dim, inter, vocab, layers;
    int64_t num_blocks, block_size, max_context, threads;
    float eps, qk_eps;                              /* of the RMS norms */
    const float *embed, *final_norm;
    struct hub_weight lm_head;
    const struct hub_layer *layer;
    int64_t stream_weights; /* read the weights ahead non-temporally (tiles.h) */
};

struct hub_step {
    int64_t rows;                                   /* tokens in the step */
    const int64_t *tokens, *slots;                  /* (rows) */
    const int64_t *tables, *table_starts, *lens;    /* block ids; (rows) each */
    const float *cos, *sin;                         /* (rope_len, head_dim) */
    const int64_t *rope_rows;                       /* (rows): each row's of cos/sin */
    int64_t samples;                                /* rows whose logits are wanted */
    const int64_t *sample_rows;                     /* (samples) */
    float *logits;                                  /* (samples, vocab) */
    float *work;                                    /* (work_floats) */
    int64_t table_len;                              /* block ids in `tables` */
    int64_t rope_len;                               /* rows of cos and sin */
    int64_t work_floats;
};

int hub_fused_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* out = x / rms(x) * w over n features; eps inside the root. */
static void rms_norm(const float *x, float *out, int64_t n, const float *w, float eps) {
    v8 acc = {0};
    int64_t i = 0;
    float tail = 0.0f;
    for (; i + 8 <= n; i += 8) {
        const v8 v = load8(x + i);
        acc += v * v;
    }
    for (; i < n; i++) tail += x[i] * x[i];
    const float r = 1.0f / sqrtf((hsum8(acc) + tail) / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* x (head_dim) rotated in place by the halves convention of transformers' rotate_half:
 * out[i] = x[i] cos[i] - x[i + D/2] sin[i], out[i + D/2] = x[i + D/2] cos[i + D/2] + x[i]
 * sin[i + D/2]. */
static void rotate(float *x, const float *cos, const float *sin, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* Columns (weight rows) per task of a parallel projection: whole tiles, enough to amortise
 * a task (four panel tiles), and, for row tiles, one tile, so that a few rows' stream of
 * the weights splits evenly between threads (the stages meet at a barrier after each). */
static int64_t task_columns(const struct operand *a) {
    return a->panels ? 4 * PANEL_COLUMNS : ROW_COLUMNS;
}

static int64_t column_tasks(const struct operand *a, int64_t n) {
    return (n + task_columns(a) - 1) / task_columns(a);
}

/* Weight rows [*n0, *n1) of task t over n outputs. */
static void task_span(const struct operand *a, int64_t t, int64_t n, int64_t *n0, int64_t *n1) {
    *n0 = t * task_columns(a);
    *n1 = *n0 + task_columns(a) < n ? *n0 + task_columns(a) : n;
}

/* The stages below are shared out among the calling parallel region's threads (orphaned
 * `omp for`), each ending at the loop's barrier. */

/* y (rows of ldy) = (or +=, `add`) the projection of every row of `a` by w's n outputs. */
static void project_stage(const struct operand *a, const struct hub_weight *w, int64_t n,
                          float *y, int add) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t t = 0; t < column_tasks(a, n); t++) {
        int64_t n0, n1;
        task_span(a, t, n, &n0, &n1);
        project(a, w, n0, n1, y, n, add);
    }
}

/* h = RMS norm of each of x's rows (n floats) with weight w. */
static void norm_rows(const float *x, float *h, int64_t rows, int64_t n, const float *w,
                      float eps) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t r = 0; r < rows; r++) rms_norm(x + r * n, h + r * n, n, w, eps);
}

/* Task `task` of the q/k/v stage: one head of q, k or v for every row, then its per-head
 * norm and rotation (q, k), q's scaling, and the K/V cache writes. */
static void qkv_head(const struct hub_model *m, const struct hub_layer *l,
                     const struct hub_step *s, int64_t task, const struct operand *a, float *q,
                     float *k, float *v) {
    const int64_t hd = m->head_dim, rows = s->rows;
    const int64_t qd = m->heads * hd, kvd = m->kv_heads * hd;
    const struct hub_weight *w;
    const float *norm = NULL;
    float *out;
    int64_t ld, head;
    if (task < m->heads) {
        head = task, w = &l->q, out = q, ld = qd, norm = l->q_norm;
    } else if (task < m->heads + m->kv_heads) {
        head = task - m->heads, w = &l->k, out = k, ld = kvd, norm = l->k_norm;
    } else {
        head = task - m->heads - m->kv_heads, w = &l->v, out = v, ld = kvd;
    }
    const int64_t n0 = head * hd;
    project(a, w, n0, n0 + hd, out, ld, 0);
    const int is_q = out == q, is_v = out == v;
    float *keys = l->cache, *values = l->cache + m->num_blocks * m->block_size * kvd;
    for (int64_t r = 0; r < rows; r++) {
        float *x = out + r * ld + n0;
        if (!is_v) {
            if (norm) rms_norm(x, x, hd, norm, m->qk_eps);
            rotate(x, s->cos + s->rope_rows[r] * hd, s->sin + s->rope_rows[r] * hd, hd);
        }
        if (is_q) {
            for (int64_t i = 0; i < hd; i++) x[i] *= l->scaling;
        } else {
            float *cache = is_v ? values : keys;
            memcpy(cache + s->slots[r] * kvd + n0, x, sizeof(float) * (size_t)hd);
        }
    }
}

/* The step's activations, the team's panels and one thread's scratch, carved from `work`. */
struct buffers {
    float *x, *h, *q, *k, *v, *att, *act; /* (rows, ...) each */
    float *panels;                  /* the team's: the projection input, packed */
    float *scores, *weights, *blocks; /* this thread's */
};

/* Rows per thread from which attention takes a task per row. */
#define ROWS_PER_THREAD 4

static int team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

static int64_t widest_input(const struct hub_model *m) {
    int64_t widest = m->hidden > m->inter ? m->hidden : m->inter;
    return m->heads * m->head_dim > widest ? m->heads * m->head_dim : widest;
}

/* Floats of one thread's scratch: attention scores (over the longest context, or a chunk of
 * it), and a block of int8 weight rows widened and of outputs (two each). */
static int64_t thread_floats(const struct hub_model *m, int64_t rows) {
    const int64_t widest = widest_input(m);
    return attend_scratch(m->heads, m->max_context) + 2 * BLOCK_COLUMNS * (widest + rows);
}

/* The step's activations, then the packed panels of the widest projection input. */
static int64_t activation_floats(const struct hub_model *m, int64_t rows) {
    return rows * (2 * m->hidden + 2 * m->heads * m->head_dim + 2 * m->kv_heads * m->head_dim +
                   m->inter);
}

static int64_t shared_floats(const struct hub_model *m, int64_t rows) {
    return activation_floats(m, rows) + (rows + PANEL - 1) / PANEL * PANEL * widest_input(m);
}

static struct buffers carve(const struct hub_model *m, int64_t rows, float *work, int thread) {
    struct buffers b;
    b.x = work;
    b.h = b.x + rows * m->hidden;
    b.q = b.h + rows * m->hidden;
    b.k = b.q + rows * m->heads * m->head_dim;
    b.v = b.k + rows * m->kv_heads * m->head_dim;
    b.att = b.v + rows * m->kv_heads * m->head_dim;
    b.act = b.att + rows * m->heads * m->head_dim;
    b.panels = work + activation_floats(m, rows);
    b.scores = work + shared_floats(m, rows) + thread * thread_floats(m, rows);
    b.weights = b.scores + attend_scratch(m->heads, m->max_context);
    b.blocks = b.weights + 2 * BLOCK_COLUMNS * widest_input(m);
    return b;
}

/* Floats of scratch a step of up to `rows` rows needs. */
int64_t hub_fused_work_floats(const struct hub_model *m, int64_t rows) {
    return shared_floats(m, rows) + m->threads * thread_floats(m, rows);
}

static void layer_step(const struct hub_model *m, const struct hub_layer *l,
                       const struct hub_step *s, const struct buffers *b) {
    const int64_t rows = s->rows, hidden = m->hidden, hd = m->head_dim;
    const int64_t group = m->heads / m->kv_heads, qd = m->heads * hd;
    const struct layout lay = {
        .keys = l->cache,
        .values = l->cache + m->num_blocks * m->block_size * m->kv_heads * hd,
        .block_size = m->block_size,
        .kv_heads = m->kv_heads,
        .group = group,
        .head_dim = hd,
        .window = l->window,
        .softcap = 0.0f,
    };
    const int stream = (int)m->stream_weights;
    struct operand a;
    norm_rows(b->x, b->h, rows, hidden, l->input_norm, m->eps);
    a = operand(b->h, hidden, rows, hidden, &l->q, b->panels, b->weights, b->blocks, stream);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t t = 0; t < m->heads + 2 * m->kv_heads; t++)
        qkv_head(m, l, s, t, &a, b->q, b->k, b->v);
    /* Attention: a task per row (its keys read for all heads at once) when there are rows
     * enough to share out, else a task per row and KV head. */
    const int per_row = rows >= ROWS_PER_THREAD * team_size();
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t t = 0; t < (per_row ? rows : rows * m->kv_heads); t++) {
        const int64_t r = per_row ? t : t / m->kv_heads;
        const int64_t kv0 = per_row ? 0 : t % m->kv_heads;
        const int64_t kv1 = per_row ? m->kv_heads : kv0 + 1;
        const int64_t at = r * qd + kv0 * group * hd;
        attend_heads(&lay, b->q + at, s->tables + s->table_starts[r], s->lens[r], kv0, kv1,
                     b->scores, b->att + at);
    }
    a = operand(b->att, qd, rows, qd, &l->o, b->panels, b->weights, b->blocks, stream);
    project_stage(&a, &l->o, hidden, b->x, 1);
    norm_rows(b->x, b->h, rows, hidden, l->post_norm, m->eps);
    a = operand(b->h, hidden, rows, hidden, &l->gate, b->panels, b->weights, b->blocks, stream);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t t = 0; t < column_tasks(&a, m->inter); t++) {
        int64_t n0, n1;
        task_span(&a, t, m->inter, &n0, &n1);
        gated(&a, &l->gate, &l->up, n0, n1, b->act, m->inter);
    }
    a = operand(b->act, m->inter, rows, m->inter, &l->down, b->panels, b->weights, b->blocks,
                stream);
    project_stage(&a, &l->down, hidden, b->x, 1);
}

/* The model's sizes as the stages assume them: positive, whole heads per KV head, an even
 * head size (the rotation takes halves). */
static int check_model(const struct hub_model *m) {
    if (m->hidden < 1 || m->heads < 1 || m->kv_heads < 1 || m->heads % m->kv_heads != 0 ||
        m->head_dim < 2 || m->head_dim % 2 != 0 || m->inter < 1 || m->vocab < 1 ||
        m->layers < 0 || m->num_blocks < 1 || m->block_size < 1 || m->max_context < 1 ||
        m->threads < 1)
        return HUB_BAD_SHAPE;
    return HUB_OK;
}

/* Every index the step follows: each row's token, cache slot, rotary row and context (its
 * table's extent and block ids), each sample row, and the scratch the rows need. */
static int check_step(const struct hub_model *m, const struct hub_step *s) {
    const int64_t rows = s->rows, slots = m->num_blocks * m->block_size;
    if (rows < 0 || s->table_len < 0 || s->rope_len < 0) return HUB_BAD_SHAPE;
    /* The LM head's scratch holds `rows` rows. */
    if (s->samples < 0 || s->samples > rows) return HUB_BAD_SAMPLE;
    if (hub_fused_work_floats(m, rows) > s->work_floats) return HUB_BAD_SCRATCH;
    for (int64_t r = 0; r < rows; r++) {
        if (s->tokens[r] < 0 || s->tokens[r] >= m->vocab) return HUB_BAD_TOKEN;
        if (s->slots[r] < 0 || s->slots[r] >= slots) return HUB_BAD_SLOT;
        if (s->rope_rows[r] < 0 || s->rope_rows[r] >= s->rope_len) return HUB_BAD_POSITION;
        const int status = check_context(s->tables, s->table_len, s->table_starts[r],
                                         s->lens[r], m->max_context, m->num_blocks,
                                         m->block_size);
        if (status != HUB_OK) return status;
    }
    for (int64_t i = 0; i < s->samples; i++)
        if (s->sample_rows[i] < 0 || s->sample_rows[i] >= rows) return HUB_BAD_SAMPLE;
    return HUB_OK;
}

/* One step: logits of the sample rows. Returns HUB_OK, or (having done nothing) the
 * `check.h` status of the first size or index out of range. */
int hub_fused_step(const struct hub_model *m, const struct hub_step *s) {
    const int64_t rows = s->rows, hidden = m->hidden;
    int status = check_model(m);
    if (status == HUB_OK) status = check_step(m, s);
    if (status != HUB_OK) return status;
#ifdef _OPENMP
#pragma omp parallel num_threads(m->threads > 1 ? (int)m->threads : 1)
#endif
    {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        const struct buffers b = carve(m, rows, s->work, thread);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t r = 0; r < rows; r++)
            memcpy(b.x + r * hidden, m->embed + s->tokens[r] * hidden,
                   sizeof(float) * (size_t)hidden);
        for (int64_t i = 0; i < m->layers; i++) layer_step(m, &m->layer[i], s, &b);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t i = 0; i < s->samples; i++)
            rms_norm(b.x + s->sample_rows[i] * hidden, b.h + i * hidden, hidden, m->final_norm,
                     m->eps);
        const struct operand a =
            operand(b.h, hidden, s->samples, hidden, &m->lm_head, b.panels, b.weights, b.blocks,
                    (int)m->stream_weights);
        project_stage(&a, &m->lm_head, m->vocab, s->logits, 0);
    }
    return HUB_OK;
}
