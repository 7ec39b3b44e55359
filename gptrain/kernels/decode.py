"""The one-token decode step's kernels: a matrix-vector product with its LayerNorm before it and its
bias, GELU and residual add after it, in one kernel; and attention of one new token over a row's
cached keys, with the new key and value written into the cache by the same kernel.

A 345M step at batch 1 reads 0.7 GB of weights, about 0.2 ms at an H100's memory speed, but as
PyTorch ops (or Inductor's fusions around cuBLAS) it is 300-odd kernels, and their launch gaps
cost more than the reads. Here a block is five kernels: LayerNorm + QKV; attention; output
projection + bias + residual; LayerNorm + FC1 + bias + GELU; FC2 + bias + residual.

Every kernel computes a row of the batch the same way whatever the other rows hold and however
many there are: fixed tiles (16 rows a program, masked), a fixed order of the reduction over the
input dimension, and attention that walks the row's own cached positions in a fixed order up to
its own length. So a request's numbers do not depend on the batch it decodes in (batch
invariance): a seeded request gives the same text alone or under load. Tile sizes depend only on
the weight's shape, never on the batch.

Elsewhere than CUDA (and as the reference the kernels are checked against) the same math runs as
PyTorch ops.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

ROWS = 16  # batch rows a program computes (tensor-core tiles need 16); fewer are masked
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@functools.cache
def _kernels():
    from gptrain.kernels import decode_triton as k

    return k.ln_linear_kernel, k.attention_kernel, k.block_kernel


@functools.cache
def tiles(n: int, k: int) -> dict:
    """Tile sizes and launch settings for a (n x k) weight (never the batch: see the docstring).
    ``SPLIT`` programs share a tile's input dimension when the tiles alone are too few to keep the
    GPU's memory system busy."""
    # benchmarks/decode_kernels.py's sweep on an H100 (RESULTS.md): wide tiles for the wide weights,
    # narrow ones for a square 1024, and four shares of the input for a long one
    long = n <= 1024 and k >= 4096 and k % (4 * 256) == 0
    block_n = 64 if n >= 2048 else 32 if long else 16
    return {"BLOCK_N": block_n, "BLOCK_K": 256 if k % 256 == 0 else 128, "num_warps": 4, "num_stages": 3,
            "SPLIT": 4 if long else 1}


TILES: dict[tuple[int, int], dict] = {}  # overrides by weight shape (benchmarks/decode_kernels.py's sweep)


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def ln_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              ln: torch.nn.LayerNorm | None = None, gelu: bool = False, residual: torch.Tensor | None = None,
              out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``residual + gelu(ln(x) @ weight.T + bias)`` for x (rows, k), each part optional; into
    ``out`` when given (it may be ``residual``)."""
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    if not _use_triton(x):
        return out.copy_(reference_ln_linear(x, weight, bias, ln, gelu, residual))
    assert x.is_contiguous() and weight.stride() == (k, 1) and out.stride(1) == 1 and out.shape == (m, n)
    assert residual is None or residual.is_contiguous()
    kernel = _kernels()[0]
    settings = {"SPLIT": 1, **(TILES.get((n, k)) or tiles(n, k))}
    if x.dtype == torch.float32:  # fp32 tiles take twice the shared memory
        settings.update(BLOCK_K=min(settings["BLOCK_K"], 64), num_stages=2)
    split = settings["SPLIT"]
    if split > 1 and k % (split * settings["BLOCK_K"]):
        raise ValueError(f"{k} inputs do not split into {split} shares of {settings['BLOCK_K']}-wide steps")
    grid = (triton_cdiv(n, settings["BLOCK_N"]), triton_cdiv(m, ROWS), split)
    parts, locks = (x, x) if split == 1 else _split_buffers(x.device, grid[0] * grid[1],
                                                             split * ROWS * settings["BLOCK_N"])
    kernel[grid](x, ln.weight if ln is not None else x, ln.bias if ln is not None else x, weight,
                 bias if bias is not None else x, residual if residual is not None else out, out, parts, locks,
                 m, n, k, out.stride(0), ln.eps if ln is not None else 0.0, HAS_LN=ln is not None,
                 HAS_BIAS=bias is not None, GELU=gelu, RESIDUAL=residual is not None, IEEE=x.dtype == torch.float32,
                 BLOCK_M=ROWS, **settings)
    return out


_buffers: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def _split_buffers(device: torch.device, tiles: int, tile_floats: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    """The same math as PyTorch ops, with the kernel's roundings: LayerNorm in fp32, its output in
    the weight's dtype; the product accumulated in fp32; bias and GELU in fp32; the product
    rounded to the output dtype before the residual add."""
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
    if not _use_triton(qkv):
        return out.copy_(reference_decode_attention(qkv, kv, positions))
    assert qkv.is_contiguous() and kv.is_contiguous() and out.is_contiguous() and rows <= batch
    _kernels()[1][(rows, heads)](qkv, kv, positions, out, heads, window, batch, dim ** -0.5, DIM=dim, BLOCK_T=64,
                                 num_warps=4)
    return out


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


BLOCK_TILES = {"BLOCK_K": 256, "BN_QKV": 32, "BN_PROJ": 16, "BN_FC1": 32, "BN_FC2": 16, "SPLIT_FC2": 2,
               "PREFETCH": True, "WORK": 31, "num_warps": 4, "num_stages": 3}  # the whole-block kernel's tiles (never the batch's)
_barriers: dict[torch.device, torch.Tensor] = {}


def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_block(x: torch.Tensor, block, kv: torch.Tensor, positions: torch.Tensor,
                 programs: int | None = None) -> torch.Tensor:
    """One transformer block's decode step on ``x`` (rows, hidden), in place: as ``ln_linear`` and
    ``decode_attention`` stage by stage (the same tiles' math), but on CUDA in one launch of
    persistent programs, one per multiprocessor (``programs`` overrides), with a grid barrier
    between stages. ``kv`` and ``positions`` as ``decode_attention``'s."""
    attn, mlp = block.attn, block.mlp
    if not _use_triton(x):
        qkv = ln_linear(x, attn.qkv.weight, attn.qkv.bias, ln=block.ln1)
        y = decode_attention(qkv, kv, positions)
        ln_linear(y, attn.proj.weight, attn.proj.bias, residual=x, out=x)
        h = ln_linear(x, mlp.fc1.weight, mlp.fc1.bias, ln=block.ln2, gelu=True)
        return ln_linear(h, mlp.fc2.weight, mlp.fc2.bias, residual=x, out=x)
    m, hidden = x.shape
    ffn = mlp.fc1.weight.shape[0]
    _, batch, heads, window, dim = kv.shape
    assert x.is_contiguous() and kv.is_contiguous() and m <= batch and heads * dim == hidden
    settings = dict(BLOCK_TILES)
    if x.dtype == torch.float32:
        settings.update(BLOCK_K=64, num_stages=2)
    if os.environ.get("TRITON_INTERPRET") == "1":
        settings.update(PREFETCH=False)  # no inline assembly in Triton's interpreter
    if hidden % settings["BLOCK_K"] or ffn % (settings["SPLIT_FC2"] * settings["BLOCK_K"]):
        raise ValueError(f"hidden {hidden} / ffn {ffn} do not fit the block kernel's {settings['BLOCK_K']}-wide steps")
    qkv = torch.empty(m, 3 * hidden, device=x.device, dtype=x.dtype)
    y = torch.empty(m, hidden, device=x.device, dtype=x.dtype)
    h = torch.empty(m, ffn, device=x.device, dtype=x.dtype)
    fc2_tiles = triton_cdiv(m, ROWS) * triton_cdiv(hidden, settings["BN_FC2"])
    parts, locks = _split_buffers(x.device, fc2_tiles, settings["SPLIT_FC2"] * ROWS * settings["BN_FC2"])
    barrier = _barriers.get(x.device)
    if barrier is None:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the block kernel's barrier must be made before a graph capture")
        barrier = _barriers[x.device] = torch.zeros(2, device=x.device, dtype=torch.int32)
    grid = (programs or _multiprocessors(x.device),)
    _kernels()[2][grid](x, qkv, y, h, kv, positions, block.ln1.weight, block.ln1.bias, attn.qkv.weight, attn.qkv.bias,
                        attn.proj.weight, attn.proj.bias, block.ln2.weight, block.ln2.bias, mlp.fc1.weight,
                        mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, parts, locks, barrier, m, heads, window, batch,
                        dim ** -0.5, block.ln1.eps, block.ln2.eps, HIDDEN=hidden, FFN=ffn, DIM=dim,
                        IEEE=x.dtype == torch.float32, BLOCK_M=ROWS, **settings)
    return x
