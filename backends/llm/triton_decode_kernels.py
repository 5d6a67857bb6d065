"""The Triton kernels of backends/llm/triton_decode.py: decode attention over a paged KV
cache, in one pass per row or in splits of the context merged by a second kernel.

The kernels are defined at module level (Triton finds a jitted function a kernel calls among
the module's globals), and only where Triton loads: `AVAILABLE` says whether they are.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except Exception:  # not installed, or an install that cannot load here
    AVAILABLE = False
else:
    AVAILABLE = True

if AVAILABLE:
    # Shared by the kernels below (Triton inlines a jitted function where it is called; it
    # finds them among the module's globals, hence this module).
    @triton.jit  # type: ignore[misc,unused-ignore]
    def _row_query(  # type: ignore[no-untyped-def]
        q_ptr, lens_ptr, row, kv_head, scale, window, stride_q_token, stride_q_head,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_P: tl.constexpr, HAS_WINDOW: tl.constexpr,
    ):  # fmt: skip
        """The row's query heads of this KV head, scaled, (GROUP_P, HEAD_DIM_P) float32, and
        the context positions it attends to: [start, length)."""
        length = tl.load(lens_ptr + row).to(tl.int32)
        start = length * 0
        if HAS_WINDOW:
            start = tl.maximum(length - window, 0)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_DIM_P)
        q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        heads = kv_head * GROUP + g
        q_offsets = row * stride_q_token + heads[:, None] * stride_q_head + d[None, :]
        # Float arguments may arrive as float64 (Inductor passes Python floats so): the
        # products are cast back so that the loop's carried values stay float32.
        q = (tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32) * scale).to(
            tl.float32
        )
        return q, start, length

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _attend_tile(  # type: ignore[no-untyped-def]
        q, m_i, l_i, acc, pos, ok, k_ptr, v_ptr, tables_ptr, row, kv_head, softcap,
        stride_table, stride_k_block, stride_k_slot, stride_k_head,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
    ):  # fmt: skip
        """The running softmax (max, sum, weighted values) after the keys at context
        positions `pos` where `ok` (the rest masked out)."""
        d = tl.arange(0, HEAD_DIM_P)
        block = tl.load(tables_ptr + row * stride_table + pos // BLOCK_SIZE, mask=ok, other=0)
        base = (
            block.to(tl.int64) * stride_k_block
            + (pos % BLOCK_SIZE) * stride_k_slot
            + kv_head * stride_k_head
        )
        kv_mask = ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # (G, TILE)
        if HAS_SOFTCAP:
            s = (softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)).to(tl.float32)  # tanh
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A tile with no key yet (all -inf) must not make exp(-inf - -inf) = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)  # (G, D)
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _merge_split(  # type: ignore[no-untyped-def]
        top, total, o, max_ptr, sum_ptr, acc_ptr, base, sp, splits,
        GROUP_P: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    ):  # fmt: skip
        """The merged softmax (max, sum, weighted values) after split `sp` (none past
        `splits`: masked, an empty split's -inf and zeros)."""
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_DIM_P)
        valid = (g * 0 + sp) < splits
        at = (base + sp) * GROUP_P + g
        m = tl.load(max_ptr + at, mask=valid, other=float("-inf"))
        top_new = tl.maximum(top, m)
        safe = tl.where(top_new == float("-inf"), 0.0, top_new)
        keep = tl.exp(top - safe)
        add = tl.exp(m - safe)
        total = total * keep + tl.load(sum_ptr + at, mask=valid, other=0.0) * add
        part = tl.load(
            acc_ptr + at[:, None] * HEAD_DIM_P + d[None, :], mask=valid[:, None], other=0.0
        )
        return top_new, total, o * keep[:, None] + part * add[:, None]

    # Block tables and lengths change with every eager step (their width, their offset in
    # the step's packed tensor): specializing on them would compile a variant mid-serving.
    @triton.jit(do_not_specialize=["tables_ptr", "lens_ptr", "stride_table"])  # type: ignore[misc,unused-ignore]
    def paged_decode_kernel(  # type: ignore[no-untyped-def]
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        lens_ptr,
        out_ptr,
        scale,
        softcap,
        window,
        stride_q_token,
        stride_q_head,
        stride_o_token,
        stride_o_head,
        stride_table,
        stride_k_block,
        stride_k_slot,
        stride_k_head,
        BLOCK_SIZE: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_P: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_P: tl.constexpr,
        TILE: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        q, start, length = _row_query(
            q_ptr, lens_ptr, row, kv_head, scale, window, stride_q_token, stride_q_head,
            GROUP, GROUP_P, HEAD_DIM, HEAD_DIM_P, HAS_WINDOW,
        )  # fmt: skip
        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
        t = tl.arange(0, TILE)
        for tile_start in range(start, length, TILE):
            pos = tile_start + t
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, pos, pos < length, k_ptr, v_ptr, tables_ptr, row, kv_head,
                softcap, stride_table, stride_k_block, stride_k_slot, stride_k_head,
                BLOCK_SIZE, HEAD_DIM, HEAD_DIM_P, HAS_SOFTCAP,
            )  # fmt: skip
        o = acc / l_i[:, None]
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_DIM_P)
        heads = kv_head * GROUP + g
        o_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        o_offsets = row * stride_o_token + heads[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptr + o_offsets, o.to(out_ptr.dtype.element_ty), mask=o_mask)

    @triton.jit(do_not_specialize=["tables_ptr", "lens_ptr", "stride_table"])  # type: ignore[misc,unused-ignore]
    def paged_decode_split_kernel(  # type: ignore[no-untyped-def]
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, max_ptr, sum_ptr, acc_ptr,
        scale, softcap, window,
        stride_q_token, stride_q_head, stride_table, stride_k_block, stride_k_slot,
        stride_k_head,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, TILE: tl.constexpr,
        SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        splits = tl.num_programs(2)
        q, start, length = _row_query(
            q_ptr, lens_ptr, row, kv_head, scale, window, stride_q_token, stride_q_head,
            GROUP, GROUP_P, HEAD_DIM, HEAD_DIM_P, HAS_WINDOW,
        )  # fmt: skip
        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
        t = tl.arange(0, TILE)
        first = split * SPLIT
        # A fixed number of tiles, masked past the row's context (constant bounds: one
        # compiled variant); a split wholly past it skips them.
        if first < length:
            for i in range(SPLIT // TILE):
                pos = first + i * TILE + t
                m_i, l_i, acc = _attend_tile(
                    q, m_i, l_i, acc, pos, (pos < length) & (pos >= start), k_ptr, v_ptr,
                    tables_ptr, row, kv_head, softcap, stride_table, stride_k_block,
                    stride_k_slot, stride_k_head, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_P, HAS_SOFTCAP,
                )  # fmt: skip
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_DIM_P)
        at = (row * tl.num_programs(1) + kv_head) * splits + split
        tl.store(max_ptr + at * GROUP_P + g, m_i)
        tl.store(sum_ptr + at * GROUP_P + g, l_i)
        tl.store(acc_ptr + (at * GROUP_P + g[:, None]) * HEAD_DIM_P + d[None, :], acc)

    # `splits` follows the step's table width in eager steps: one variant for any count.
    @triton.jit(do_not_specialize=["splits"])  # type: ignore[misc,unused-ignore]
    def paged_decode_merge_kernel(  # type: ignore[no-untyped-def]
        max_ptr, sum_ptr, acc_ptr, out_ptr, stride_o_token, stride_o_head, splits,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_P: tl.constexpr, MAX_SPLITS: tl.constexpr, RUNTIME_BOUND: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, HEAD_DIM_P)
        base = (row * tl.num_programs(1) + kv_head) * splits
        top = tl.full([GROUP_P], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_P], tl.float32)
        o = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
        # The splits' partial softmaxes, merged in order (an empty split: -inf and zeros).
        # Compiled, the loop runs `splits` times. Triton's interpreter (the CPU tests) takes
        # only constant loop bounds, so there it runs MAX_SPLITS times, the rest masked: one
        # step in two loops, as a loop bound cannot be chosen in a variable there.
        if RUNTIME_BOUND:
            for sp in range(0, splits):
                top, total, o = _merge_split(
                    top, total, o, max_ptr, sum_ptr, acc_ptr, base, sp, splits, GROUP_P,
                    HEAD_DIM_P,
                )  # fmt: skip
        else:
            for sp in range(0, MAX_SPLITS):
                top, total, o = _merge_split(
                    top, total, o, max_ptr, sum_ptr, acc_ptr, base, sp, splits, GROUP_P,
                    HEAD_DIM_P,
                )  # fmt: skip
        o = o / total[:, None]
        heads = kv_head * GROUP + g
        o_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        o_offsets = row * stride_o_token + heads[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptr + o_offsets, o.to(out_ptr.dtype.element_ty), mask=o_mask)
