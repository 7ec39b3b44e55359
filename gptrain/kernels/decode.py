"""The one-token decode step's kernels: a matrix-vector product with its LayerNorm before it and its
bias, GELU and residual add after it, in one kernel; and attention of one new token over a row's
cached keys, with the new key and value written into the cache by the same kernel.

A 345M step at batch 1 reads 0.7 GB of weights, about 0.2 ms at an H100's memory speed, but as
PyTorch ops (or Inductor's fusions around cuBLAS) it is 300-odd kernels, and their launch gaps
cost more than the reads. Here a block is five kernels: LayerNorm + QKV; attention; output
projection + bias + residual; LayerNorm + FC1 + bias + GELU; FC2 + bias + residual. A LayerNorm
is folded into the product that follows it (its statistics accumulate beside the product; its
constants come from :mod:`gptrain.kernels.ln_fold`), so no kernel reads its input before the
weights start streaming. Around them (:mod:`gptrain.kernels.decode_io`): one kernel for a step's
input (token and position embeddings) and one for the greedy choice (a row's argmax).

Every kernel computes a row of the batch the same way whatever the other rows hold and however
many there are: fixed tiles (16 rows a program, masked), a fixed order of the reduction over the
input dimension, and attention that walks the row's own cached positions in a fixed order up to
its own length. So a request's numbers do not depend on the batch it decodes in (batch
invariance): a seeded request gives the same text alone or under load. Tile sizes depend only on
the weight's shape, never on the batch.

For one stream with no batch to match (``gptrain generate``) the block products can run on the
CUDA cores instead (``ln_linear(gemv=True)``): each program loads its whole weight tile at once, with
no staging through shared memory, which is faster at one row and slow for many; its last bits differ
from the tensor-core kernel's, so a decoder uses one kind for every step.

Elsewhere than CUDA (and as the reference the kernels are checked against) the same math runs as
PyTorch ops.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from gptrain.kernels.ln_fold import ln_constants

ROWS = 16  # batch rows a program computes (tensor-core tiles need 16); fewer are masked
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gelu_tanh(acc):  # tanh GELU, tanh(u) written as 1 - 2 / (1 + e^(2u)) (finite at both ends)
        u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        return 0.5 * acc * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * u)))

    @triton.jit
    def ln_linear_kernel(x_ptr, ln_w_ptr, consts_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, part_ptr, lock_ptr,
                         M, N, K, stride_out, eps, HAS_LN: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                         RESIDUAL: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
        pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if HAS_LN:
            # the LayerNorm folded into the product, so the weights stream from the first instruction
            # (no pass over x before them): with x shifted by its first element x0 (for precision),
            # ln(x) @ w.T = rstd * ((g * (x - x0)) @ w.T - (mean - x0) * (g @ w.T)) + b @ w.T; the
            # sums of x - x0 and of its squares accumulate beside the product, g @ w.T and b @ w.T
            # are given (``consts_ptr``, ln_constants)
            shift = tl.load(x_rows, mask=row_ok[:, None], other=0.0).to(tl.float32)  # (BLOCK_M, 1)
            sums = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
            squares = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        span = K // SPLIT  # this program's share of the input dimension (a multiple of BLOCK_K)
        for k0 in range(pid_k * span, pid_k * span + span, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            ok = row_ok[:, None] & k_ok[None, :]
            a = tl.load(x_rows + ks[None, :], mask=ok, other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if HAS_LN:
                g = tl.load(ln_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
                d = tl.where(ok, a.to(tl.float32) - shift, 0.0)
                sums += d
                squares += d * d
                a = d * g[None, :]
            a = a.to(w.dtype)
            if IEEE:
                acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(w))
        if HAS_LN:
            mean = tl.sum(sums, axis=1) / K  # of x - x0
            rstd = 1.0 / tl.sqrt(tl.maximum(tl.sum(squares, axis=1) / K - mean * mean, 0.0) + eps)
            gw = tl.load(consts_ptr + cols, mask=col_ok, other=0.0)
            bw = tl.load(consts_ptr + N + cols, mask=col_ok, other=0.0)
            acc = (acc - mean[:, None] * gw[None, :]) * rstd[:, None] + bw[None, :]
        if SPLIT > 1:  # the last program of a tile to finish adds the shares in their fixed order
            tile = pid_m * tl.num_programs(0) + pid_n
            inside = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            parts = part_ptr + tile.to(tl.int64) * (SPLIT * BLOCK_M * BLOCK_N) + inside
            tl.store(parts + pid_k * (BLOCK_M * BLOCK_N), acc, cache_modifier=".cg")
            tl.debug_barrier()
            if tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") != SPLIT - 1:
                return
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for part in range(SPLIT):
                acc += tl.load(parts + part * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
            tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GELU:
            acc = gelu_tanh(acc)
        ok = row_ok[:, None] & col_ok[None, :]
        if RESIDUAL:  # the residual's rounding as eager's: the product in the model's dtype first
            acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc += tl.load(res_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        out_at = rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def gemv_kernel(x_ptr, ln_w_ptr, ln_b_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, M, N, stride_out, eps,
                    K: tl.constexpr, HAS_LN: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                    RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
        # the product on the CUDA cores, for one row (a single stream): a program's whole (BLOCK_N, K)
        # tile of the weight loaded at once (every byte asked for from the first instruction, no
        # staging through shared memory), the row's LayerNorm over its whole input, the products
        # summed over K, the epilogue; ROWS rows a program in turn (slow for many: one stream's kernel)
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, K)
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :], mask=col_ok[:, None], other=0.0)
        if HAS_LN:
            g = tl.load(ln_w_ptr + ks).to(tl.float32)
            beta = tl.load(ln_b_ptr + ks).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        first = pid_m * ROWS
        for m in range(first, tl.minimum(first + ROWS, M)):
            x = tl.load(x_ptr + m.to(tl.int64) * K + ks).to(tl.float32)
            if HAS_LN:  # as eager: statistics in fp32, the normalized row rounded to the model's dtype
                mean = tl.sum(x, axis=0) / K
                d = x - mean
                rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / K + eps)
                x = (d * rstd * g + beta).to(w.dtype).to(tl.float32)
            acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
            if HAS_BIAS:
                acc += bias
            if GELU:
                acc = gelu_tanh(acc)
            if RESIDUAL:  # the residual's rounding as eager's: the product in the model's dtype first
                acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
                acc += tl.load(res_ptr + m.to(tl.int64) * N + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + m.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)

    @triton.jit
    def attention_kernel(qkv_ptr, kv_ptr, pos_ptr, out_ptr, part_ptr, lock_ptr, heads, window, values_at, scale,
                         DIM: tl.constexpr, CHUNK: tl.constexpr, CHUNKS_P2: tl.constexpr):
        # a program per (row, head, CHUNK positions of the row's keys); the chunk that finishes last
        # merges the chunks' softmax shares in chunk order (so a row's numbers depend only on the row)
        row, head, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        pos = tl.load(pos_ptr + row)
        used = pos // CHUNK + 1  # chunks holding positions 0 .. pos (pos: the new token's)
        if chunk >= used:
            return
        d = tl.arange(0, DIM)
        src = qkv_ptr + row.to(tl.int64) * (3 * heads * DIM) + head * (3 * DIM)
        q = tl.load(src + d).to(tl.float32)
        # kv: (2, batch, heads, window, DIM); this row and head's keys, then its values
        keys = kv_ptr + ((row.to(tl.int64) * heads + head) * window) * DIM
        values = keys + values_at  # (an int64 when the cache's keys pass 2^31 elements)
        ts = chunk * CHUNK + tl.arange(0, CHUNK)
        ok = ts < pos  # cached positions; the new token comes from registers in the last chunk
        k = tl.load(keys + ts[:, None] * DIM + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(values + ts[:, None] * DIM + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        scores = tl.where(ok, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        last = chunk == used - 1
        if last:
            k_new = tl.load(src + DIM + d)
            v_new = tl.load(src + 2 * DIM + d)
            tl.store(keys + pos * DIM + d, k_new)
            tl.store(values + pos * DIM + d, v_new)
            new = tl.sum(q * k_new.to(tl.float32), axis=0) * scale
            m = tl.maximum(tl.max(scores, axis=0), new)
            p = tl.exp(scores - m)
            own = tl.exp(new - m)
            s = tl.sum(p, axis=0) + own
            acc = tl.sum(p[:, None] * v, axis=0) + own * v_new.to(tl.float32)
        else:
            m = tl.max(scores, axis=0)
            p = tl.exp(scores - m)
            s = tl.sum(p, axis=0)
            acc = tl.sum(p[:, None] * v, axis=0)
        dst = out_ptr + row.to(tl.int64) * (heads * DIM) + head * DIM
        if used == 1:
            tl.store(dst + d, (acc / s).to(out_ptr.dtype.element_ty))
            return
        pair = row.to(tl.int64) * heads + head
        shares = part_ptr + pair * (CHUNKS_P2 * 2 * DIM)  # per chunk: acc (DIM), then m, s
        tl.store(shares + chunk * (2 * DIM) + d, acc, cache_modifier=".cg")
        tl.store(shares + chunk * (2 * DIM) + DIM + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, m, s),
                 cache_modifier=".cg")
        tl.debug_barrier()
        if tl.atomic_add(lock_ptr + pair, 1, sem="acq_rel") != used - 1:
            return
        c = tl.arange(0, CHUNKS_P2)
        c_ok = c < used
        ms = tl.load(shares + c * (2 * DIM) + DIM, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
        ss = tl.load(shares + c * (2 * DIM) + DIM + 1, mask=c_ok, other=0.0, cache_modifier=".cg")
        accs = tl.load(shares + c[:, None] * (2 * DIM) + d[None, :], mask=c_ok[:, None], other=0.0,
                       cache_modifier=".cg")
        top = tl.max(ms, axis=0)
        scale_c = tl.where(c_ok, tl.exp(ms - top), 0.0)
        total = tl.sum(scale_c * ss, axis=0)
        merged = tl.sum(scale_c[:, None] * accs, axis=0)
        tl.store(dst + d, (merged / total).to(out_ptr.dtype.element_ty))
        tl.atomic_xchg(lock_ptr + pair, 0)  # ready for the next launch

    return ln_linear_kernel, attention_kernel, gemv_kernel


def define_kernels() -> None:
    """Imports Triton and defines this module's kernels now (``inference/early_init.py``: beside
    the checkpoint read); nothing is compiled."""
    _kernels()


@functools.cache
def tiles(n: int, k: int) -> dict:
    """Tile sizes and launch settings for a (n x k) weight (never the batch: see the docstring).
    ``SPLIT`` programs share a tile's input dimension when the tiles alone are too few to keep the
    GPU's memory system busy."""
    # benchmarks/decode_kernels.py's sweep on an H100 (RESULTS.md, session 12): 32-wide tiles for the
    # wide weights, 64 for a vocabulary, 16 for a square 1024, four shares of the input for a long one
    long = n <= 1024 and k >= 4096 and k % (4 * 128) == 0
    if long:
        return {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "SPLIT": 4}
    block_k = 256 if k % 256 == 0 else 128
    if n > 8192:
        return {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "SPLIT": 1}
    if n >= 2048:
        return {"BLOCK_N": 32, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 4, "SPLIT": 1}
    return {"BLOCK_N": 16, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 3, "SPLIT": 1}


TILES: dict[tuple[int, int], dict] = {}  # overrides by weight shape (benchmarks/decode_kernels.py's sweep)
GEMV_BLOCK_N: dict[int, int] = {}  # overrides by output size (benchmarks/decode_gemv.py)


def gemv_block_n(n: int) -> int:
    """Output columns a CUDA-core product's program takes: 16 for the wide products, 8 for 1024
    (the whole step measured best so on an H100: RESULTS.md, session 13)."""
    return GEMV_BLOCK_N.get(n) or (8 if n <= 1024 else 16)


def gemv_fits(weight: torch.Tensor) -> bool:
    """Whether ``gemv_kernel`` takes this weight: 16-bit, a power-of-two input of at most 4096 (the
    whole tile in registers), at most 8192 outputs (a block's products; not a vocabulary)."""
    n, k = weight.shape
    return weight.element_size() == 2 and k & (k - 1) == 0 and k <= 4096 and n <= 8192


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def ln_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              ln: torch.nn.LayerNorm | None = None, gelu: bool = False, residual: torch.Tensor | None = None,
              out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
              gemv: bool = False) -> torch.Tensor:
    """``residual + gelu(ln(x) @ weight.T + bias)`` for x (rows, k), each part optional; into
    ``out`` when given (it may be ``residual``). ``gemv``: on the CUDA cores (``gemv_kernel``, where
    the weight fits it): faster for one row, slow for many, and its numbers differ from the
    tensor-core kernel's in the last bits, so a decoder uses one or the other for every step."""
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    if not use_triton(x):
        return out.copy_(reference_ln_linear(x, weight, bias, ln, gelu, residual))
    assert x.is_contiguous() and weight.stride() == (k, 1) and out.stride(1) == 1 and out.shape == (m, n)
    assert residual is None or residual.is_contiguous()
    if gemv and gemv_fits(weight):
        block_n = gemv_block_n(n)
        _kernels()[2][(triton_cdiv(n, block_n), triton_cdiv(m, 16))](
            x, ln.weight if ln is not None else x, ln.bias if ln is not None else x, weight,
            bias if bias is not None else x, residual if residual is not None else out, out, m, n, out.stride(0),
            ln.eps if ln is not None else 0.0, K=k, HAS_LN=ln is not None, HAS_BIAS=bias is not None, GELU=gelu,
            RESIDUAL=residual is not None, BLOCK_N=block_n, ROWS=16, num_warps=8)
        return out
    kernel = _kernels()[0]
    settings = {"SPLIT": 1, **(TILES.get((n, k)) or tiles(n, k))}
    if x.dtype == torch.float32:  # fp32 tiles take twice the shared memory
        settings.update(BLOCK_K=min(settings["BLOCK_K"], 64), num_stages=2)
    if ln is not None:
        settings["SPLIT"] = 1  # a LayerNorm's statistics need the whole row in one program
    split = settings["SPLIT"]
    if split > 1 and k % (split * settings["BLOCK_K"]):
        raise ValueError(f"{k} inputs do not split into {split} shares of {settings['BLOCK_K']}-wide steps")
    grid = (triton_cdiv(n, settings["BLOCK_N"]), triton_cdiv(m, ROWS), split)
    parts, locks = (x, x) if split == 1 else split_buffers(x.device, grid[0] * grid[1],
                                                             split * ROWS * settings["BLOCK_N"])
    consts = ln_constants(weight, ln) if ln is not None else x
    kernel[grid](x, ln.weight if ln is not None else x, consts, weight,
                 bias if bias is not None else x, residual if residual is not None else out, out, parts, locks,
                 m, n, k, out.stride(0), ln.eps if ln is not None else 0.0, HAS_LN=ln is not None,
                 HAS_BIAS=bias is not None, GELU=gelu, RESIDUAL=residual is not None, IEEE=x.dtype == torch.float32,
                 BLOCK_M=ROWS, **settings)
    return out


_buffers: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def split_buffers(device: torch.device, tiles: int, tile_floats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split programs' fp32 shares and per-tile counters (zero between launches: the last
    program resets its counter). The newest set per device serves every launch that fits it
    (launches on one stream never overlap); a larger set is made outside a CUDA graph's capture
    (the warm-up steps before it), and the older sets stay alive for the graphs that hold them."""
    sets = _buffers.setdefault(device, [])
    if not sets or sets[-1][0].numel() < tiles * tile_floats or sets[-1][1].numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the decode kernels' split buffers must be sized before a graph capture")
        floats = max([tiles * tile_floats] + [p.numel() for p, _ in sets])
        count = max([tiles] + [c.numel() for _, c in sets])
        sets.append((torch.empty(floats, device=device, dtype=torch.float32),
                     torch.zeros(count, device=device, dtype=torch.int32)))
    return sets[-1]


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def reference_ln_linear(x, weight, bias=None, ln=None, gelu=False, residual=None) -> torch.Tensor:
    """The same math as PyTorch ops, with eager's roundings: LayerNorm in fp32, its output in the
    weight's dtype; the product accumulated in fp32; bias and GELU in fp32; the product rounded to
    the output dtype before the residual add. (The kernel folds the LayerNorm into the product, so
    in half precision it rounds g * (x - x0) instead of the LayerNorm's output: equal in fp32 up to
    the order of the sums, within half-precision rounding otherwise.)"""
    a = x.float()
    if ln is not None:
        a = F.layer_norm(a, a.shape[-1:], ln.weight.float(), ln.bias.float(), ln.eps)
    y = F.linear(a.to(weight.dtype).float(), weight.float(), None if bias is None else bias.float())
    if gelu:
        y = F.gelu(y, approximate="tanh")
    if residual is not None:
        y = y.to(residual.dtype).float() + residual.float()
    return y


def decode_attention(qkv: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each row's new token over its own cache: ``qkv`` (rows, heads * 3 * dim) as the
    QKV projection lays it out (per head: query, key, value), ``kv`` (2, batch, heads, window, dim)
    one layer's cache, ``positions`` (rows,) each row's position. Writes the new key and value at
    the row's position and attends over positions 0 .. position; returns (rows, heads * dim)."""
    rows = qkv.shape[0]
    _, batch, heads, window, dim = kv.shape
    if out is None:
        out = torch.empty(rows, heads * dim, device=qkv.device, dtype=qkv.dtype)
    if not use_triton(qkv):
        return out.copy_(reference_decode_attention(qkv, kv, positions))
    assert qkv.is_contiguous() and kv.is_contiguous() and out.is_contiguous() and rows <= batch
    chunks = triton_cdiv(window, ATTENTION_CHUNK)
    p2 = 1 << (chunks - 1).bit_length()
    parts, locks = split_buffers(qkv.device, rows * heads, p2 * 2 * dim)
    _kernels()[1][(rows, heads, chunks)](qkv, kv, positions, out, parts, locks, heads, window,
                                         batch * heads * window * dim, dim ** -0.5, DIM=dim, CHUNK=ATTENTION_CHUNK,
                                         CHUNKS_P2=p2, num_warps=4)
    return out


ATTENTION_CHUNK = 128  # cached positions a program attends over (a row's chunks run in parallel)


def reference_decode_attention(qkv: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    rows = qkv.shape[0]
    _, _, heads, window, dim = kv.shape
    q, k, v = qkv.view(rows, heads, 3, dim).unbind(2)
    at = torch.arange(rows, device=qkv.device)
    kv[0, at, :, positions] = k
    kv[1, at, :, positions] = v
    mask = torch.arange(window, device=qkv.device)[None, :] <= positions[:, None]  # (rows, window)
    y = F.scaled_dot_product_attention(q[:, :, None].float(), kv[0, :rows].float(), kv[1, :rows].float(),
                                       attn_mask=mask[:, None, None, :])
    return y.reshape(rows, heads * dim)
