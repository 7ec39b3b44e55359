"""Counter-based normal draws for parameter init: each element's value is a pure function of
(seed, stream, its flat index in the full tensor), so a rank draws only the part of a parameter it
holds and gets bitwise the values it would keep after drawing the whole tensor and slicing it. Every
layout (tensor, pipeline, FSDP shards, one process) then starts from the same weights, without any
rank drawing a full 175B-scale tensor on the CPU.

The draw: SplitMix64 of (flat index * golden ratio + a key hashed from seed and stream) gives 64
bits: 32 for the radius's uniform, mapped to (0, 1] so the log is finite, 31 for an angle in
(-pi/2, pi/2) and one that adds pi; Box-Muller in float64 (the cos only: one normal per element);
the float64 value rounded to float32, then to the requested dtype (float64 keeps it). Work goes in
chunks of the region, so memory stays a few buffers of a chunk whatever the shard's size.

Bitwise equal across layouts and chunkings, and across CPU and GPU (checked on an H100, torch 2.11,
against this machine's CPU: benchmarks/RESULTS.md, s14): the log and cos are polynomials evaluated
with separate torch ops (library log/cos may differ in the last bit between CPU and CUDA; separate ops leave no room
for fused multiply-adds), and every op used (integer ops, +, -, *, /, sqrt, conversions) is
exactly rounded IEEE arithmetic on both. The polynomials agree with torch's float64 log and cos to
~1e-14, so after rounding to float32 the values are almost always those of the library formula.
"""
from __future__ import annotations

import hashlib
import itertools
import math

import torch

# elements hashed per step: bounds the int64/float64 temporaries (a few of this size at once);
# the CPU takes smaller steps, whose temporaries stay in its caches
CHUNK_ELEMENTS = 2 ** 22
CPU_CHUNK_ELEMENTS = 2 ** 18

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_LN2 = math.log(2.0)
_SQRT_HALF_BITS = 0x3FE6A09E667F3BCD  # float64 bits of sqrt(1/2)
_ONE_BITS = 0x3FF0000000000000
_TWO52_BITS = 0x4330000000000000  # float64 bits of 2^52
# series in s^2 for -2 log(m) = -4 atanh(s), |s| <= 0.1716 (relative remainder < 4e-14)
_LOG_COEFFS = [-4.0 / (2 * k + 1) for k in range(8)]
# Taylor series in x^2 for cos on [-pi/2, pi/2] (remainder < 4e-15)
_COS_COEFFS = [(-1) ** k / math.factorial(2 * k) for k in range(10)]


def _signed(c: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    c &= _M64
    return c - (1 << 64) if c >= 1 << 63 else c


def _mix64_int(z: int) -> int:
    """SplitMix64's finaliser on Python ints (the key, and the reference for the tensor version)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def _key(seed: int, stream: int) -> int:
    return _mix64_int(_mix64_int(seed) ^ (stream & _M64))


def _hash_reference(seed: int, stream: int, index: int) -> int:
    """The 64 bits ``normal_region`` draws for one element, in plain Python (for tests)."""
    return _mix64_int(index * _GOLDEN + _key(seed, stream))


def uniform_stream(name: str) -> int:
    """A stable 63-bit stream id for a parameter name: independent of registration order, process
    and Python's hash seed."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


def _shr_into(z: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    # torch's >> on int64 is arithmetic: mask the copied sign bits to make it logical
    return torch.bitwise_right_shift(z, n, out=out).bitwise_and_((1 << (64 - n)) - 1)


def _mix64(z: torch.Tensor, tmp: torch.Tensor | None = None) -> torch.Tensor:
    """SplitMix64's finaliser, in place on int64 (multiplies wrap mod 2^64 as in the reference)."""
    tmp = torch.empty_like(z) if tmp is None else tmp
    z.bitwise_xor_(_shr_into(z, 30, tmp)).mul_(_signed(_MIX1))
    z.bitwise_xor_(_shr_into(z, 27, tmp)).mul_(_signed(_MIX2))
    return z.bitwise_xor_(_shr_into(z, 31, tmp))


def _horner(x: torch.Tensor, coeffs: list[float], out: torch.Tensor) -> torch.Tensor:
    # separate mul and add kernels: no fused multiply-add, the same rounding on every device
    torch.mul(x, coeffs[-1], out=out).add_(coeffs[-2])
    for c in reversed(coeffs[:-2]):
        out.mul_(x).add_(c)
    return out


def _to_float(k: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Integers 0 <= k < 2^52 (int64) as float64, exactly: k's bits under 2^52's exponent, minus
    2^52 (the CPU converts int64 to float64 element by element)."""
    torch.bitwise_or(k, _TWO52_BITS, out=out.view(torch.int64))
    return out.sub_(2.0 ** 52)


def _box_muller(z: torch.Tensor, std: float, work: list[torch.Tensor] | None = None) -> torch.Tensor:
    """N(0, std) values (float64) from 64 random bits each (``z``, int64, consumed). ``work``: an
    int64 and three float64 buffers of z's size (reused across chunks: fresh memory costs the CPU
    more than the arithmetic); the result is the last."""
    t, a, b, c = work or [torch.empty_like(z)] + [torch.empty(z.shape, dtype=torch.float64, device=z.device)
                                                  for _ in range(3)]
    # radius: u = (bits 31..62 + 1) / 2^32 in (0, 1], exact in float64
    _to_float(_shr_into(z, 31, t).bitwise_and_(0xFFFFFFFF).add_(1), a).mul_(2.0 ** -32)
    # u = 2^e * m with m in [sqrt(1/2), sqrt(2)), read off the bits (exact); t = e + 1023
    bits = a.view(torch.int64).add_(_ONE_BITS - _SQRT_HALF_BITS)
    torch.bitwise_right_shift(bits, 52, out=t)
    m = bits.bitwise_and_((1 << 52) - 1).add_(_SQRT_HALF_BITS).view(torch.float64)
    s = b.copy_(m).sub_(1.0).div_(m.add_(1.0))
    # -2 log u = -2 e log 2 - 4 atanh(s); >= 0 (-0.0 at u = 1), so the sqrt is never nan
    r = _horner(torch.mul(s, s, out=a), _LOG_COEFFS, out=c).mul_(s)
    r.add_(_to_float(t, a).sub_(1023.0).mul_(-2.0 * _LN2)).sqrt_()
    # angle: bits 0..30 give x uniform in (-pi/2, pi/2); std folded into the cos polynomial
    torch.bitwise_and(z, 0x7FFFFFFF, out=t).mul_(2).add_(1)
    x = _to_float(t, a).sub_(2.0 ** 31).mul_(math.pi * 2.0 ** -32)
    value = r.mul_(_horner(torch.mul(x, x, out=b), [k * std for k in _COS_COEFFS], out=a))
    # bit 63 adds pi to the angle: flips the sign bit (exact)
    value.view(torch.int64).bitwise_xor_(z.bitwise_and_(-(1 << 63)))
    return value


def _region_bounds(full_shape: tuple[int, ...], region) -> list[tuple[int, int]]:
    if region is None:
        region = ()
    if len(region) > len(full_shape):
        raise ValueError(f"region {region} has more dimensions than the shape {full_shape}")
    bounds = []
    for d, size in enumerate(full_shape):
        sl = region[d] if d < len(region) else slice(None)
        start, stop, step = sl.indices(size)
        if step != 1:
            raise ValueError(f"region slices need step 1, got {sl}")
        bounds.append((start, max(start, stop)))
    return bounds


def normal_region(seed: int, stream: int, full_shape: tuple[int, ...], region: tuple[slice, ...] | None,
                  std: float, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """N(0, std) values of a tensor of ``full_shape``, restricted to ``region`` (a slice of step 1
    per leading dimension, the rest whole; None: the whole tensor), in ``dtype`` on ``device``.

    Equals ``normal_region(seed, stream, full_shape, None, std, device, dtype)[region]`` bitwise.
    With ``out`` (the region's shape, any layout, e.g. a view of a parameter's shard) the values are
    computed on ``out.device`` for ``out.dtype`` (``device`` and ``dtype`` are ignored) and written
    into it, which is returned.
    """
    full_shape = tuple(int(n) for n in full_shape)
    bounds = _region_bounds(full_shape, region)
    shape = tuple(b - a for a, b in bounds)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    elif tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, the region {shape}")
    device, dtype = out.device, out.dtype
    if out.numel() == 0:
        return out
    if out.dim() == 0:  # a scalar: element 0 of a one-element vector
        normal_region(seed, stream, (1,), None, std, out=out.view(1))
        return out
    key = _key(seed, stream)
    ndim = len(shape)
    strides = [math.prod(full_shape[d + 1:]) for d in range(ndim)]
    chunk = max(1, min(CHUNK_ELEMENTS, CPU_CHUNK_ELEMENTS) if device.type == "cpu" else CHUNK_ELEMENTS)
    # split at the first dimension whose trailing block fits a chunk: loop over the dimensions
    # before it, take row blocks of it
    split = next(d for d in range(ndim) if math.prod(shape[d + 1:]) <= chunk)
    inner = math.prod(shape[split + 1:])
    rows = max(1, chunk // inner)
    # flat-index offsets of the trailing dimensions, broadcast over a block of rows
    tail = torch.zeros((), dtype=torch.int64, device=device)
    for d in range(split + 1, ndim):
        view = [1] * (ndim - split)
        view[d - split] = shape[d]
        step = torch.arange(bounds[d][0], bounds[d][1], dtype=torch.int64, device=device) * strides[d]
        tail = tail + step.view(view)
    row_view = [-1] + [1] * (ndim - split - 1)
    size = min(rows, shape[split]) * inner
    z = torch.empty(size, dtype=torch.int64, device=device)
    work = [torch.empty_like(z)] + [torch.empty(size, dtype=torch.float64, device=device) for _ in range(3)]
    narrow = torch.empty(size, device=device) if dtype not in (torch.float32, torch.float64) else None
    for lead in itertools.product(*(range(a, b) for a, b in bounds[:split])):
        block = out[tuple(i - a for i, (a, _) in zip(lead, bounds))]
        base = sum(i * strides[d] for d, i in enumerate(lead))
        for r0 in range(bounds[split][0], bounds[split][1], rows):
            r1 = min(r0 + rows, bounds[split][1])
            target = block[r0 - bounds[split][0]:r1 - bounds[split][0]]
            n = target.numel()
            first = torch.arange(r0, r1, dtype=torch.int64, device=device) * strides[split] + base
            index = torch.add(first.view(row_view), tail, out=z[:n].view(target.shape)).view(-1)
            index.mul_(_signed(_GOLDEN)).add_(_signed(key))
            values = _box_muller(_mix64(index, work[0][:n]), float(std), [w[:n] for w in work])
            if narrow is not None:  # rounded to float32 first, as for float32
                values = narrow[:n].copy_(values)
            target.copy_(values.view(target.shape))
    return out
