/*
 * What every entry point returns, and the checks of the indices the kernels follow.
 *
 * The kernels read the KV cache through block tables, and write it through cache slots:
 * an index out of range would read or write memory the caller does not own. So each entry
 * point checks every index it will follow before it starts, and returns a status instead
 * of running; the Python wrappers turn a status into an exception naming the problem.
 * Python checks the same things first (with its own messages); these checks hold whoever
 * calls the library.
 */
#ifndef HUB_CHECK_H
#define HUB_CHECK_H

#include <stdint.h>

/* Kept in step with `backends.llm.native_build.STATUS_MESSAGES`. */
enum hub_status {
    HUB_OK = 0,
    HUB_NO_MEMORY = 1,    /* scratch memory could not be allocated */
    HUB_BAD_SHAPE = 2,    /* a size out of range */
    HUB_BAD_ROWS = 3,     /* the rows asked for are not rows of the batch */
    HUB_BAD_LENGTH = 4,   /* a context length < 1, or past what the scratch was sized for */
    HUB_BAD_TABLE = 5,    /* a row's blocks reach outside the block table */
    HUB_BAD_BLOCK = 6,    /* a block id outside the cache */
    HUB_BAD_TOKEN = 7,    /* a token id outside the vocabulary */
    HUB_BAD_SLOT = 8,     /* a cache slot outside the cache */
    HUB_BAD_POSITION = 9, /* a row's rotary table row outside the tables */
    HUB_BAD_SAMPLE = 10,  /* a sample row that is not a row of the step */
    HUB_BAD_SCRATCH = 11, /* the step needs more scratch than it was given */
};

/* One row's context: a length in [1, max_len], whose blocks tables[start, start + blocks)
 * (blocks = ceil(len / block_size)) lie within the table's `table_len` entries, each a
 * block id in [0, num_blocks). */
static inline int check_context(const int64_t *tables, int64_t table_len, int64_t start,
                                int64_t len, int64_t max_len, int64_t num_blocks,
                                int64_t block_size) {
    if (len < 1 || len > max_len) return HUB_BAD_LENGTH;
    const int64_t blocks = (len - 1) / block_size + 1;
    if (start < 0 || start > table_len || blocks > table_len - start) return HUB_BAD_TABLE;
    for (int64_t i = start; i < start + blocks; i++)
        if (tables[i] < 0 || tables[i] >= num_blocks) return HUB_BAD_BLOCK;
    return HUB_OK;
}

#endif
