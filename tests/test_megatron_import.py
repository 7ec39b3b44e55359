"""Reading Megatron-LM checkpoints (``model_optim_rng.pt``) without Megatron and without running
pickled code: the real fixtures in ../shared/fixtures/megatron-ckpt, synthetic legacy checkpoints
(tensor x pipeline parallel, every QKV order), an evil pickle, and iteration selection."""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gptrain.interop.megatron import find_megatron_iteration_dir, read_megatron_checkpoint
from gptrain.interop.safe_unpickle import InertGlobal, UnsafeCheckpointError, load_pickle_safely
from gptrain.model.gpt import GPT, GPTConfig

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "megatron-ckpt"
needs_fixtures = pytest.mark.skipif(
    not (FIXTURES / "dev_tp1").is_dir() or not (FIXTURES / "dev_pp2").is_dir(),
    reason=f"Megatron checkpoint fixtures not found at {FIXTURES} (../shared beside the project root)")

FIXTURE_CFG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=50257)


def gptrain_shapes(cfg: GPTConfig) -> dict[str, tuple]:
    with torch.device("meta"):
        model = GPT(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}  # the tied output layer once


def tree_snapshot(folder: Path) -> dict[str, tuple]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


# ------------------------------------------------------------------------------------------------
# the real fixtures


@needs_fixtures
@pytest.mark.parametrize("name,pp", [("dev_tp1", 1), ("dev_pp2", 2)])
def test_fixture_loads_in_gptrain_names(name, pp):
    before = tree_snapshot(FIXTURES / name)
    ck = read_megatron_checkpoint(FIXTURES / name)
    assert tree_snapshot(FIXTURES / name) == before  # nothing written beside the checkpoint
    assert ck.iteration == 20 and ck.layout == "megatron-core" and ck.checkpoint_version == 3.0
    assert (ck.tp, ck.pp) == (1, pp)
    a = ck.args
    assert (a["num_layers"], a["hidden_size"], a["num_attention_heads"]) == (2, 64, 4)
    assert (a["ffn_hidden_size"], a["seq_length"], a["max_position_embeddings"]) == (256, 64, 64)
    assert a["padded_vocab_size"] == 50304
    assert (a["tensor_model_parallel_size"], a["pipeline_model_parallel_size"]) == (1, pp)
    # Megatron's enums stay inert records; signal.Signals and dtypes are the real values
    assert isinstance(a["attention_backend"], InertGlobal)
    assert a["attention_backend"].qualified_name == "megatron.core.transformer.enums.AttnBackend"
    assert a["attention_backend"].value == 5
    assert a["params_dtype"] is torch.float32
    assert int(a["exit_signal"]) == 15

    cfg = GPTConfig(**FIXTURE_CFG)
    assert cfg.padded_vocab_size == 50304
    expected = gptrain_shapes(cfg)
    assert {n: tuple(t.shape) for n, t in ck.state.items()} == expected
    for n, t in ck.state.items():
        assert t.dtype == torch.float32 and t.device.type == "cpu", n
        assert torch.isfinite(t).all(), n
    # trained weights, not an init: LayerNorm gains moved off 1, biases off 0
    assert not torch.equal(ck.state["layers.0.ln1.weight"], torch.ones(64))
    assert ck.state["layers.1.attn.qkv.bias"].abs().sum() > 0
    assert a["attention_dropout"] == a["hidden_dropout"] == 0.0  # the fixtures ran without dropout
    # NullTokenizer --vocab-size 50256 -> 50257 tokens
    assert ck.gpt_config() == GPTConfig(**FIXTURE_CFG, attention_dropout=0.0, hidden_dropout=0.0)

    if pp == 1:
        assert ck.output_layer_matches_embeddings is None
    else:
        assert isinstance(ck.output_layer_matches_embeddings, bool)
        assert ck.output_layer_matches_embeddings is True  # what this fixture holds


@needs_fixtures
def test_pipeline_stages_merge_to_global_layers():
    ck = read_megatron_checkpoint(FIXTURES / "dev_pp2")
    folder = FIXTURES / "dev_pp2" / "iter_0000020"
    stage0 = load_pickle_safely(folder / "mp_rank_00_000" / "model_optim_rng.pt")["model"]
    stage1 = load_pickle_safely(folder / "mp_rank_00_001" / "model_optim_rng.pt")["model"]
    # megatron-core's torch format stores stage-local layer numbers: both stages say layers.0
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in stage0
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in stage1
    assert not any(k.startswith("decoder.layers.1.") for k in list(stage0) + list(stage1))
    assert "embedding.word_embeddings.weight" in stage0 and "output_layer.weight" in stage1
    assert "embedding.word_embeddings.weight" not in stage1
    for ours, theirs in [("attn.qkv.weight", "self_attention.linear_qkv.weight"),
                         ("mlp.fc2.weight", "mlp.linear_fc2.weight"),
                         ("ln1.bias", "input_layernorm.bias")]:
        assert torch.equal(ck.state[f"layers.0.{ours}"], stage0[f"decoder.layers.0.{theirs}"])
        assert torch.equal(ck.state[f"layers.1.{ours}"], stage1[f"decoder.layers.0.{theirs}"])
        assert not torch.equal(ck.state[f"layers.0.{ours}"], ck.state[f"layers.1.{ours}"])
    assert torch.equal(ck.state["word_embeddings.weight"], stage0["embedding.word_embeddings.weight"])
    assert torch.equal(ck.state["final_layernorm.weight"], stage1["decoder.final_layernorm.weight"])
    assert ck.output_layer_matches_embeddings == torch.equal(
        stage1["output_layer.weight"], stage0["embedding.word_embeddings.weight"])


@needs_fixtures
def test_fixture_logits_through_gptrain_model():
    ck = read_megatron_checkpoint(FIXTURES / "dev_tp1")
    cfg = ck.gpt_config(attention_dropout=0.0, hidden_dropout=0.0)
    model = GPT(cfg)
    model.load_state_dict({**ck.state, "output_layer.weight": ck.state["word_embeddings.weight"]}, strict=True)
    assert model.output_layer.weight is model.word_embeddings.weight  # still tied after loading
    assert torch.equal(model.word_embeddings.weight, ck.state["word_embeddings.weight"])
    model.eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.logits(tokens)
    assert logits.shape == (2, cfg.seq_length, cfg.vocab_size)
    assert torch.isfinite(logits).all()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    assert 5.0 < loss.item() < 15.0  # random tokens under a barely trained model: ~ln(50257) = 10.8


@needs_fixtures
def test_megatron_is_never_imported():
    code = (
        "import sys\n"
        "from gptrain.interop.megatron import read_megatron_checkpoint\n"
        f"ck = read_megatron_checkpoint({str(FIXTURES / 'dev_pp2')!r})\n"
        "assert len(ck.state) == 28\n"
        "bad = [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]\n"
        "assert not bad, bad\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# refusing code


class Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.marker}",))


def _layout_checkpoint(root: Path, files: dict[str, object], iteration=1, tracker=True, **save_kwargs):
    folder = root / ("release" if iteration == "release" else f"iter_{iteration:07d}")
    for rank, obj in files.items():
        (folder / rank).mkdir(parents=True, exist_ok=True)
        torch.save(obj, folder / rank / "model_optim_rng.pt", **save_kwargs)
    if tracker:
        (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return folder


@pytest.mark.parametrize("zip_format", [True, False])
def test_evil_pickle_is_refused_and_nothing_runs(tmp_path, zip_format, capfd):
    marker = tmp_path / "pwned"
    sd = {"args": argparse.Namespace(num_layers=1), "checkpoint_version": 3.0, "iteration": 1,
          "model": {"embedding.word_embeddings.weight": torch.zeros(4, 2)}, "evil": Evil(marker)}
    folder = _layout_checkpoint(tmp_path / "ckpt", {"mp_rank_00": sd},
                                _use_new_zipfile_serialization=zip_format)
    system = f"{os.system.__module__}.system"  # posix.system on Linux
    with pytest.raises(UnsafeCheckpointError, match=rf"refuses to load ({system}|os\.system)"):
        read_megatron_checkpoint(tmp_path / "ckpt")
    with pytest.raises(UnsafeCheckpointError, match=rf"refuses to load {system}"):
        load_pickle_safely(folder / "mp_rank_00" / "model_optim_rng.pt")
    assert not marker.exists()
    assert "pwned" not in capfd.readouterr().out


def test_other_unsafe_globals_are_refused(tmp_path):
    class Exec:
        def __reduce__(self):
            return (eval, ("1 + 1",))

    for obj, name in [(Exec(), "builtins.eval"), (subprocess.Popen, "subprocess.Popen"),
                      (torch.storage._load_from_bytes, "torch.storage._load_from_bytes")]:
        path = tmp_path / "x.pt"
        torch.save({"x": obj}, path)
        with pytest.raises(UnsafeCheckpointError, match=f"refuses to load {name}"):
            load_pickle_safely(path)


def test_state_set_on_an_allowed_class_is_refused(tmp_path):
    """argparse.Namespace is allowed (Megatron's args); BUILD on the class itself, not on an instance,
    would change it for the whole process: refused, and the class keeps its attributes."""
    path = tmp_path / "x.pt"
    torch.save({"x": 1}, path)
    crafted = (b"\x80\x02cargparse\nNamespace\nN}X\x08\x00\x00\x00__repr__cbuiltins\nset\ns\x86b.")
    import zipfile

    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        parts = {n: zf.read(n) for n in names}
    pkl = next(n for n in names if n.endswith("data.pkl"))
    parts[pkl] = crafted
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for n in names:
            zf.writestr(n, parts[n])
    with pytest.raises(UnsafeCheckpointError, match="refuses to set state"):
        load_pickle_safely(path)
    assert argparse.Namespace.__repr__ is not set


def test_load_pickle_safely_matches_torch_load(tmp_path):
    """Everything torch.load gives for a Megatron-like dict, including rng state with numpy arrays
    (kept as inert records), shared storages, views, bf16 and int tensors."""
    base = torch.randn(6, 4)
    obj = {
        "args": argparse.Namespace(a=1, b="x", c=[1.5, None], d=torch.bfloat16, e=torch.Size([2, 3])),
        "model": {"w": base, "view": base[2:4, 1:], "bf16": torch.randn(3, 5).bfloat16(),
                  "ints": torch.arange(7), "param": torch.nn.Parameter(torch.ones(2))},
        "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                       "torch_rng_state": torch.get_rng_state()}],
        "opt": {"set": {1, 2}, "bytes": b"\x00\xff"},
    }
    for zip_format in (True, False):
        path = tmp_path / f"o{zip_format}.pt"
        torch.save(obj, path, _use_new_zipfile_serialization=zip_format)
        got = load_pickle_safely(path)
        assert vars(got["args"]) == vars(obj["args"])
        for k, v in obj["model"].items():
            assert torch.equal(got["model"][k], v) and got["model"][k].dtype == v.dtype, k
        view = got["model"]["view"]
        assert view.untyped_storage().data_ptr() == got["model"]["w"].untyped_storage().data_ptr()
        assert isinstance(got["model"]["param"], torch.nn.Parameter)
        rng = got["rng_state"][0]
        assert rng["random_rng_state"] == obj["rng_state"][0]["random_rng_state"]
        assert torch.equal(rng["torch_rng_state"], obj["rng_state"][0]["torch_rng_state"])
        assert rng["np_rng_state"][0] == "MT19937" and isinstance(rng["np_rng_state"][1], InertGlobal)
        assert got["opt"] == obj["opt"]


# ------------------------------------------------------------------------------------------------
# synthetic legacy checkpoints (Megatron-LM's legacy GPT model, Megatron-DeepSpeed, the 345M release)

L, H, HEADS, FFN, SEQ, VOCAB = 2, 32, 4, 128, 16, 1000
TP, PP = 2, 2
HD = H // HEADS


def reference_state() -> dict[str, torch.Tensor]:
    cfg = GPTConfig(num_layers=L, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                    seq_length=SEQ, vocab_size=VOCAB, tensor_parallel_size=TP)
    gen = torch.Generator().manual_seed(3)
    shapes = gptrain_shapes(cfg)
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items() if n != "output_layer.weight"}


def to_legacy_qkv(shard: torch.Tensor, version, tp: int) -> torch.Tensor:
    """One tensor-parallel shard's per-head rows [np, 3, hn] in checkpoint_version's order."""
    rest = shard.shape[1:]
    per_head = shard.reshape(HEADS // tp, 3, HD, *rest)
    if version in (0, None):
        stored = per_head.permute(1, 0, 2, *range(3, 3 + len(rest)))  # [3, np, hn]
    elif version == 1.0:
        stored = per_head.permute(0, 2, 1, *range(3, 3 + len(rest)))  # [np, hn, 3]
    else:
        stored = per_head
    return stored.reshape(shard.shape).contiguous()


def legacy_rank_files(ref, version, old_names: bool, tp=TP, pp=PP):
    """Megatron's per-rank files of the legacy GPT model for the full tensors ``ref``."""
    encoder = "transformer" if old_names else "encoder"
    attention = "attention" if old_names else "self_attention"
    per_stage = L // pp
    args = argparse.Namespace(num_layers=L, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                              seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=ref[
                                  "word_embeddings.weight"].shape[0], tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=pp, tokenizer_type="GPT2BPETokenizer")

    def shard(t, dim, r):
        return t.chunk(tp, dim=dim)[r].clone()

    files = {}
    for p in range(pp):
        for r in range(tp):
            enc = {}
            for local in range(per_stage):
                i = p * per_stage + local
                g = lambda n: ref[f"layers.{i}.{n}"]  # noqa: E731
                pre = f"layers.{local}."
                enc[pre + "input_layernorm.weight"] = g("ln1.weight").clone()
                enc[pre + "input_layernorm.bias"] = g("ln1.bias").clone()
                for kind in ("weight", "bias"):
                    qkv = shard(g(f"attn.qkv.{kind}"), 0, r)
                    enc[pre + f"{attention}.query_key_value.{kind}"] = to_legacy_qkv(qkv, version, tp)
                enc[pre + f"{attention}.dense.weight"] = shard(g("attn.proj.weight"), 1, r)
                enc[pre + f"{attention}.dense.bias"] = g("attn.proj.bias").clone()
                enc[pre + "post_attention_layernorm.weight"] = g("ln2.weight").clone()
                enc[pre + "post_attention_layernorm.bias"] = g("ln2.bias").clone()
                enc[pre + "mlp.dense_h_to_4h.weight"] = shard(g("mlp.fc1.weight"), 0, r)
                enc[pre + "mlp.dense_h_to_4h.bias"] = shard(g("mlp.fc1.bias"), 0, r)
                enc[pre + "mlp.dense_4h_to_h.weight"] = shard(g("mlp.fc2.weight"), 1, r)
                enc[pre + "mlp.dense_4h_to_h.bias"] = g("mlp.fc2.bias").clone()
            lm = {encoder: enc}
            model = {"language_model": lm}
            if p == 0:
                lm["embedding"] = {"word_embeddings": {"weight": shard(ref["word_embeddings.weight"], 0, r)},
                                   "position_embeddings": {"weight": ref["position_embeddings.weight"].clone()}}
            if p == pp - 1:
                enc["final_layernorm.weight"] = ref["final_layernorm.weight"].clone()
                enc["final_layernorm.bias"] = ref["final_layernorm.bias"].clone()
                if pp > 1:
                    model["word_embeddings_for_head"] = {"weight": shard(ref["word_embeddings.weight"], 0, r)}
            name = f"mp_rank_{r:02d}" if pp == 1 else f"mp_rank_{r:02d}_{p:03d}"
            sd = {"args": args, "model": model, "iteration": 7, "optimizer": {"state": {0: {"exp_avg": torch.ones(5)}}}}
            if version is not None:
                sd["checkpoint_version"] = version
            files[name] = sd
    return files


@pytest.mark.parametrize("version,old_names,zip_format", [
    (0, True, False),      # the original layout: [3, heads, dim], 'transformer', 'attention', pre-1.6 torch files
    (None, True, True),    # no checkpoint_version: Megatron reads it as 0
    (1.0, False, True),    # [heads, dim, 3]
    (3.0, False, True),    # already [heads, 3, dim]
])
def test_legacy_tp2_pp2_round_trips(tmp_path, version, old_names, zip_format):
    ref = reference_state()
    root = tmp_path / "ckpt"
    _layout_checkpoint(root, legacy_rank_files(ref, version, old_names), iteration=7,
                       _use_new_zipfile_serialization=zip_format)
    before = tree_snapshot(root)
    ck = read_megatron_checkpoint(root)
    assert tree_snapshot(root) == before
    assert (ck.layout, ck.tp, ck.pp, ck.iteration) == ("legacy", TP, PP, 7)
    assert ck.checkpoint_version == (None if version is None else float(version))
    assert ck.output_layer_matches_embeddings is True
    assert set(ck.state) == set(ref)
    for n, t in ref.items():
        assert torch.equal(ck.state[n], t), n
    # the loaded weights compute what the reference computes
    cfg = ck.gpt_config(vocab_size=VOCAB, attention_dropout=0.0, hidden_dropout=0.0)
    model = GPT(cfg).eval()
    model.load_state_dict(ck.model_state_dict(), strict=True)


def test_legacy_qkv_order_matters(tmp_path):
    """Reading a version-0 checkpoint as if it were 3.0 gives different QKV rows (the permutation is real)."""
    ref = reference_state()
    files = legacy_rank_files(ref, 0, old_names=False)
    for sd in files.values():
        sd["checkpoint_version"] = 3.0
    _layout_checkpoint(tmp_path, files, iteration=7)
    ck = read_megatron_checkpoint(tmp_path)
    assert not torch.equal(ck.state["layers.0.attn.qkv.weight"], ref["layers.0.attn.qkv.weight"])
    assert torch.equal(ck.state["layers.0.attn.proj.weight"], ref["layers.0.attn.proj.weight"])


def test_untied_or_unsupported_architectures_are_refused(tmp_path):
    ref = reference_state()
    files = legacy_rank_files(ref, 3.0, old_names=False, tp=1, pp=1)
    files["mp_rank_00"]["args"].qk_layernorm = True  # (the Llama family's flags are read: megatron_llama)
    _layout_checkpoint(tmp_path, files, iteration=7)
    with pytest.raises(ValueError, match="does not support --qk-layernorm"):
        read_megatron_checkpoint(tmp_path)


# ------------------------------------------------------------------------------------------------
# locating checkpoints


def test_tracker_release_and_ckpt_step(tmp_path):
    ref = reference_state()
    files = legacy_rank_files(ref, 3.0, old_names=False, tp=1, pp=1)
    release = _layout_checkpoint(tmp_path / "rel", files, iteration="release")
    assert find_megatron_iteration_dir(tmp_path / "rel") == (release, "release")
    ck = read_megatron_checkpoint(tmp_path / "rel")
    assert ck.iteration == "release" and ck.tp == 1 and ck.pp == 1
    assert torch.equal(ck.state["layers.1.mlp.fc2.weight"], ref["layers.1.mlp.fc2.weight"])

    root = tmp_path / "run"
    _layout_checkpoint(root, files, iteration=10)
    later = {k: {**v, "model": {"language_model": {**v["model"]["language_model"]}}} for k, v in files.items()}
    later["mp_rank_00"]["model"]["language_model"]["embedding"] = {
        "word_embeddings": {"weight": torch.zeros_like(ref["word_embeddings.weight"])},
        "position_embeddings": {"weight": ref["position_embeddings.weight"]}}
    it20 = _layout_checkpoint(root, later, iteration=20)
    assert find_megatron_iteration_dir(root) == (it20, 20)  # the tracker says 20
    assert find_megatron_iteration_dir(root, 10) == (root / "iter_0000010", 10)  # --ckpt-step 10
    assert find_megatron_iteration_dir(root, "10") == (root / "iter_0000010", 10)
    assert find_megatron_iteration_dir(it20) == (it20, 20)  # an iteration folder itself
    assert torch.equal(read_megatron_checkpoint(root, 10).state["word_embeddings.weight"],
                       ref["word_embeddings.weight"])
    assert read_megatron_checkpoint(root).state["word_embeddings.weight"].abs().sum() == 0
    with pytest.raises(FileNotFoundError, match=r"iter_0000015.*available: iter_0000010, iter_0000020"):
        find_megatron_iteration_dir(root, 15)
    (root / "latest_checkpointed_iteration.txt").unlink()
    assert find_megatron_iteration_dir(root) == (it20, 20)  # no tracker: the latest iteration folder
    (root / "latest_checkpointed_iteration.txt").write_text("soon\n")
    with pytest.raises(ValueError, match="latest_checkpointed_iteration.txt: expected an iteration number"):
        find_megatron_iteration_dir(root)
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        find_megatron_iteration_dir(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a Megatron checkpoint"):
        find_megatron_iteration_dir(tmp_path / "empty")


def test_missing_rank_file_is_named(tmp_path):
    ref = reference_state()
    folder = _layout_checkpoint(tmp_path, legacy_rank_files(ref, 3.0, old_names=False), iteration=7)
    (folder / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    with pytest.raises(FileNotFoundError,
                       match=r"mp_rank_01_001/model_optim_rng\.pt: missing.*tensor parallel 2 x pipeline 2"):
        read_megatron_checkpoint(tmp_path)
    (folder / "mp_rank_00_000" / "model_optim_rng.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"mp_rank_00_000/model_optim_rng\.pt: missing"):
        read_megatron_checkpoint(tmp_path)


def test_not_a_checkpoint_file(tmp_path):
    folder = tmp_path / "iter_0000001" / "mp_rank_00"
    folder.mkdir(parents=True)
    (folder / "model_optim_rng.pt").write_bytes(b"not a pickle at all")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(ValueError, match=r"model_optim_rng\.pt: .*not a readable torch checkpoint"):
        read_megatron_checkpoint(tmp_path)


# ---- `gptrain train --load MEGATRON_DIR`: the weights at work in a gptrain run

def _train_flags(data_prefix):
    return ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
            "--micro-batch-size 4 --global-batch-size 8 --lr 1e-3 --split 900,80,20 --seed 1234 --eval-iters 4 "
            "--eval-interval 1000 --train-iters 20 --attention-dropout 0 --hidden-dropout 0 --device cpu "
            f"--data-path {data_prefix} --log-interval 1").split()


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    from gptrain.data.preprocess import PreprocessConfig, preprocess

    root = tmp_path_factory.mktemp("megatron_data")
    texts = [f"document {i}: " + "the model reads tokens and predicts the next one. " * (1 + i % 7) for i in range(200)]
    with open(root / "d.jsonl", "w") as f:
        for t in texts:
            f.write('{"text": "%s"}\n' % t)
    preprocess(PreprocessConfig(inputs=[str(root / "d.jsonl")], output_prefix=str(root / "d"), append_eod=True,
                                workers=1, progress=False))
    return str(root / "d_text_document")


@needs_fixtures
@pytest.mark.parametrize("name", ["dev_tp1", "dev_pp2"])
def test_load_megatron_folder_and_evaluate(name, data_prefix):
    from gptrain.train.run import train_main

    lines = []
    rc = train_main(_train_flags(data_prefix) + ["--load", str(FIXTURES / name), "--skip-train",
                                                 "--softmax-over-padded-vocab"], log=lines.append).exit_code
    assert rc == 0
    assert any(f"loaded Megatron-LM checkpoint from {FIXTURES / name} at iteration 20" in line for line in lines)
    values = [float(line.split("lm loss value: ")[1].split()[0]) for line in lines if "lm loss value" in line]
    # trained 20 iterations on another corpus: below the ~10.83 of an untrained model, finite
    assert len(values) == 2 and all(5.0 < v < 10.8 for v in values)
    assert not any(line.startswith(" iteration") for line in lines)  # --skip-train trains nothing


@needs_fixtures
def test_load_megatron_refuses_a_contradicting_flag(data_prefix, capsys):
    from gptrain.train.run import train_main

    flags = _train_flags(data_prefix)
    flags[flags.index("--hidden-size") + 1] = "32"
    assert train_main(flags + ["--load", str(FIXTURES / "dev_tp1"), "--skip-train"], log=lambda s: None).exit_code == 2
    assert "--hidden-size 32 contradicts the checkpoint's hidden_size 64" in capsys.readouterr().err
