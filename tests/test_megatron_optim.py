"""--load of a Megatron-LM torch_dist checkpoint with optimizer state: megatron-core itself trains a tiny
GPT two iterations (tests/megatron_core_optim.py, its FP32Optimizer over AdamW, one gloo process) on the
samples gptrain's loader reads, and saves as Megatron-LM does. gptrain imports Adam's moments and step
bit for bit, the iteration, consumed samples and lr schedule, and its third iteration gives megatron-core's
third iteration's weights."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gptrain.interop.megatron_keys import map_key

HELPER = Path(__file__).with_name("megatron_core_optim.py")
FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "megatron-ckpt"
VOCAB, GLOBAL_BATCH, SAVED_AT = 1100, 4, 2  # NullTokenizer --vocab-size 1099 (+ eod); padded to 1152
FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         f"--tokenizer-type NullTokenizer --vocab-size {VOCAB - 1} --mock-data --micro-batch-size {GLOBAL_BATCH} "
         f"--global-batch-size {GLOBAL_BATCH} --train-iters 3 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
         "--lr-warmup-iters 1 --weight-decay 0.01 --clip-grad 1.0 --seed 1234 --eval-iters 0 --device cpu "
         "--attention-dropout 0 --hidden-dropout 0 --log-interval 1").split()
RUN = {"model": dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
                     vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0),
       "lr": 1e-3, "min_lr": 1e-4, "warmup_iters": 1, "decay_iters": 3, "decay_style": "cosine", "weight_decay": 0.01,
       "clip_grad": 1.0, "global_batch": GLOBAL_BATCH, "iterations": SAVED_AT}


_RUNS: dict[str, Path] = {}  # one generator run per configuration a session (the tests only read them)


def _megatron_core_run(root: Path, **run) -> Path:
    """megatron-core's checkpoint at iteration 2 (ROOT/megatron/iter_0000002) and ROOT/megatron/reference.pt;
    a configuration already generated this session gives that run's folder instead."""
    key = json.dumps(run, sort_keys=True)
    if key not in _RUNS:
        _RUNS[key] = _generate(root, **run)
    return _RUNS[key]


def _generate(root: Path, **run) -> Path:
    from gptrain.data.samples import samples_main

    # the samples gptrain's training reads in its first three iterations, for megatron-core to train on
    assert samples_main(FLAGS + ["--start", "0", "--count", str(3 * GLOBAL_BATCH),
                                 "--output", str(root / "samples.npy")]) in (0, None)
    (root / "run.json").write_text(json.dumps({**RUN, **run}))
    done = subprocess.run([sys.executable, str(HELPER), str(root / "megatron"), str(root / "samples.npy"),
                           str(root / "run.json")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                              os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return root / "megatron"


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory) -> Path:
    return _megatron_core_run(tmp_path_factory.mktemp("megatron_optim"))


def _config(*extra: str):
    from gptrain.config import parse_megatron_args

    cfg = parse_megatron_args(FLAGS + list(extra))[0]
    cfg.model = dataclasses.replace(cfg.model, vocab_size=VOCAB)  # as the run's tokenizer sets it
    return cfg


def _gptrain_name(megatron_name: str) -> str:
    name, layer, _ = map_key(megatron_name, "megatron-core")
    return name if layer is None else f"layers.{layer}.{name}"


def test_imported_adam_state_is_megatron_cores(megatron_run):
    from gptrain.model.gpt import GPT
    from gptrain.train.build import build_optimizer
    from gptrain.train.checkpoint import init_optimizer_state
    from gptrain.train.megatron_load import load_megatron
    from gptrain.train.schedule import LRSchedule

    cfg = _config()
    params = dict(GPT(cfg.model).named_parameters())
    optimizer = build_optimizer(params, cfg)
    init_optimizer_state(params, optimizer)
    state = load_megatron(megatron_run, params, cfg, optimizer=optimizer,
                          schedule=LRSchedule.from_config(cfg.optim, cfg.train))
    reference = torch.load(megatron_run / "reference.pt")["optimizer_state"]
    assert sorted(map(_gptrain_name, reference)) == sorted(params)  # every parameter has its state, no more
    for megatron_name, theirs in reference.items():
        ours = optimizer.state[params[_gptrain_name(megatron_name)]]
        assert int(ours["step"]) == int(theirs["step"]) == SAVED_AT
        for moment in ("exp_avg", "exp_avg_sq"):  # the padded vocabulary rows too: same padding here
            assert torch.equal(ours[moment], theirs[moment]), (megatron_name, moment)
    assert state["iteration"] == SAVED_AT and state["consumed_train_samples"] == SAVED_AT * GLOBAL_BATCH
    assert state["scheduler"]["num_steps"] == SAVED_AT * GLOBAL_BATCH
    assert state["optimizer"] == (f"optimizer state imported (FP32Optimizer: Adam's moments, step {SAVED_AT}); "
                                  "lr schedule at 8 samples")


def test_training_continues_as_megatron_core_would(megatron_run, tmp_path):
    """One more iteration in gptrain from the import = megatron-core's next iteration on the same batch."""
    from gptrain.interop.convert import read_gptrain
    from gptrain.train.run import train_main

    lines = []
    rc = train_main(FLAGS + ["--load", str(megatron_run), "--save", str(tmp_path / "save"),
                             "--softmax-over-padded-vocab"], log=lines.append).exit_code  # Megatron's loss
    assert rc == 0, "\n".join(lines)
    loaded = [line for line in lines if "loaded Megatron-LM checkpoint" in line]
    assert len(loaded) == 1 and f"at iteration {SAVED_AT}" in loaded[0] and "optimizer state imported" in loaded[0]
    iterations = [line for line in lines if line.startswith(" iteration")]
    assert len(iterations) == 1 and iterations[0].startswith(" iteration        3/       3")
    reference = torch.load(megatron_run / "reference.pt")
    model, state = read_gptrain(tmp_path / "save")
    assert state["iteration"] == 3 and state["consumed_train_samples"] == 3 * GLOBAL_BATCH
    assert state["schedule"]["num_steps"] == 3 * GLOBAL_BATCH
    ours = dict(model.named_parameters())
    worst = 0.0
    for megatron_name, theirs in reference["weights_after_next"].items():
        rows = VOCAB if "word_embeddings" in megatron_name else None  # gptrain's checkpoints keep the real rows
        worst = max(worst, (ours[_gptrain_name(megatron_name)][:rows] - theirs[:rows]).abs().max().item())
    assert worst <= 1e-6, worst
    # the iteration's lr: the schedule's at 8 samples, as megatron-core's scheduler set it
    from gptrain.train.schedule import LRSchedule
    cfg = _config()
    schedule = LRSchedule.from_config(cfg.optim, cfg.train)
    schedule.num_steps = SAVED_AT * GLOBAL_BATCH
    assert schedule.lr() == pytest.approx(reference["next_lr"], rel=1e-12)


def test_distributed_optimizer_buffers_are_refused(tmp_path):
    from gptrain.interop.megatron_optim import OptimizerNotImported, read_optimizer_state

    folder = tmp_path / "iter_0000001"
    dcp.save({"embedding.word_embeddings.weight": torch.zeros(8, 4),
              "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_0.exp_avg": torch.zeros(32)},
             storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    with pytest.raises(OptimizerNotImported, match="distributed optimizer.s buffers"):
        read_optimizer_state(folder)


@pytest.mark.skipif(not (FIXTURES / "dev_dist_tp1").is_dir(), reason="Megatron checkpoint fixtures not found")
def test_a_run_saved_without_optimizer_state_says_so():
    from gptrain.config import parse_megatron_args
    from gptrain.model.gpt import GPT
    from gptrain.train.build import build_optimizer
    from gptrain.train.megatron_load import load_megatron

    cfg = parse_megatron_args("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                              "--max-position-embeddings 64 --mock-data --train-iters 30".split())[0]
    params = dict(GPT(cfg.model).named_parameters())
    state = load_megatron(FIXTURES / "dev_dist_tp1", params, cfg, optimizer=build_optimizer(params, cfg))
    assert state["scheduler"] is None and state["iteration"] == 20
    assert state["optimizer"] == ("the checkpoint holds no optimizer state gptrain reads (saved with "
                                  "--no-save-optim): the optimizer starts fresh")
