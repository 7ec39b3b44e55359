"""Counter-based init draws (gptrain/model/init_draw.py): a region equals the slice of the full
tensor bitwise, whatever the layout, chunking and output view; the values are sound normals."""
import math

import pytest
import torch

from gptrain.model import init_draw
from gptrain.model.init_draw import normal_region, uniform_stream

SEED, STREAM, STD = 1234, uniform_stream("layers.0.mlp.fc1.weight"), 0.02


def full(shape, dtype=torch.float32, seed=SEED, stream=STREAM):
    return normal_region(seed, stream, shape, None, STD, dtype=dtype)


def region(shape, r, dtype=torch.float32):
    return normal_region(SEED, STREAM, shape, r, STD, dtype=dtype)


@pytest.mark.parametrize("shape, r", [
    ((64, 96), (slice(None), slice(17, 53))),    # column shard: strided in the flat index
    ((64, 96), (slice(32, 64),)),                 # row shard, trailing dimension whole
    ((64, 96), (slice(5, 6), slice(0, 1))),
    ((1000,), (slice(333, 667),)),
    ((5, 7, 9), (slice(1, 4), slice(2, 6), slice(3, 8))),
    ((5, 7, 9), (slice(None), slice(-3, None), slice(None))),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_region_is_slice_of_full(shape, r, dtype):
    assert torch.equal(region(shape, r, dtype), full(shape, dtype)[r])


def test_bf16_is_float32_rounded():
    assert torch.equal(full((64, 96), torch.bfloat16), full((64, 96)).to(torch.bfloat16))


def test_out_non_contiguous_view():
    param = torch.full((96, 64), float("nan")).t()  # (64, 96), column-major
    view = param[:, 10:40]
    assert not view.is_contiguous()
    got = normal_region(SEED, STREAM, (64, 96), (slice(None), slice(10, 40)), STD, out=view)
    assert got is view
    assert torch.equal(param[:, 10:40], full((64, 96))[:, 10:40])
    assert param[:, :10].isnan().all() and param[:, 40:].isnan().all()  # nothing outside written
    half = torch.empty(96, 64, dtype=torch.bfloat16).t()[3:9]  # out's dtype decides the rounding
    normal_region(SEED, STREAM, (64, 96), (slice(3, 9),), STD, out=half)
    assert torch.equal(half, full((64, 96), torch.bfloat16)[3:9])


@pytest.mark.parametrize("chunk", [1, 7, 100, 1000])
@pytest.mark.parametrize("shape, r", [
    ((64, 96), (slice(3, 61), slice(5, 90))),
    ((5000,), (slice(17, 4999),)),
    ((6, 30, 12), (slice(1, 6), slice(2, 29), slice(0, 11))),
])
def test_chunking_boundaries(monkeypatch, chunk, shape, r):
    whole = full(shape)[r]
    monkeypatch.setattr(init_draw, "CHUNK_ELEMENTS", chunk)
    assert whole.numel() > chunk
    assert torch.equal(region(shape, r), whole)
    assert torch.equal(full(shape)[r], whole)


def test_scalar_and_empty():
    assert full(()).shape == () and full(()).isfinite()
    assert region((4, 5), (slice(2, 2),)).shape == (0, 5)


def test_hash_matches_wrapping_reference():
    """The int64 ops (wrapping multiplies, masked shifts) compute SplitMix64 mod 2^64."""
    index = torch.tensor([0, 1, 2, 3, 2 ** 31, 2 ** 40 + 5, 2 ** 50 - 1, 123456789])
    key = init_draw._key(7, 3)
    z = init_draw._mix64(index.clone().mul_(init_draw._signed(init_draw._GOLDEN)).add_(init_draw._signed(key)))
    assert [v & (2 ** 64 - 1) for v in z.tolist()] == [init_draw._hash_reference(7, 3, i) for i in index.tolist()]


def test_box_muller_extremes_finite():
    """u = 1 (radius 0) and the smallest u (2^-32: radius sqrt(64 log 2)) stay finite."""
    # bits 31..62 (radius) all ones or all zeros, bits 0..30 (angle) at cos ~ 1 or ~ 0, bit 63
    radius_one, angle_zero = (2 ** 32 - 1) << 31, 1 << 30
    bits = torch.tensor([-1, 0, radius_one, radius_one | angle_zero, angle_zero, angle_zero - 2 ** 63])
    v = init_draw._box_muller(bits, 1.0)
    assert v.isfinite().all()
    assert (v[[0, 2, 3]] == 0).all()
    assert v.abs().max() <= math.sqrt(64 * math.log(2)) + 1e-12
    assert v[4] > 6.6 and v[5] == -v[4]


def test_polynomials_match_library_box_muller():
    """The log and cos polynomials agree with torch's to ~1e-14 (std 1)."""
    z = init_draw._mix64(torch.arange(1 << 18).mul_(init_draw._signed(init_draw._GOLDEN)))
    u = (((z >> 31) & 0xFFFFFFFF) + 1).double() * 2.0 ** -32
    angle = ((z & 0x7FFFFFFF) * 2 + 1 - 2 ** 31).double() * (math.pi * 2.0 ** -32)
    ref = torch.sqrt(-2 * torch.log(u)) * torch.cos(angle) * torch.where(z < 0, -1.0, 1.0).double()
    assert (init_draw._box_muller(z.clone(), 1.0) - ref).abs().max() < 1e-12


def test_statistics():
    v = full((1000, 1000)).double()
    assert v.isfinite().all()
    assert abs(v.mean().item()) < 5 * STD / 1000
    assert abs(v.std().item() / STD - 1) < 0.01
    x = (v / STD).flatten()
    for k, p in ((1, 0.682689), (2, 0.954500), (3, 0.997300)):
        assert abs((x.abs() < k).double().mean().item() - p) < 0.003
    assert abs((x ** 4).mean().item() - 3) < 0.05
    # neighbours independent: lag-1 correlation along rows and down columns
    for a, b in ((v[:, 1:], v[:, :-1]), (v[1:], v[:-1])):
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()) < 0.005


def test_streams_and_seeds_differ():
    base = full((1000, 1000)).flatten().double()
    for other in (full((1000, 1000), stream=STREAM + 1), full((1000, 1000), seed=SEED + 1),
                  full((1000, 1000), stream=uniform_stream("layers.1.mlp.fc1.weight"))):
        other = other.flatten().double()
        assert (other == base).sum() < 10  # equal float32 values only by coincidence
        assert abs(torch.corrcoef(torch.stack([base, other]))[0, 1].item()) < 0.005
    assert torch.equal(full((1000, 1000)).flatten().double(), base)  # and the same again


def test_uniform_stream_stable():
    s = uniform_stream("layers.0.attn.qkv.weight")
    assert s == 7015917916518347531  # blake2b: the same in every process and Python version
    assert 0 <= s < 2 ** 63
    assert len({uniform_stream(f"layers.{i}.attn.qkv.weight") for i in range(100)}) == 100


def test_bad_region():
    with pytest.raises(ValueError):
        region((4, 6), (slice(0, 4, 2),))
    with pytest.raises(ValueError):
        region((4, 6), (slice(None),) * 3)
    with pytest.raises(ValueError):
        normal_region(SEED, STREAM, (4, 6), (slice(1, 3),), STD, out=torch.empty(3, 6))
