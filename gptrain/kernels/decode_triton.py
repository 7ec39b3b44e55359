"""The Triton kernels of the one-token decode step (``kernels/decode.py`` launches them, and holds
their PyTorch references and the why). Imported only where Triton runs them (a CUDA device), so a
machine without Triton never loads it."""
import triton
import triton.language as tl


@triton.jit
def prefetch_tile(w_ptr, N, K, n0, k0, span, BLOCK_N: tl.constexpr):
    """Asks the L2 cache for rows n0 .. n0 + BLOCK_N - 1, columns k0 .. k0 + span - 1 of the (N x K)
    weight ``w_ptr``: a bulk prefetch a row, issued and not waited for (the weights do not depend
    on the stages before, so they can be on their way while those run)."""
    rows = n0 + tl.arange(0, BLOCK_N)
    nbytes = span * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    size = tl.where(rows < N, nbytes, 0).to(tl.int32)
    at = (w_ptr + rows.to(tl.int64) * K + k0).to(tl.pointer_type(tl.int8))
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [at, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def linear_tile(x_ptr, ln_w_ptr, ln_b_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, part_ptr, lock_ptr, M, N, K,
                stride_out, eps, pid_n, pid_m, pid_k, tile, HAS_LN: tl.constexpr, HAS_BIAS: tl.constexpr,
                GELU: tl.constexpr, RESIDUAL: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, CG: tl.constexpr):
    """One (BLOCK_M x BLOCK_N) tile of ``residual + gelu(ln(x) @ w.T + bias)``, or with ``SPLIT``
    its ``pid_k``-th share of the input dimension (``tile`` numbers the counter and shares).
    ``CG``: activations read past L1 (another program of this launch may have written them)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    mean = tl.zeros([BLOCK_M], tl.float32)
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if HAS_LN:  # the row's mean and 1/std, two passes in fp32 (x is small: L2 serves it)
        total = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            if CG:
                x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0,
                            cache_modifier=".cg")
            else:
                x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
            total += tl.sum(x.to(tl.float32), axis=1)
        mean = total / K
        total = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            ok = row_ok[:, None] & (ks < K)[None, :]
            if CG:
                x = tl.load(x_rows + ks[None, :], mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            else:
                x = tl.load(x_rows + ks[None, :], mask=ok, other=0.0).to(tl.float32)
            d = tl.where(ok, x - mean[:, None], 0.0)
            total += tl.sum(d * d, axis=1)
        rstd = 1.0 / tl.sqrt(total / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    span = K // SPLIT  # this program's share of the input dimension (a multiple of BLOCK_K)
    for k0 in range(pid_k * span, pid_k * span + span, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        if CG:
            a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                        cache_modifier=".cg")
        else:
            a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_LN:
            g = tl.load(ln_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            b = tl.load(ln_b_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = (a.to(tl.float32) - mean[:, None]) * rstd[:, None] * g[None, :] + b[None, :]
            a = tl.where(row_ok[:, None], a, 0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        a = a.to(w.dtype)
        if IEEE:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    last = True
    if SPLIT > 1:  # the last program of a tile to finish adds the shares in their fixed order
        inside = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        parts = part_ptr + tile.to(tl.int64) * (SPLIT * BLOCK_M * BLOCK_N) + inside
        tl.store(parts + pid_k * (BLOCK_M * BLOCK_N), acc, cache_modifier=".cg")
        tl.debug_barrier()
        last = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") == SPLIT - 1
        if last:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for part in range(SPLIT):
                acc += tl.load(parts + part * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
            tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GELU:  # tanh GELU, tanh(u) written as 1 - 2 / (1 + e^(2u)) (finite at both ends)
            u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            acc = 0.5 * acc * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * u)))
        ok = row_ok[:, None] & col_ok[None, :]
        if RESIDUAL:  # the residual's rounding as eager's: the product in the model's dtype first
            acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            res_at = res_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
            if CG:
                acc += tl.load(res_at, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            else:
                acc += tl.load(res_at, mask=ok, other=0.0).to(tl.float32)
        out_at = rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), mask=ok)

@triton.jit
def ln_linear_kernel(x_ptr, ln_w_ptr, ln_b_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, part_ptr, lock_ptr, M, N, K,
                     stride_out, eps, HAS_LN: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                     RESIDUAL: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    linear_tile(x_ptr, ln_w_ptr, ln_b_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, part_ptr, lock_ptr, M, N, K,
                stride_out, eps, pid_n, pid_m, pid_k, pid_m * tl.num_programs(0) + pid_n, HAS_LN, HAS_BIAS, GELU,
                RESIDUAL, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, False)

@triton.jit
def attention_task(qkv_ptr, kv_ptr, pos_ptr, out_ptr, row, head, heads, window, batch, scale,
                   DIM: tl.constexpr, BLOCK_T: tl.constexpr, CG: tl.constexpr):
    """One row and head: its new key and value into the cache, then attention over its positions."""
    pos = tl.load(pos_ptr + row)
    d = tl.arange(0, DIM)
    src = qkv_ptr + row.to(tl.int64) * (3 * heads * DIM) + head * (3 * DIM)
    if CG:
        q = tl.load(src + d, cache_modifier=".cg").to(tl.float32)
        k_new = tl.load(src + DIM + d, cache_modifier=".cg")
        v_new = tl.load(src + 2 * DIM + d, cache_modifier=".cg")
    else:
        q = tl.load(src + d).to(tl.float32)
        k_new = tl.load(src + DIM + d)
        v_new = tl.load(src + 2 * DIM + d)
    # kv: (2, batch, heads, window, DIM); this row and head's keys, then its values
    keys = kv_ptr + ((row.to(tl.int64) * heads + head) * window) * DIM
    values = keys + batch * heads * window * DIM
    tl.store(keys + pos * DIM + d, k_new)
    tl.store(values + pos * DIM + d, v_new)
    # online softmax: the new token first (from registers), then positions 0 .. pos-1 in order
    m = tl.sum(q * k_new.to(tl.float32), axis=0) * scale
    s = m * 0.0 + 1.0
    acc = v_new.to(tl.float32)
    for t0 in range(0, pos, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        ok = ts < pos
        k = tl.load(keys + ts[:, None] * DIM + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        scores = tl.where(ok, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m - m_new)
        v = tl.load(values + ts[:, None] * DIM + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s = s * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    dst = out_ptr + row.to(tl.int64) * (heads * DIM) + head * DIM
    tl.store(dst + d, (acc / s).to(out_ptr.dtype.element_ty))

@triton.jit
def attention_kernel(qkv_ptr, kv_ptr, pos_ptr, out_ptr, heads, window, batch, scale,
                     DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    attention_task(qkv_ptr, kv_ptr, pos_ptr, out_ptr, tl.program_id(0), tl.program_id(1), heads, window, batch,
                   scale, DIM, BLOCK_T, False)

@triton.jit
def grid_barrier(count_ptr, flag_ptr, programs):
    """Every program of the (co-resident) grid waits here for all the others. The last to arrive
    resets the count and advances the flag's generation, which the others spin on; a program's
    writes before the barrier are seen by every program after it (release, then acquire)."""
    tl.debug_barrier()
    generation = tl.atomic_add(flag_ptr, 0, sem="acquire")
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == programs - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")
        tl.atomic_add(flag_ptr, 1, sem="release")
    else:
        while tl.atomic_add(flag_ptr, 0, sem="acquire") == generation:
            pass
    tl.debug_barrier()

@triton.jit
def block_kernel(x_ptr, qkv_ptr, y_ptr, h_ptr, kv_ptr, pos_ptr, ln1_w, ln1_b, w_qkv, b_qkv, w_proj, b_proj,
                 ln2_w, ln2_b, w_fc1, b_fc1, w_fc2, b_fc2, part_ptr, lock_ptr, bar_ptr, M, heads, window, batch,
                 scale, eps1, eps2, HIDDEN: tl.constexpr, FFN: tl.constexpr, DIM: tl.constexpr,
                 IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BN_QKV: tl.constexpr,
                 BN_PROJ: tl.constexpr, BN_FC1: tl.constexpr, BN_FC2: tl.constexpr, SPLIT_FC2: tl.constexpr,
                 PREFETCH: tl.constexpr, WORK: tl.constexpr):
    """A whole transformer block in one launch: persistent programs (one per multiprocessor, all
    resident) take the tiles of each stage in turn, with a grid barrier between stages instead of a
    kernel boundary. Each tile is computed exactly as by the stage's own kernel."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    row_tiles = tl.cdiv(M, BLOCK_M)
    n_qkv, n_proj = tl.cdiv(3 * HIDDEN, BN_QKV), tl.cdiv(HIDDEN, BN_PROJ)
    n_fc1, n_fc2 = tl.cdiv(FFN, BN_FC1), tl.cdiv(HIDDEN, BN_FC2)
    if PREFETCH:  # every stage's weight tiles of this program, on their way to L2 from the start
        for t in range(pid, row_tiles * n_qkv, programs):
            prefetch_tile(w_qkv, 3 * HIDDEN, HIDDEN, (t % n_qkv) * BN_QKV, 0, HIDDEN, BN_QKV)
        for t in range(pid, row_tiles * n_proj, programs):
            prefetch_tile(w_proj, HIDDEN, HIDDEN, (t % n_proj) * BN_PROJ, 0, HIDDEN, BN_PROJ)
        for t in range(pid, row_tiles * n_fc1, programs):
            prefetch_tile(w_fc1, FFN, HIDDEN, (t % n_fc1) * BN_FC1, 0, HIDDEN, BN_FC1)
        for t in range(pid, row_tiles * n_fc2 * SPLIT_FC2, programs):
            prefetch_tile(w_fc2, HIDDEN, FFN, (t // SPLIT_FC2 % n_fc2) * BN_FC2, (t % SPLIT_FC2) * (FFN // SPLIT_FC2),
                          FFN // SPLIT_FC2, BN_FC2)
    if WORK & 1:
        for t in range(pid, row_tiles * n_qkv, programs):  # LayerNorm + QKV
            linear_tile(x_ptr, ln1_w, ln1_b, w_qkv, b_qkv, x_ptr, qkv_ptr, part_ptr, lock_ptr, M, 3 * HIDDEN, HIDDEN,
                        3 * HIDDEN, eps1, t % n_qkv, t // n_qkv, 0, 0, True, True, False, False, IEEE, BLOCK_M,
                        BN_QKV, BLOCK_K, 1, True)
    grid_barrier(bar_ptr, bar_ptr + 1, programs)
    if WORK & 2:
        for t in range(pid, M * heads, programs):  # attention, a row and head a task
            attention_task(qkv_ptr, kv_ptr, pos_ptr, y_ptr, t // heads, t % heads, heads, window, batch, scale, DIM,
                           64, True)
    grid_barrier(bar_ptr, bar_ptr + 1, programs)
    if WORK & 4:
        for t in range(pid, row_tiles * n_proj, programs):  # output projection + residual, into x
            linear_tile(y_ptr, y_ptr, y_ptr, w_proj, b_proj, x_ptr, x_ptr, part_ptr, lock_ptr, M, HIDDEN, HIDDEN,
                        HIDDEN, 0.0, t % n_proj, t // n_proj, 0, 0, False, True, False, True, IEEE, BLOCK_M,
                        BN_PROJ, BLOCK_K, 1, True)
    grid_barrier(bar_ptr, bar_ptr + 1, programs)
    if WORK & 8:
        for t in range(pid, row_tiles * n_fc1, programs):  # LayerNorm + FC1 + GELU
            linear_tile(x_ptr, ln2_w, ln2_b, w_fc1, b_fc1, x_ptr, h_ptr, part_ptr, lock_ptr, M, FFN, HIDDEN, FFN,
                        eps2, t % n_fc1, t // n_fc1, 0, 0, True, True, True, False, IEEE, BLOCK_M, BN_FC1,
                        BLOCK_K, 1, True)
    grid_barrier(bar_ptr, bar_ptr + 1, programs)
    if WORK & 16:
        for t in range(pid, row_tiles * n_fc2 * SPLIT_FC2, programs):  # FC2 + residual, into x
            tile = t // SPLIT_FC2
            linear_tile(h_ptr, h_ptr, h_ptr, w_fc2, b_fc2, x_ptr, x_ptr, part_ptr, lock_ptr, M, HIDDEN, FFN, HIDDEN,
                        0.0, tile % n_fc2, tile // n_fc2, t % SPLIT_FC2, tile, False, True, False, True, IEEE,
                        BLOCK_M, BN_FC2, BLOCK_K, SPLIT_FC2, True)
