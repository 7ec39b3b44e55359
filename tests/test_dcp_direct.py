"""``dcp_direct``: a checkpoint's tensors read without importing DCP equal what DCP itself reads (whole
tensors and tensor-parallel chunks), a crafted metadata is refused as ``safe_dcp`` refuses it, and
loading a model for inference imports neither DCP nor sympy."""
from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed import spawn
from gptrain.model.gpt import GPT
from gptrain.train.dcp_direct import UnsafeDCPMetadata, read_tensors
from gptrain.train.safe_dcp import load_safely, read_metadata_safely
from tiny import tiny_config

MEGATRON_DIST = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "megatron-ckpt" / "dev_dist_tp1"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from gptrain.train.checkpoint import save_checkpoint

    model = GPT(tiny_config(vocab_size=50257))
    model.init_weights(5)
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(params.values())
    params["word_embeddings.weight"].sum().backward()
    optimizer.step()
    state = {"config": {"model": dataclasses.asdict(model.cfg), "data": {"vocab_file": None}}}
    root = tmp_path_factory.mktemp("ck")
    save_checkpoint(root, 2, params, optimizer, state, model.cfg.vocab_size)
    return root / "iter_0000002"


def _empty_like_stored(folder) -> dict[str, torch.Tensor]:
    meta = read_metadata_safely(folder)
    return {k: torch.full(tuple(v.size), float("nan"), dtype=v.properties.dtype)
            for k, v in meta.state_dict_metadata.items()}


def test_whole_tensors_equal_dcps_own_read(saved):
    mine, theirs = _empty_like_stored(saved), _empty_like_stored(saved)
    assert any(k.startswith("optim/") for k in mine)
    assert read_tensors(saved, mine)
    load_safely(theirs, saved)
    for key in theirs:
        assert torch.equal(mine[key], theirs[key]), key


def test_plain_tensors_are_read_straight_from_the_file(saved, monkeypatch):
    """Whole fp32 tensors go from the file into their destination without ``torch.load``; a region
    that is not contiguous (a column chunk) is read through it, with the same numbers."""
    import gptrain.train.dcp_direct as dcp_direct

    theirs = _empty_like_stored(saved)
    load_safely(theirs, saved)
    monkeypatch.setattr(dcp_direct.torch, "load", lambda *a, **k: pytest.fail("torch.load used"))
    mine = _empty_like_stored(saved)
    assert read_tensors(saved, mine)
    for key in theirs:
        assert torch.equal(mine[key], theirs[key]), key
    monkeypatch.undo()
    key = "model/layers.0.mlp.fc1.weight"
    wide = torch.full((theirs[key].shape[0], theirs[key].shape[1] + 3), float("nan"))
    region = wide[:, :theirs[key].shape[1]]
    assert not region.is_contiguous()
    assert read_tensors(saved, {key: region})
    assert torch.equal(region, theirs[key])


def test_a_saved_tensor_of_another_kind_is_read_through_torch_load(saved, tmp_path):
    """A record that is not the region's kind (dtype, a header naming something else) is not read
    straight: ``_read_saved_tensor`` says so and leaves the region untouched."""
    import io

    from gptrain.train.dcp_direct import _read_saved_tensor

    for value in (torch.arange(6, dtype=torch.float64).reshape(2, 3), torch.ones(2, 3)[:, :2].contiguous().t()):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        path = tmp_path / "record"
        path.write_bytes(b"x" * 7 + buffer.getvalue())
        region = torch.full((2, 3), 7.0)
        with open(path, "rb") as f:
            assert not _read_saved_tensor(f, 7, len(buffer.getvalue()), region)
        assert (region == 7).all()
    buffer = io.BytesIO()
    torch.save(torch.arange(6.0).reshape(2, 3), buffer)
    path.write_bytes(b"x" * 7 + buffer.getvalue())
    region = torch.empty(2, 3)
    with open(path, "rb") as f:
        assert _read_saved_tensor(f, 7, len(buffer.getvalue()), region)
    assert torch.equal(region, torch.arange(6.0).reshape(2, 3))
    # the same record with a header that would run code: refused, nothing run
    import zipfile

    source, crafted = zipfile.ZipFile(io.BytesIO(buffer.getvalue())), io.BytesIO()
    with zipfile.ZipFile(crafted, "w", zipfile.ZIP_STORED) as out:
        for name in source.namelist():
            data = source.read(name)
            if name.endswith("data.pkl"):
                data = b"cbuiltins\nexec\n(Vimport builtins; builtins.CRAFTED_RAN = 1\ntR."
            out.writestr(name, data)
    path.write_bytes(b"x" * 7 + crafted.getvalue())
    region = torch.full((2, 3), 7.0)
    with open(path, "rb") as f:
        assert not _read_saved_tensor(f, 7, len(crafted.getvalue()), region)
    import builtins

    assert not hasattr(builtins, "CRAFTED_RAN") and (region == 7).all()


def test_a_record_whose_data_would_lie_outside_it_is_not_read_straight(tmp_path):
    """A local header stretched (its extra field) so that the data would start past the record's end,
    a header whose pickle sets state on its description: neither is read straight, nothing past the
    record lands in the region, and nothing raises."""
    import io
    import struct
    import zipfile

    from gptrain.train.dcp_direct import _locate_saved_tensor, _read_saved_tensor

    buffer = io.BytesIO()
    torch.save(torch.arange(16, dtype=torch.float32), buffer)
    record = bytearray(buffer.getvalue())
    info = next(i for i in zipfile.ZipFile(io.BytesIO(bytes(record))).infolist() if "/data/" in i.filename)
    at = info.header_offset
    name_length, extra_length = struct.unpack("<HH", record[at + 26:at + 30])
    record[at + 28:at + 30] = struct.pack("<H", extra_length + len(record) - (at + 30 + name_length + extra_length))
    path = tmp_path / "shard"
    path.write_bytes(bytes(record) + torch.full((16,), 7.0).numpy().tobytes())
    region = torch.zeros(16)
    with open(path, "rb") as f:
        assert _locate_saved_tensor(f, 0, len(record)) is None
        assert not _read_saved_tensor(f, 0, len(record), region)
    assert not region.any()

    source, crafted = zipfile.ZipFile(io.BytesIO(buffer.getvalue())), io.BytesIO()
    with zipfile.ZipFile(crafted, "w", zipfile.ZIP_STORED) as out:
        for name in source.namelist():
            data = source.read(name)
            if name.endswith("data.pkl"):
                data = data[:-1] + b"}q\x99K\x01K\x02sb."  # BUILD {1: 2} on the rebuilt description
            out.writestr(name, data)
    path.write_bytes(crafted.getvalue())
    with open(path, "rb") as f:
        assert _locate_saved_tensor(f, 0, len(crafted.getvalue())) is None


def test_a_shape_that_differs_or_a_missing_entry_leaves_it_to_dcp(saved):
    key = "model/word_embeddings.weight"
    stored = _empty_like_stored(saved)[key]
    assert not read_tensors(saved, {key: torch.empty(stored.shape[0] + 1, stored.shape[1])})
    assert not read_tensors(saved, {"model/no_such_weight": torch.empty(3)})


def _save_sharded(rank: int, folder: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    state = {"rows": distribute_tensor(full, mesh, [Shard(0)]), "cols": distribute_tensor(full * 2, mesh, [Shard(1)]),
             "whole": torch.ones(3)}
    dcp.save(state, checkpoint_id=folder)
    dist.destroy_process_group()


def test_chunks_written_by_two_ranks_are_put_together(tmp_path):
    spawn(2, _save_sharded, str(tmp_path))
    meta = read_metadata_safely(tmp_path)
    assert len(meta.state_dict_metadata["rows"].chunks) == 2
    full = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    out = {"rows": torch.zeros(7, 6), "cols": torch.zeros(7, 6), "whole": torch.zeros(3)}
    assert read_tensors(tmp_path, out)
    assert torch.equal(out["rows"], full) and torch.equal(out["cols"], full * 2)
    assert torch.equal(out["whole"], torch.ones(3))


@pytest.mark.skipif(not MEGATRON_DIST.is_dir(), reason="the Megatron-LM fixtures live in ../shared")
def test_a_checkpoint_megatron_lm_wrote_reads_as_dcp_reads_it():
    """megatron-core's torch_dist format (another torch, layer-stacked tensors in several chunks, byte entries
    beside them): every tensor entry equal to DCP's own read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = MEGATRON_DIST / "iter_0000020"
    meta = read_metadata_safely(folder, allow_bytes=True)
    entries = {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    assert max(len(v.chunks) for v in entries.values()) > 1

    def empty():
        return {k: torch.full(tuple(v.size), float("nan"), dtype=v.properties.dtype) for k, v in entries.items()}

    mine, theirs = empty(), empty()
    assert read_tensors(folder, mine)
    load_safely(theirs, folder, allow_bytes=True)
    for key in entries:
        assert torch.equal(mine[key], theirs[key]), key


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("craft", ["code", "outside-path", "not-metadata"])
def test_a_crafted_metadata_is_refused_without_running_code(craft, saved, tmp_path):
    import shutil

    folder = tmp_path / "ck"
    shutil.copytree(saved, folder)
    marker = tmp_path / "ran"
    metadata = read_metadata_safely(folder)
    if craft == "code":
        metadata.planner_data = _RunsCode(marker)
        why = "refuses to load posix.system"
    elif craft == "outside-path":
        for info in metadata.storage_data.values():
            info.relative_path = "../../state.json"
        why = "outside the checkpoint folder"
    else:
        metadata = torch.Size([1, 2])
        why = "not DCP metadata"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeDCPMetadata, match=why):
        read_tensors(folder, _empty_like_stored(saved))
    assert not marker.exists()


def _string(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


@pytest.mark.parametrize("target", ["pathlib\nPurePosixPath", "torch.serialization\n_get_layout"])
def test_a_metadata_that_sets_state_on_a_class_or_function_is_refused(target, saved, tmp_path):
    """BUILD on an allowed class would change it for the whole process (PurePosixPath's ``name``, which a
    folder check trusted): both readers refuse it, and nothing changes."""
    import pathlib
    import shutil

    from gptrain.train.safe_dcp import read_metadata_safely as dcp_read

    folder = tmp_path / "ck"
    shutil.copytree(saved, folder)
    crafted = b"\x80\x02c" + target.encode() + b"\nN}" + _string("name") + _string("../x") + b"s\x86b."
    (folder / ".metadata").write_bytes(crafted)
    for read in (lambda: read_tensors(folder, {}), lambda: dcp_read(folder)):
        with pytest.raises(UnsafeDCPMetadata, match="refuses to set state"):
            read()
    assert pathlib.PurePosixPath("a/b").name == "b"
    assert not hasattr(torch.serialization._get_layout, "name")


def test_chunks_that_overlap_or_leave_the_tensor_are_left_to_dcp(saved, tmp_path):
    """The chunks must tile the tensor exactly: overlapping ones (whose element count still adds up) or
    offsets outside it are not read here."""
    import shutil

    key = "model/word_embeddings.weight"
    for damage in ("overlap", "outside"):
        folder = tmp_path / damage
        shutil.copytree(saved, folder)
        metadata = read_metadata_safely(folder)
        entry = metadata.state_dict_metadata[key]
        rows, cols = entry.size
        first = entry.chunks[0]
        half = rows // 2
        first.sizes = torch.Size([half, cols])
        second = type(first)(offsets=torch.Size([0 if damage == "overlap" else rows, 0]),
                             sizes=torch.Size([rows - half, cols]))
        entry.chunks = [first, second]
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
        assert not read_tensors(folder, {key: torch.zeros(rows, cols)}), damage


def test_loading_for_inference_imports_neither_dcp_nor_sympy(saved):
    """DCP's import pulls in DTensor and sympy (most of a second of ``gptrain generate``'s start)."""
    code = ("import sys; from gptrain.inference.load import load_for_inference; "
            f"loaded = load_for_inference({str(saved.parent)!r}); "
            "print(sorted(m for m in ('torch.distributed.checkpoint', 'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_the_inference_model_holds_the_saved_weights_with_the_padding_zeroed(saved):
    from gptrain.inference.load import load_for_inference

    loaded = load_for_inference(saved.parent)
    stored = _empty_like_stored(saved)
    load_safely(stored, saved)
    params = dict(loaded.model.named_parameters())
    for key, value in stored.items():
        if not key.startswith("model/"):
            continue
        param = params[key.split("/", 1)[1]]
        assert torch.equal(param[: value.shape[0]], value), key
        assert not param[value.shape[0]:].any(), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU lane)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensors_go_straight_to_the_gpu_in_its_dtype(saved, monkeypatch, dtype):
    """GPU targets are filled through the pinned pieces (small pieces here: many per tensor, both
    buffers in turn) and cast on the device: equal to the CPU read cast."""
    import gptrain.train.dcp_direct as dcp_direct

    cpu = _empty_like_stored(saved)
    assert read_tensors(saved, cpu)
    monkeypatch.setattr(dcp_direct.DeviceStaging, "PIECE", 4096 + 64)
    gpu = {k: torch.full(v.shape, float("nan"), dtype=dtype, device="cuda") for k, v in cpu.items()
           if v.is_floating_point()}
    assert read_tensors(saved, gpu)
    for key, value in gpu.items():
        assert torch.equal(value.cpu(), cpu[key].to(dtype)), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU lane)")
def test_the_inference_model_loads_straight_onto_the_gpu(saved):
    from gptrain.inference.load import load_for_inference

    on_cpu = load_for_inference(saved.parent, "cpu", torch.float32).model
    on_gpu = load_for_inference(saved.parent, "cuda", torch.bfloat16).model
    assert on_gpu.word_embeddings.weight.is_cuda
    mine = dict(on_gpu.named_parameters())
    for name, param in on_cpu.named_parameters():
        assert mine[name].dtype == torch.bfloat16 and torch.equal(mine[name].cpu(), param.to(torch.bfloat16)), name
