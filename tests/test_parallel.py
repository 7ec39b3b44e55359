"""Data parallelism and ZeRO on several gloo processes against one process: the same loss at every
iteration and the same weights after the steps (fp32, tiny model, no dropout); the fp16 loss scaler
skipping on every rank when one overflows; exact resume; the same initial weights at every layout;
the layout's checks; a two-"node" launch."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from distributed import TINY, _env, free_port, losses, single, spawn, torchrun
from gptrain.config import parse_megatron_args
from gptrain.model.gpt import GPT
from gptrain.train.build import parallel_dims
from gptrain.train.checkpoint import load_checkpoint

STEPS = ["--train-iters", "5"]


def _weights(ckpt_dir, argv) -> dict[str, torch.Tensor]:
    """A checkpoint written at any layout, read into one plain model (DCP reshards on load)."""
    cfg, _ = parse_megatron_args(argv + ["--train-iters", "1"], world_size=1)
    model = GPT(cfg.model)
    load_checkpoint(ckpt_dir, dict(model.named_parameters()), None, cfg.model.vocab_size)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    path = tmp_path_factory.mktemp("single")
    out = single(TINY + STEPS + ["--save", str(path)])
    return losses(out), _weights(path, TINY), _grad_norms(out)


@pytest.mark.parametrize("flags", [[], ["--use-distributed-optimizer"], ["--zero-stage", "2"], ["--zero-stage", "3"],
                                   ["--zero-stage", "2", "--cpu-offload"]],
                         ids=["dp2", "zero1", "zero2", "zero3", "zero2-offload"])
@pytest.mark.slow
def test_data_parallel_and_zero_equal_one_process(flags, one_process, tmp_path):
    """Every data-parallel layout equals one process: losses, gradient norms (with offload summed on each rank's
    GPU side before the host copies, then over the ranks) and the saved weights."""
    ref_losses, ref_weights, ref_norms = one_process
    out = torchrun(2, TINY + STEPS + flags + ["--save", str(tmp_path)])
    got = losses(out)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for it, loss in ref_losses.items():
        assert got[it] == pytest.approx(loss, rel=1e-5), it
    assert len(ref_norms) == 5 and _grad_norms(out) == pytest.approx(ref_norms, rel=1e-5)
    assert "using world size: 2, data-parallel-size: 2" in out
    assert " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 1636224" in out
    weights = _weights(tmp_path, TINY)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_resume_at_the_same_layout_is_exact(tmp_path):
    flags = TINY + ["--zero-stage", "3", "--train-iters", "6"]
    straight = losses(torchrun(2, flags + ["--save", str(tmp_path / "a")]))
    torchrun(2, flags + ["--save", str(tmp_path / "b"), "--exit-interval", "3"])
    resumed = losses(torchrun(2, flags + ["--load", str(tmp_path / "b"), "--save", str(tmp_path / "b")]))
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[i] == straight[i] for i in (4, 5, 6))
    a, b = _weights(tmp_path / "a", TINY), _weights(tmp_path / "b", TINY)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_two_nodes_through_c10d_rendezvous(one_process):
    """Two torchrun launchers of one process each meet at a c10d rendezvous, as two nodes would."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
           "-m", "gptrain", "train", *TINY, *STEPS]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
             for _ in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs[0][-3000:] + outputs[1][-3000:]
    got = next(losses(out) for out in outputs if losses(out))  # one launcher holds global rank 0
    for it, loss in one_process[0].items():
        assert got[it] == pytest.approx(loss, rel=1e-5)


# ---- fp16: an overflow on one rank skips the step on every rank

def _fp16_run(rank: int, bad_call: int, out_path: str, flags: list[str]) -> None:
    from gptrain.model.gpt import GPT as Model
    from gptrain.train.run import train_main

    world = int(__import__("os").environ["WORLD_SIZE"])
    original, calls = Model.forward, [0]

    def forward(self, tokens):
        h = original(self, tokens)
        if self.training:
            calls[0] += 1
            if rank == world - 1 and calls[0] == bad_call:
                h = h * float("inf")
        return h

    Model.forward = forward
    lines = []
    rc = train_main(TINY + ["--fp16", "--train-iters", "5", "--initial-loss-scale", "1024", "--hysteresis", "1"]
                    + flags, log=lines.append).exit_code
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"rc": rc, "lines": lines}, f)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--use-distributed-optimizer"]], ids=["dp2", "distributed-optimizer"])
def test_fp16_overflow_on_one_rank_skips_on_all(flags, tmp_path):
    # step 3's last micro-batch overflows: in one process that is its 4th micro-batch of the step
    spawn(1, _fp16_run, 3 * 4, str(tmp_path / "one.json"), [])
    # at DP2 each rank runs 2 micro-batches per step: the last rank's 6th forward is in step 3
    spawn(2, _fp16_run, 3 * 2, str(tmp_path / "two.json"), flags)
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert one["rc"] == two["rc"] == 0
    it = [[line for line in run["lines"] if line.startswith(" iteration")] for run in (one, two)]
    for a, b in zip(*it):
        assert a.split("| elapsed")[0] == b.split("| elapsed")[0]
    third = it[1][2]
    assert "number of skipped iterations:   1" in third and "lm loss" not in third
    assert "loss scale: 512.0" in it[1][3]  # halved once, on every rank alike
    for a, b in zip(*it):
        la, lb = (float(x.split("lm loss: ")[1].split()[0]) if "lm loss" in x else None for x in (a, b))
        assert (la is None and lb is None) or la == pytest.approx(lb, rel=1e-3)


# ---- initial weights: the same full tensors at every layout

def _initial_weights(rank: int, flags: list[str], out_path: str) -> None:
    from gptrain.parallel.dims import init_distributed
    from gptrain.train.build import build_training

    world = int(__import__("os").environ["WORLD_SIZE"])
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1"] + flags, world_size=world)
    dims = parallel_dims(cfg, world)
    device = init_distributed(torch.device("cpu"))
    parts = build_training(cfg, device, dims, dims.build_mesh("cpu"), log=lambda s: None)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in parts.model.named_parameters()}
    if rank == 0:
        torch.save(full, out_path)
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None


@pytest.mark.slow
def test_initial_weights_are_equal_at_every_layout(tmp_path):
    spawn(1, _initial_weights, [], str(tmp_path / "one.pt"))
    spawn(2, _initial_weights, ["--zero-stage", "3"], str(tmp_path / "zero3.pt"))
    spawn(2, _initial_weights, [], str(tmp_path / "dp2.pt"))
    one = torch.load(tmp_path / "one.pt")
    for name in ("zero3", "dp2"):
        other = torch.load(tmp_path / f"{name}.pt")
        assert other.keys() == one.keys() and all(torch.equal(other[k], one[k]) for k in one), name
    assert one["word_embeddings.weight"][50257:].abs().max() == 0  # padded rows start at zero


# ---- the layout's checks, before any work

@pytest.mark.parametrize("world, flags, message", [
    (3, ["--tensor-model-parallel-size", "2"], "world size 3 is not divisible by tensor-model-parallel size 2 x "
                                               "pipeline-model-parallel size 1 = 2"),
    (4, ["--tensor-model-parallel-size", "4", "--num-attention-heads", "6", "--hidden-size", "48"],
     "--num-attention-heads 6 is not divisible by tensor-model-parallel size 4"),
    (4, ["--pipeline-model-parallel-size", "4", "--num-layers", "6"],
     "--num-layers 6 is not divisible by pipeline-model-parallel size 4"),
    (4, ["--global-batch-size", "6"], "--global-batch-size 6 is not divisible by --micro-batch-size 2 x "
                                      "data-parallel size 4 = 8"),
    (2, ["--cpu-offload"], "--cpu-offload needs --zero-stage 1, 2 or 3 (got 0): the offloaded state is FSDP2's shards"),
    (4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "3"], "--zero-stage 3 with pipeline parallelism: use "
                                                                         "ZeRO-1"),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
     "--num-layers-per-virtual-pipeline-stage 2 does not divide the 1 layers of each pipeline stage"),
    (2, ["--zero-stage", "2", "--overlap-cpu-optimizer-d2h-h2d"],
     "--overlap-cpu-optimizer-d2h-h2d overlaps the host's optimizer step: it needs --cpu-offload"),
    (2, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1", "--cpu-offload", "--overlap-cpu-optimizer-d2h-h2d"],
     "--overlap-cpu-optimizer-d2h-h2d with pipeline parallelism is not built yet"),
    (2, ["--high-priority-stream-groups", "tp", "ep", "cp"],
     "--high-priority-stream-groups ep cp: gptrain's groups are tp, dp (dp_cp) and pp"),
])
def test_impossible_layouts_are_refused_with_their_numbers(world, flags, message):
    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1"] + flags, world_size=world)
    with pytest.raises(ValueError) as err:
        parallel_dims(cfg, world)
    assert message in str(err.value)


@pytest.mark.slow
def test_torchrun_error_is_one_line_from_one_rank():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gptrain",
           "train", *TINY, "--train-iters", "1", "--global-batch-size", "6"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("gptrain: error:")]
    assert errors == ["gptrain: error: --global-batch-size 6 is not divisible by --micro-batch-size 2 x "
                      "data-parallel size 2 = 4"]
    # the other rank, stopped by torchrun while it waits, goes without a traceback
    assert not [line for line in done.stderr.splitlines() if line.startswith("[rank") and "Traceback" in line]


def test_deepspeed_config_of_the_seeds_maps_onto_zero3_with_offload(tmp_path):
    ds = tmp_path / "deepspeed_config.json"
    ds.write_text('{"fp16": {"enabled": true}, "zero_optimization": {"stage": 3, "allgather_partitions": true, '
                  '"allgather_bucket_size": 2e8, "overlap_comm": true, "reduce_scatter": true, "reduce_bucket_size": '
                  '2e8, "contiguous_gradients": true, "cpu_offload": true}}')
    cfg, notes = parse_megatron_args(TINY + ["--train-iters", "1", "--micro-batch-size", "1", "--global-batch-size",
                                             "4", "--deepspeed_config", str(ds)], world_size=4)
    assert cfg.parallel.zero_stage == 3 and cfg.parallel.cpu_offload and cfg.precision.fp16
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size) == (1, 4)
    assert any("allgather_bucket_size" in n for n in notes)
    assert parallel_dims(cfg, 4).dp == 4
    with pytest.raises(ValueError, match="contradicts --bf16"):
        parse_megatron_args(TINY + ["--train-iters", "1", "--bf16", "--deepspeed_config", str(ds)], world_size=4)


@pytest.mark.slow
def test_zero_on_one_process_is_one_device(one_process):
    """Megatron scripts pass --use-distributed-optimizer on one GPU: ZeRO over one rank shards nothing."""
    out = single(TINY + STEPS + ["--use-distributed-optimizer"])
    assert "one device: whole model" in out
    assert losses(out) == one_process[0]


@pytest.mark.slow
def test_fp16_checkpoint_before_the_first_update_resumes(tmp_path):
    """fp16's first steps are skipped at the initial loss scale, so AdamW has taken no step yet when
    this checkpoint is written; its state must still be complete."""
    flags = TINY + ["--fp16", "--train-iters", "3"]
    single(flags + ["--train-iters", "2", "--save", str(tmp_path)])
    out = single(flags + ["--load", str(tmp_path), "--save", str(tmp_path)])
    assert "successfully loaded checkpoint" in out and sorted(losses(out)) in ([], [3])
    assert "number of skipped iterations:   1" in next(l for l in out.splitlines() if l.startswith(" iteration"))


@pytest.mark.slow
def test_overlapped_reduction_equals_the_reduction_after_the_backward_in_bf16():
    """bf16 parameters, fp32 main gradients sent in bf16 (--grad-reduce-in-bf16): reducing bucket by
    bucket during the last micro-batch's backward gives the same numbers as one all-reduce after it.
    (fp32 parameters with overlap against one process: test_tensor_parallel.py's tp2+spxdp2-overlap.)"""
    flags = TINY + ["--train-iters", "3", "--bf16", "--grad-reduce-in-bf16"]
    plain = losses(torchrun(2, flags))
    overlapped = torchrun(2, flags + ["--overlap-grad-reduce", "--ddp-bucket-size", "20000", "--verbose"])
    assert losses(overlapped) == plain and len(plain) == 3
    assert "overlapped with the backward in buckets of 20,000 elements" in overlapped
    assert "gradients all-reduced in bf16 in buckets during the last micro-batch's backward" in overlapped


def test_buckets_launch_as_their_gradients_arrive():
    from gptrain.parallel import simulate
    from gptrain.parallel.grad_buckets import GradBuckets

    flat = torch.ones(100)
    views = [flat[0:30], flat[30:60], flat[60:90], flat[90:100]]
    with simulate.simulated_world(2, 0):  # collectives return at once
        buckets = GradBuckets(flat, views, torch.distributed.group.WORLD, 2, bucket_size=60)
        # from the end of the buffer (the backward's first gradients): [60, 100) then [0, 60)
        assert buckets.spans == [(60, 100), (0, 60)]
        buckets.arm(False)
        buckets.arrived(3)
        assert buckets._pending == []  # not the step's last micro-batch: nothing reduced
        buckets.arm(True)
        buckets.arrived(3)
        assert buckets._pending == []
        buckets.arrived(2)  # the last bucket is complete: averaged and launched at once
        assert len(buckets._pending) == 1 and torch.all(flat[60:] == 0.5) and torch.all(flat[:60] == 1)
        buckets.arrived(1)
        buckets.wait()  # a bucket whose gradients did not all arrive is launched by wait()
        assert torch.all(flat == 0.5) and buckets._pending == []


# ---- initial weights through checkpoints: a step at learning rate 0 saves the initial weights as full tensors

_LR0 = TINY + ["--lr", "0", "--min-lr", "0", "--train-iters", "1", "--eval-iters", "0", "--num-layers", "4"]


def _saved_weights(path) -> dict[str, torch.Tensor]:
    from gptrain.model.gpt import GPT
    from gptrain.train.checkpoint import load_checkpoint

    cfg, _ = parse_megatron_args(_LR0)
    model = GPT(cfg.model)
    load_checkpoint(str(path), dict(model.named_parameters()), None, cfg.model.vocab_size)
    return {k: p.detach().clone() for k, p in model.named_parameters()}


@pytest.fixture(scope="module")
def one_process_initial_weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("init") / "one"
    single(_LR0 + ["--save", str(path)])
    return _saved_weights(path)


@pytest.mark.slow
@pytest.mark.parametrize("world, flags", [
    (4, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1", "--zero-stage", "1"]),
    (2, ["--zero-stage", "2"])], ids=["pp2-virtual-zero1-dp2", "zero2"])  # ZeRO-3, DP and TP: tests above, test_simulate
def test_initial_weights_equal_one_process_bitwise(tmp_path, one_process_initial_weights, world, flags):
    torchrun(world, _LR0 + ["--save", str(tmp_path / "ckpt"), *flags])
    weights = _saved_weights(tmp_path / "ckpt")
    one = one_process_initial_weights
    assert weights.keys() == one.keys()
    assert [k for k in one if not torch.equal(weights[k], one[k])] == []


@pytest.mark.slow
def test_cpu_offload_on_one_process_equals_the_plain_run_overlapped_too_and_resumes_exactly(tmp_path):
    """ZeRO-Offload at one data-parallel rank (FSDP2 over a group of one): the plain run's losses, gradient norms
    (summed on the device before the host copies, parallel/reduced_grad_norm.py) and validation losses, by the
    flags and by a DeepSpeed config's offload_optimizer at stage 3 and 2, with several micro-batches per step
    (the gradients accumulate on the device). With --overlap-cpu-optimizer-d2h-h2d (the host's AdamW on a
    thread, block by block, each block's next forward waiting for its update) the same, and a run resumed from
    its checkpoint in the middle equals the straight one (the save waits for the step in flight)."""
    args = TINY + ["--train-iters", "4", "--eval-iters", "1", "--eval-interval", "2"]
    plain_out = single(args)
    plain, plain_norms = losses(plain_out), _grad_norms(plain_out)
    assert plain.keys() == {1, 2, 3, 4} and len(plain_norms) == 4 and len(_validation(plain_out)) == 2
    ds2 = tmp_path / "ds2.json"
    ds2.write_text('{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}')
    ckpt = str(tmp_path / "ckpt")
    overlap = ["--zero-stage", "2", "--cpu-offload", "--overlap-cpu-optimizer-d2h-h2d"]
    # ds.json's stage-3 offload_optimizer maps onto the same flags (tests/test_deepspeed_config.py)
    for stage, extra in ((3, ["--zero-stage", "3", "--cpu-offload"]), (2, ["--deepspeed", "--deepspeed_config", str(ds2)]),
                         (2, overlap + ["--save", ckpt, "--save-interval", "2"])):
        out = single(args + extra)
        assert f"ZeRO-{stage} over 1 rank on FSDP2" in out and "in host memory" in out, out[-2000:]
        assert re.search(r"> host memory \(--cpu-offload\): peak resident [0-9.]+ GiB on rank 0", out)
        offloaded = losses(out)
        assert offloaded.keys() == plain.keys()
        assert all(offloaded[k] == pytest.approx(plain[k], abs=1e-5) for k in plain), (extra, offloaded, plain)
        assert _grad_norms(out) == pytest.approx(plain_norms, rel=1e-5), extra
        assert _validation(out) == pytest.approx(_validation(plain_out), abs=1e-5)
    assert "host's AdamW on a thread" in out, out[-2000:]
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = losses(single(args + overlap + ["--load", ckpt]))
    assert resumed.keys() == {3, 4} and all(resumed[k] == offloaded[k] for k in (3, 4)), (resumed, offloaded)


def _grad_norms(out: str) -> list[float]:
    return [float(m) for m in re.findall(r"\| grad norm: (\S+) \|", out)]


def _validation(out: str) -> list[float]:
    return [float(m) for m in re.findall(r"validation loss at iteration \d+ \| lm loss value: (\S+)", out)]
