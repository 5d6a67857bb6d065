/*
 * Decode attention over a paged KV cache on the CPU, float32: each single-token sequence
 * attends over exactly its own context, read in place from the cache blocks (no gathered
 * copy of its keys and values, which costs more than the attention itself).
 *
 * Layouts (all contiguous):
 *   q      (batch, kv_heads, group, head_dim)  queries, already scaled
 *   cache  (2, num_blocks, block_size, kv_heads, head_dim)  keys, then values
 *   tables block ids of every sequence, concatenated (table_len of them); sequence r's
 *          start at table_starts[r]
 *   lens   context length of every sequence (its own token included)
 *   out    (batch, kv_heads, group, head_dim)
 *
 * Rows row_start, row_start + row_step, ... are computed, each key/value head of a row as
 * its own task (`attend.h`), so even one row keeps several threads busy. Built with OpenMP
 * (against the runtime torch has loaded), `threads` threads share the tasks; built without,
 * callers split the batch over threads of their own. window > 0 limits each query to its
 * last `window` keys; softcap > 0 caps the logits as softcap * tanh(logit / softcap) before
 * the softmax. Returns HUB_OK, HUB_NO_MEMORY when scratch memory could not be allocated,
 * or (having done nothing) the `check.h` status of the first size, row range, context
 * length, table extent or block id out of range.
 */
#include <stdint.h>
#include <stdlib.h>

#include "attend.h"
#include "check.h"

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
    int64_t table_len, const int64_t *table_starts, const int64_t *lens, int64_t batch,
    int64_t row_start, int64_t row_step, int64_t window, float softcap, int threads,
    float *out) {
    if (num_blocks < 0 || block_size < 1 || kv_heads < 1 || group < 1 || head_dim < 1 ||
        table_len < 0)
        return HUB_BAD_SHAPE;
    if (batch < 0 || row_start < 0 || row_step < 1) return HUB_BAD_ROWS;
    const int64_t heads = kv_heads * group;
    int64_t longest = 1;
    for (int64_t r = row_start; r < batch; r += row_step) {
        const int status = check_context(tables, table_len, table_starts[r], lens[r],
                                         INT64_MAX, num_blocks, block_size);
        if (status != HUB_OK) return status;
        if (lens[r] > longest) longest = lens[r];
    }
    if (window > 0 && longest > window) longest = window;
    const struct layout lay = {
        .keys = cache,
        .values = cache + num_blocks * block_size * kv_heads * head_dim,
        .block_size = block_size,
        .kv_heads = kv_heads,
        .group = group,
        .head_dim = head_dim,
        .window = window,
        .softcap = softcap,
    };
    const int64_t rows = row_start < batch ? (batch - row_start + row_step - 1) / row_step : 0;
    const int64_t tasks = rows * kv_heads;
    int failed = 0;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads > 1 && tasks > 1 ? threads : 1) reduction(| : failed)
#endif
    {
        float *scores = malloc(sizeof(float) * (size_t)attend_scratch(group, longest));
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t i = 0; i < tasks; i++) {
            const int64_t r = row_start + (i / kv_heads) * row_step, kv = i % kv_heads;
            if (!scores) {
                failed = 1;
                continue;
            }
            const int64_t at = (r * heads + kv * group) * head_dim;
            attend_heads(&lay, q + at, tables + table_starts[r], lens[r], kv, kv + 1, scores,
                         out + at);
        }
        free(scores);
    }
    return failed ? HUB_NO_MEMORY : HUB_OK;
}
