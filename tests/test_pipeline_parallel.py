"""Pipeline parallelism (torch.distributed.pipelining) against one process: the same losses at PP2
1F1B, PP2 interleaved (4 layers, 2 virtual stages per rank), TP2 x PP2 and PP2 x ZeRO-1 (fp32, tiny
model, no dropout); the tied word-embedding copies of the first and last stage stay equal;
checkpoints move between a pipeline layout and one process both ways."""
from __future__ import annotations

import pytest
import torch

from distributed import TINY, losses, single, spawn, torchrun

STEPS = ["--train-iters", "5"]


def _layers(n: int) -> list[str]:
    flags = list(TINY)
    flags[flags.index("--num-layers") + 1] = str(n)
    return flags


@pytest.fixture(scope="module")
def one_process():
    return {2: losses(single(_layers(2) + STEPS)), 4: losses(single(_layers(4) + STEPS))}


@pytest.mark.slow
@pytest.mark.parametrize("nproc, layers, flags, schedule", [
    (2, 2, ["--pipeline-model-parallel-size", "2"], "1F1B"),
    (2, 4, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
     "interleaved 1F1B, 2 virtual stages per rank"),
    (4, 2, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
     "1F1B"),
    (4, 2, ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"], "1F1B"),
    (2, 4, ["--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "1"], "1F1B"),
], ids=["pp2", "pp2-interleaved", "tp2xpp2+sp", "pp2xzero1", "pp2-uneven-3+1"])
def test_pipeline_equals_one_process(nproc, layers, flags, schedule, one_process):
    out = torchrun(nproc, _layers(layers) + STEPS + flags)
    got, ref = losses(out), one_process[layers]
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5]
    for it, loss in ref.items():
        assert got[it] == pytest.approx(loss, rel=1e-5), it
    assert f"pipeline-model-parallel size: 2" in out
    assert f" > pipeline: 2 stages ({schedule})" in out


def test_uneven_stage_split_follows_megatron_flags():
    from gptrain.config import parse_megatron_args
    from gptrain.model.gpt import GPT
    from gptrain.parallel.dims import ParallelDims
    from gptrain.parallel.layout import parameter_counts
    from gptrain.parallel.pipeline import stage_layer_counts, stage_plan

    assert stage_layer_counts(24, 2) == [12, 12]
    assert stage_layer_counts(24, 2, last=10) == [14, 10]
    assert stage_layer_counts(24, 4, last=3) == [7, 7, 7, 3]
    assert stage_layer_counts(24, 4, first=5, last=3) == [5, 8, 8, 3]
    assert [stage_plan(24, 4, r, 1, None, 3).layers[0] for r in (0, 3)] == [tuple(range(7)), (21, 22, 23)]
    for args, message in [((24, 4, None, 4), "leaves 20 layers, which do not split evenly over the other 3"),
                          ((24, 2, 10, 10), "must equal --num-layers 24"), ((24, 2, None, 24), "between 1 and")]:
        with pytest.raises(ValueError, match=message):
            stage_layer_counts(*args)
    # per-rank counts: the layers move, the embeddings stay with the first and last stage
    cfg, _ = parse_megatron_args("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
                                 "--max-position-embeddings 1024 --mock-data --train-iters 1".split(), world_size=1)
    with torch.device("meta"):
        total = sum(p.numel() for p in GPT(cfg.model).parameters())
    layer = 12 * 1024 ** 2 + 13 * 1024
    even = parameter_counts(cfg.model, ParallelDims(world_size=4, tp=1, pp=4))
    uneven = parameter_counts(cfg.model, ParallelDims(world_size=4, tp=1, pp=4), None, 3)
    assert even[(0, 0)] == 128137216 and even[(0, 3)] == 127090688  # seeds/004's PP4 figures
    assert uneven[(0, 0)] == even[(0, 0)] + layer and uneven[(0, 3)] == even[(0, 3)] - 3 * layer
    assert sum(uneven.values()) == total + cfg.model.padded_vocab_size * 1024  # + the last stage's copy


@pytest.mark.slow  # the fast loop (-m "not slow") stays under 3 minutes; CI runs it
def test_uneven_split_refuses_interleaving():
    with pytest.raises(AssertionError, match="with --num-layers-per-virtual-pipeline-stage is not built"):
        torchrun(2, _layers(4) + STEPS + ["--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers",
                                          "1", "--num-layers-per-virtual-pipeline-stage", "1"], timeout=60)


def _tied_copies(rank: int, out_path: str) -> None:
    from gptrain.config import parse_megatron_args
    from gptrain.data.gpt_dataset import MockGPTDataset
    from gptrain.parallel.dims import init_distributed
    from gptrain.train.build import build_training, parallel_dims
    from gptrain.train.loop import Trainer

    cfg, _ = parse_megatron_args(_layers(2) + ["--train-iters", "3", "--pipeline-model-parallel-size", "2",
                                               "--eval-iters", "0"], world_size=2)
    cfg.model.vocab_size = 50257
    dims = parallel_dims(cfg, 2)
    device = init_distributed(torch.device("cpu"))
    parts = build_training(cfg, device, dims, dims.build_mesh("cpu"), log=lambda s: None)
    data = MockGPTDataset("train", 1000, cfg.model.seq_length, cfg.model.vocab_size, cfg.data.seed)
    before = parts.model.word_embeddings.weight.detach().clone()
    Trainer(cfg, parts, data, None, None, device, log=lambda s: None).train()
    after = parts.model.word_embeddings.weight.detach().clone()
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, (before, after, sorted(parts.opt_params)))
    if rank == 0:
        torch.save(gathered, out_path)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_tied_embedding_copies_stay_equal(tmp_path):
    path = tmp_path / "copies.pt"
    spawn(2, _tied_copies, str(path))
    (first_before, first_after, first_names), (last_before, last_after, last_names) = torch.load(path)
    assert torch.equal(first_before, last_before)  # initialised equal
    assert not torch.equal(first_before, first_after)  # trained
    assert torch.equal(first_after, last_after)  # the summed gradient keeps them equal, bit for bit
    assert "position_embeddings.weight" in first_names and "position_embeddings.weight" not in last_names
    assert "final_layernorm.weight" in last_names and "final_layernorm.weight" not in first_names
    assert [n for n in first_names if n.startswith("layers.1.")] == []
    assert [n for n in last_names if n.startswith("layers.0.")] == []


@pytest.mark.slow
def test_checkpoints_move_between_pipeline_layouts_and_one_process(one_process, tmp_path):
    flags = _layers(2) + STEPS
    ref = one_process[2]
    # saved at TP2 x PP2 after 3 iterations, resumed by one process
    torchrun(4, flags + ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                         "--exit-interval", "3", "--save", str(tmp_path / "tp2pp2")])
    resumed = losses(single(flags + ["--load", str(tmp_path / "tp2pp2")]))
    assert sorted(resumed) == [4, 5]
    # saved by one process, resumed at PP2
    single(flags + ["--exit-interval", "3", "--save", str(tmp_path / "one")])
    resumed_pp = losses(torchrun(2, flags + ["--pipeline-model-parallel-size", "2", "--load", str(tmp_path / "one")]))
    assert sorted(resumed_pp) == [4, 5]
    for it in (4, 5):
        assert resumed[it] == pytest.approx(ref[it], rel=1e-5)
        assert resumed_pp[it] == pytest.approx(ref[it], rel=1e-5)
