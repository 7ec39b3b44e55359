"""parallel/distributed_optimizer.py: ZeRO-1 on whole replicas (Megatron's distributed optimizer) against plain
data parallelism (bitwise in bf16: the same sums, the same element-wise AdamW), against one process with rows
that do not split evenly over three ranks, and its checkpoints resumed at other layouts (gloo, CPU)."""
from __future__ import annotations

import pytest
import torch

from distributed import TINY, losses, single, torchrun
from gptrain.config import parse_megatron_args
from gptrain.model.gpt import GPT
from gptrain.train.checkpoint import load_checkpoint

ROWS = ["--use-distributed-optimizer"]


def _weights(ckpt_dir, argv) -> dict[str, torch.Tensor]:
    cfg, _ = parse_megatron_args(argv + ["--train-iters", "1"], world_size=1)
    model = GPT(cfg.model)
    load_checkpoint(ckpt_dir, dict(model.named_parameters()), None, cfg.model.vocab_size)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _line(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(start))


@pytest.mark.slow
@pytest.mark.parametrize("reduce", [[], ["--grad-reduce-in-bf16"]], ids=["fp32-reduction", "bf16-reduction"])
def test_rows_equal_plain_data_parallel_bitwise_in_bf16(reduce, tmp_path):
    """Two micro-batches a step (the copy, then the add into the gradient buffer), bf16 parameters: the
    reduce-scatter sums what the all-reduce sums and AdamW is element-wise, so the losses and the saved
    weights are the same bits as plain data parallelism's."""
    run = TINY + ["--bf16", "--train-iters", "4"] + reduce
    plain = torchrun(2, run + ["--save", str(tmp_path / "dp")])
    rows = torchrun(2, run + ROWS + ["--save", str(tmp_path / "rows")])
    assert "as Megatron's distributed optimizer" in _line(rows, " > parameters:")
    assert "all-reduced" in _line(plain, " > parameters:")
    assert losses(rows) == losses(plain) and sorted(losses(rows)) == [1, 2, 3, 4]
    a, b = _weights(tmp_path / "dp", TINY), _weights(tmp_path / "rows", TINY)
    assert all(torch.equal(a[k], b[k]) for k in a)


UNEVEN = TINY + ["--micro-batch-size", "1", "--global-batch-size", "6", "--lr-decay-iters", "5"]


@pytest.mark.slow
def test_uneven_rows_over_three_ranks_equal_one_process_and_resume_elsewhere(tmp_path):
    """Hidden size 32 over three ranks: rows of 11, 11 and 10 (the last block padded). The same losses and
    weights as one process; its checkpoint (iteration 3) resumes at two ranks of the distributed optimizer
    and in one process with the straight run's next losses."""
    straight = single(UNEVEN + ["--train-iters", "5", "--save", str(tmp_path / "one")])
    three = torchrun(3, UNEVEN + ROWS + ["--train-iters", "5", "--save", str(tmp_path / "three")])
    ref, got = losses(straight), losses(three)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for it, loss in ref.items():
        assert got[it] == pytest.approx(loss, rel=1e-5), it
    # summed in another order over three ranks: Adam turns the rounding of near-zero gradients (a few word
    # embedding rows, the key bias) into differences of up to 1e-5 after 5 steps, as in test_tensor_parallel.py
    a, b = _weights(tmp_path / "one", TINY), _weights(tmp_path / "three", TINY)
    for name, w in a.items():
        torch.testing.assert_close(b[name], w, rtol=1e-5, atol=2e-5, msg=name)

    torchrun(3, UNEVEN + ROWS + ["--train-iters", "5", "--exit-interval", "3", "--save", str(tmp_path / "ck")])
    for resume in (lambda argv: torchrun(2, argv + ROWS), single):
        out = resume(UNEVEN + ["--train-iters", "5", "--load", str(tmp_path / "ck")])
        resumed = losses(out)
        assert sorted(resumed) == [4, 5]
        for it in (4, 5):
            assert resumed[it] == pytest.approx(ref[it], rel=1e-5), (it, resumed, ref)


@pytest.mark.slow
def test_a_megatron_distributed_optimizer_checkpoint_continues_on_two_ranks(tmp_path):
    """megatron-core's bf16 run with its distributed optimizer (dp_reshardable), saved at iteration 2, loaded into
    two ranks of gptrain's: the fp32 main weights and moments imported into each rank's rows, and one more
    iteration as one process continues it. Their bf16 gradients come from other micro-batch splits (two a rank
    against one), so Adam's update differs as test_megatron_optim_bf16.py's comparison with megatron-core allows:
    per tensor at most 5% of the update, at most twice the learning rate anywhere."""
    from gptrain.interop.convert import read_gptrain
    from test_megatron_optim import FLAGS, VOCAB, _gptrain_name, _megatron_core_run
    from test_megatron_optim_bf16 import _without_key_bias

    folder = _megatron_core_run(tmp_path, precision="bf16", distributed="dp_reshardable")
    run = FLAGS + ["--bf16", "--load", str(folder), "--softmax-over-padded-vocab"]
    one = single(run + ["--save", str(tmp_path / "one")])
    two = torchrun(2, run + ROWS + ["--micro-batch-size", "2", "--save", str(tmp_path / "two")])
    for out in (one, two):
        assert "fp32 main weights, Adam's moments" in _line(out, "  loaded Megatron-LM checkpoint")
    assert "as Megatron's distributed optimizer" in _line(two, " > parameters:")
    assert losses(two)[3] == pytest.approx(losses(one)[3], rel=1e-5)
    (a, _), (b, _) = read_gptrain(tmp_path / "one"), read_gptrain(tmp_path / "two")
    theirs, mine = dict(a.named_parameters()), dict(b.named_parameters())
    reference = torch.load(folder / "reference.pt")
    for megatron_name, state in reference["optimizer_state"].items():
        name, rows = _gptrain_name(megatron_name), VOCAB if "word_embeddings" in megatron_name else None
        before = state["fp32_param"][:rows]
        difference, update = (_without_key_bias(megatron_name, t) for t in
                              (mine[name][:rows] - theirs[name][:rows], theirs[name][:rows] - before))
        assert difference.norm() <= 0.05 * update.norm(), (name, difference.norm() / update.norm())
        assert (mine[name][:rows] - theirs[name][:rows]).abs().max() <= 2 * reference["next_lr"], name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-params", "fp32-params"])
def test_the_buffers_hold_memory_only_while_used(dtype):
    """One process (a group of one): the whole-gradient buffer is held from the first micro-batch to the reduction
    and again for the all-gather only, so a skipped fp16 step (no all-gather) leaves nothing held; the reduced rows
    until the update. With fp32 parameters the model's own rows are the main weights (no copy)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from distributed import free_port
    from gptrain.parallel.collectives import local
    from gptrain.parallel.distributed_optimizer import ShardedMainParams

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
        rows = ShardedMainParams(model, dtype, init_device_mesh("cpu", (1,)))
        held = lambda t: t.untyped_storage().nbytes() > 0  # noqa: E731
        assert rows.in_place == (dtype == torch.float32) and not held(rows.grad_flat) and not held(rows.shard_grad)
        model(torch.randn(2, 4, dtype=dtype)).float().sum().backward()
        rows.accumulate_grads()
        assert held(rows.grad_flat) and all(p.grad is None for p in model.parameters())
        rows.reduce_scatter()
        assert not held(rows.grad_flat) and held(rows.shard_grad)
        assert rows.grad_squares() > 0
        rows.release_grads()  # a skipped step: no update, no all-gather
        assert not held(rows.grad_flat) and not held(rows.shard_grad)
        with torch.no_grad():
            for m in rows.main:
                local(m).add_(1.0)
        rows.copy_to_model()
        assert not held(rows.grad_flat)
        for p, m in zip(model.parameters(), rows.main):
            assert torch.equal(p.float(), local(m).to(dtype).float())
    finally:
        dist.destroy_process_group()
