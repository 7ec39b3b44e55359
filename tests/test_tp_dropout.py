"""Megatron's dropout under tensor parallelism: outside the tensor-parallel regions every rank draws
the same masks (hashed by position, so a sequence-parallel shard draws its slice of the whole
sequence's mask), inside them (attention) each rank draws its own; the replicated parameters stay
equal on every rank with dropout on; TP2 with and without sequence parallelism give the same
losses; a TP2 run with dropout resumes exactly."""
from __future__ import annotations

import pytest
import torch

from distributed import TINY, losses, spawn, torchrun
from gptrain.model.dropout import hashed_dropout

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _with_dropout(flags: list[str]) -> list[str]:
    out = list(flags)
    for name in ("--hidden-dropout", "--attention-dropout"):
        i = out.index(name)
        del out[i:i + 2]
    return out + DROPOUT


def test_hashed_dropout_keeps_one_minus_p_and_scales():
    x = torch.ones(4, 256, 64)
    y = hashed_dropout(x, 0.1, torch.tensor(7), salt=3)
    kept = (y != 0).float().mean().item()
    assert kept == pytest.approx(0.9, abs=0.005)
    assert torch.allclose(y[y != 0], torch.full_like(y[y != 0], 1 / 0.9))
    assert torch.equal(y, hashed_dropout(x, 0.1, torch.tensor(7), salt=3))  # a function of its inputs


def test_hashed_dropout_masks_are_independent_across_steps_and_sites():
    x = torch.ones(2, 128, 128)
    a = hashed_dropout(x, 0.5, torch.tensor(1), salt=0) != 0
    for other in (hashed_dropout(x, 0.5, torch.tensor(2), salt=0), hashed_dropout(x, 0.5, torch.tensor(1), salt=1),
                  hashed_dropout(x, 0.5, torch.tensor((1 << 16) + 1), salt=0),
                  hashed_dropout(x, 0.5, torch.tensor((1 << 31) + 1), salt=0),  # iteration + 32768 (loop: << 16)
                  hashed_dropout(x, 0.5, torch.tensor((1 << 47) + 1), salt=0)):
        agree = (a == (other != 0)).float().mean().item()
        assert agree == pytest.approx(0.5, abs=0.01)  # uncorrelated masks agree half the time at p = 0.5
    # neighbouring elements, rows and the two halves of the hidden size are uncorrelated too
    assert (a[:, :, :64] == a[:, :, 64:]).float().mean().item() == pytest.approx(0.5, abs=0.01)
    assert (a[0] == a[1]).float().mean().item() == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("shards", [2, 4])
def test_a_sequence_shard_draws_its_slice_of_the_whole_mask(shards):
    x = torch.randn(3, 64, 32)
    whole = hashed_dropout(x, 0.2, torch.tensor(5), salt=9)
    s = 64 // shards
    parts = [hashed_dropout(x[:, i * s:(i + 1) * s], 0.2, torch.tensor(5), salt=9, shard=i, shards=shards)
             for i in range(shards)]
    assert torch.equal(torch.cat(parts, dim=1), whole)


def _replicas_after_training(rank: int, out_path: str, flags: list[str]) -> None:
    from gptrain.config import parse_megatron_args
    from gptrain.data.gpt_dataset import MockGPTDataset
    from gptrain.parallel.dims import init_distributed
    from gptrain.train.build import build_training, parallel_dims
    from gptrain.train.loop import Trainer
    from gptrain.train.run import seed_everything

    cfg, _ = parse_megatron_args(_with_dropout(TINY) + ["--train-iters", "3", "--eval-iters", "0"] + flags,
                                 world_size=2)
    dims = parallel_dims(cfg, 2)
    device = init_distributed(torch.device("cpu"))
    mesh = dims.build_mesh("cpu")
    seed_everything(cfg.data.seed, mesh["tp"].get_local_rank())
    parts = build_training(cfg, device, dims, mesh, log=lambda s: None)
    # what the attention dropout draws from: the process generator's state at each attention call
    from gptrain.model.gpt import CoreAttention

    streams: list[torch.Tensor] = []
    plain_forward = CoreAttention.forward

    def recording_forward(self, *args, **kw):
        if self.training:
            streams.append(torch.get_rng_state())
        return plain_forward(self, *args, **kw)

    CoreAttention.forward = recording_forward
    data = MockGPTDataset("train", 1000, cfg.model.seq_length, cfg.model.vocab_size, cfg.data.seed)
    Trainer(cfg, parts, data, None, None, device, log=lambda s: None).train()
    CoreAttention.forward = plain_forward
    attention_stream = torch.stack(streams)
    from gptrain.parallel.tensor_parallel import split_dim_of

    # the parameters every tensor-parallel rank holds whole (LayerNorms, position embeddings, row-parallel biases)
    whole = {n: p.detach().clone() for n, p in parts.model.named_parameters() if split_dim_of(n) is None}
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, (attention_stream, whole))
    if rank == 0:
        torch.save(gathered, out_path)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--sequence-parallel"]], ids=["tp2", "tp2+sp"])
def test_replicated_parameters_stay_equal_and_attention_streams_differ(flags, tmp_path):
    spawn(2, _replicas_after_training, str(tmp_path / "r.pt"), ["--tensor-model-parallel-size", "2"] + flags)
    (stream0, whole0), (stream1, whole1) = torch.load(tmp_path / "r.pt")
    # inside the regions: at every attention call the ranks' generators differ, so their masks do
    assert len(stream0) == len(stream1) >= 3 * 2
    assert all(not torch.equal(a, b) for a, b in zip(stream0, stream1))
    assert all(not torch.equal(a, b) for a, b in zip(stream0, stream0[1:]))  # each call draws: the state moves
    assert len(whole0) >= 10  # LayerNorms, position embeddings, proj/fc2 biases
    for name, value in whole0.items():
        assert torch.equal(value, whole1[name]), name  # outside: the same masks, so still bit-equal


@pytest.mark.slow
def test_tp2_with_dropout_same_with_sequence_parallel_and_resumes_exactly(tmp_path):
    flags = _with_dropout(TINY) + ["--train-iters", "5", "--tensor-model-parallel-size", "2"]
    straight = losses(torchrun(2, flags))
    # sequence parallelism splits the residual stream, not the masks: the same losses
    sp = losses(torchrun(2, flags + ["--sequence-parallel"]))
    for it, loss in straight.items():
        assert sp[it] == pytest.approx(loss, rel=1e-5), it
    torchrun(2, flags + ["--exit-interval", "3", "--save", str(tmp_path)])
    resumed = losses(torchrun(2, flags + ["--load", str(tmp_path)]))
    assert sorted(resumed) == [4, 5]
    for it in (4, 5):
        assert resumed[it] == straight[it], it  # exact: the counter follows the iteration, RNG states saved
