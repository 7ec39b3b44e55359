"""--optimizer-offload-fraction (Megatron-LM's flag): which FSDP2 units keep their state in host memory, the
flags that reach it, and what the planner makes of it."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from gptrain.config import parse_megatron_args
from gptrain.parallel.deepspeed_config import parse_deepspeed_config
from gptrain.parallel.offload_split import offloaded_count, offloaded_modules
from gptrain.train.build import parallel_dims

from tiny import TINY_FLAGS

RUN = ["--mock-data", "--train-iters", "1", "--micro-batch-size", "2", "--global-batch-size", "2"]


@pytest.mark.parametrize("sizes, fraction, count", [
    ([10, 5, 5, 5, 5], 1.0, 5),  # everything, the root too
    ([10, 5, 5, 5, 5], 0.99, 4),  # every block, never the root below 1
    ([10, 5, 5, 5, 5], 0.5, 3),  # three blocks reach half of 30
    ([10, 5, 5, 5, 5], 0.2, 2),  # 5 < 6, then 10 >= 6: Megatron's rule, the threshold reached or passed
    ([10, 5, 5, 5, 5], 0.01, 1),  # at least one block for any fraction above 0
    ([10, 5, 5, 5, 5], 1 / 6, 1),  # exactly one block's share
])
def test_units_are_offloaded_from_the_last_block_until_the_fraction_is_reached(sizes, fraction, count):
    assert offloaded_count(sizes, fraction) == count


def test_the_modules_offloaded_are_the_last_blocks_and_the_root_only_at_one():
    root = nn.Module()
    root.embed = nn.Linear(10, 10, bias=False)  # 100
    blocks = [nn.Linear(5, 5, bias=False) for _ in range(4)]  # 25 each
    root.blocks = nn.ModuleList(blocks)
    assert offloaded_modules([root], blocks, 1.0) == {root, *blocks}
    assert offloaded_modules([root], blocks, 0.25) == {blocks[3], blocks[2]}  # 25 < 50, then 50 >= 50
    assert offloaded_modules([root], blocks, 0.9) == set(blocks)


@pytest.mark.parametrize("flags, message", [
    (["--optimizer-offload-fraction", "0.5"], "--optimizer-offload-fraction 0.5 needs --cpu-offload"),
    (["--zero-stage", "2", "--cpu-offload", "--optimizer-offload-fraction", "0"],
     "--optimizer-offload-fraction 0.0 must be above 0 and at most 1"),
    (["--zero-stage", "2", "--cpu-offload", "--optimizer-offload-fraction", "1.5"],
     "--optimizer-offload-fraction 1.5 must be above 0 and at most 1"),
])
def test_a_fraction_without_offload_or_out_of_range_is_refused(flags, message):
    cfg, _ = parse_megatron_args(TINY_FLAGS + RUN + flags, world_size=1)
    with pytest.raises(ValueError, match=message):
        parallel_dims(cfg, 1)


def test_megatron_lm_offload_flags_of_today_are_taken():
    """A current Megatron-LM script's hybrid-device optimizer flags: --optimizer-cpu-offload (with the
    distributed optimizer: ZeRO-1), its fraction, the precision-aware optimizer it requires at fp32 state."""
    flags = ["--use-distributed-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.75",
             "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer", "--main-grads-dtype", "fp32",
             "--main-params-dtype", "fp32", "--exp-avg-dtype", "fp32", "--exp-avg-sq-dtype", "fp32",
             "--use-torch-optimizer-for-cpu-offload"]
    cfg, _ = parse_megatron_args(TINY_FLAGS + RUN + flags, world_size=1)
    dims = parallel_dims(cfg, 1)
    assert (dims.zero_stage, dims.cpu_offload, dims.offload_fraction) == (1, True, 0.75)
    assert cfg.parallel.overlap_cpu_optimizer


@pytest.mark.parametrize("flag, value", [("--exp-avg-dtype", "bf16"), ("--main-grads-dtype", "bf16"),
                                         ("--main-params-dtype", "fp16"), ("--exp-avg-sq-dtype", "fp8")])
def test_lower_precision_optimizer_state_is_refused(flag, value):
    with pytest.raises(ValueError, match=f"^{flag} {value}: only fp32 is supported"):
        parse_megatron_args(TINY_FLAGS + RUN + [flag, value], world_size=1)


def test_deepspeed_offload_ratio_is_the_fraction_at_stage_3_as_deepspeed_reads_it(tmp_path):
    s = parse_deepspeed_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})
    assert s.cpu_offload and s.offload_ratio == 0.3

    def ds(stage, ratio):
        path = tmp_path / f"ds{stage}.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": stage,
                                                          "offload_optimizer": {"device": "cpu", "ratio": ratio}}}))
        return ["--deepspeed", "--deepspeed_config", str(path)]

    cfg, _ = parse_megatron_args(TINY_FLAGS + RUN + ds(3, 0.4), world_size=1)
    assert (cfg.parallel.zero_stage, cfg.parallel.cpu_offload, cfg.parallel.offload_fraction) == (3, True, 0.4)
    # below stage 3 DeepSpeed offloads everything whatever the ratio: so does gptrain, and says so
    cfg, notes = parse_megatron_args(TINY_FLAGS + RUN + ds(2, 0.4), world_size=1)
    assert (cfg.parallel.zero_stage, cfg.parallel.cpu_offload, cfg.parallel.offload_fraction) == (2, True, 1.0)
    assert any("offload_optimizer.ratio: DeepSpeed applies it at stage 3 only: stage 2 offloads all" in n for n in notes)
    for given in ("0.5", "1.0"):  # an explicit 1.0 contradicts too
        with pytest.raises(ValueError, match=f"ratio 0.4 contradicts --optimizer-offload-fraction {float(given):g}"):
            parse_megatron_args(TINY_FLAGS + RUN + ds(3, 0.4) + ["--optimizer-offload-fraction", given], world_size=1)
    cfg, _ = parse_megatron_args(TINY_FLAGS + RUN + ds(3, 0.4) + ["--optimizer-offload-fraction", "0.4"], world_size=1)
    assert cfg.parallel.offload_fraction == 0.4
    cfg, _ = parse_megatron_args(TINY_FLAGS + RUN, world_size=1)
    assert cfg.parallel.offload_fraction == 1.0
    with pytest.raises(ValueError, match="ratio 2.0: must be at most 1"):
        parse_deepspeed_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 2.0}}})


def test_the_model_is_made_real_unit_by_unit_where_it_will_live():
    """train/build.materialize: the offloaded blocks' tensors in host memory, the kept blocks and the root (with
    the output layer tied to the word embeddings) on the device; "meta" stands in for the GPU here."""
    from gptrain.model.gpt import GPT
    from gptrain.train.build import materialize

    from tiny import tiny_config

    with torch.device("meta"):
        model = GPT(tiny_config(num_layers=4))
    blocks = list(model.layers.values())
    offloaded = offloaded_modules([model], blocks, 0.001)
    assert offloaded == {blocks[3]}
    materialize(model, offloaded, torch.device("meta"))
    model.tie_output_layer()
    assert {p.device.type for p in blocks[3].parameters()} == {"cpu"}
    assert {p.device.type for b in blocks[:3] for p in b.parameters()} == {"meta"}
    assert model.word_embeddings.weight.is_meta and model.output_layer.weight is model.word_embeddings.weight


def test_the_planner_keeps_the_unoffloaded_state_on_the_gpu(capsys):
    """Half the blocks offloaded: their fp32 shards, moments and reduced gradients stay on the GPU (16 bytes a
    parameter), the host holds the rest, and the step's host time shrinks with it."""
    from gptrain.plan.cli import plan_main

    flags = ("--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 128 --max-position-embeddings 128 "
             "--micro-batch-size 2 --global-batch-size 2 --mock-data --train-iters 1 --bf16 --gpu h100 --evaluate "
             "--json --world-size 1 --zero-stage 2 --cpu-offload").split()

    def plan(extra):
        assert plan_main(flags + extra) == 0
        return json.loads(capsys.readouterr().out)[0]

    full, half, tiny = plan([]), plan(["--optimizer-offload-fraction", "0.5"]), plan(["--optimizer-offload-fraction", "0.01"])
    assert full["memory_gib"]["optimizer"] == 0 < half["memory_gib"]["optimizer"] < tiny["memory_gib"]["optimizer"]
    assert full["peak_gib"] < half["peak_gib"] < tiny["peak_gib"]
    assert full["time_split_s"]["optimizer"] > half["time_split_s"]["optimizer"] > tiny["time_split_s"]["optimizer"]


def _partial_offload_equals_the_plain_run(tmp_path, device: str) -> None:
    """One block in host memory, the other and the root on ``device``: the plain run's losses and gradient
    norms, with and without the overlapped host step, and a run resumed in the middle equals the straight one."""
    from distributed import TINY, losses, single

    # --log-params-norm: a norm over shards on two devices (parallel/collectives.global_norm_and_sum)
    args = [a if a != "cpu" else device for a in TINY] + ["--train-iters", "4", "--log-params-norm"]
    plain_out = single(args)
    plain, norms, params = losses(plain_out), _grad_norms(plain_out), _params_norms(plain_out)
    assert len(params) == 4
    partial = ["--zero-stage", "2", "--cpu-offload", "--optimizer-offload-fraction", "0.001"]
    ckpt = str(tmp_path / "ckpt")
    for extra in ([], ["--overlap-cpu-optimizer-d2h-h2d", "--save", ckpt, "--save-interval", "2"]):
        out = single(args + partial + extra)
        assert "> offload: --optimizer-offload-fraction 0.001: the last 1 of 2 blocks in host memory, the first 1 " \
               "blocks and the root" in out, out[-2000:]
        offloaded = losses(out)
        assert offloaded.keys() == plain.keys() == {1, 2, 3, 4}
        assert all(offloaded[k] == pytest.approx(plain[k], abs=1e-5) for k in plain), (extra, offloaded, plain)
        assert _grad_norms(out) == pytest.approx(norms, rel=1e-5)
        assert _params_norms(out) == pytest.approx(params, abs=2e-3)  # printed to 3 decimals
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = losses(single(args + partial + ["--overlap-cpu-optimizer-d2h-h2d", "--load", ckpt]))
    assert resumed.keys() == {3, 4} and all(resumed[k] == offloaded[k] for k in (3, 4)), (resumed, offloaded)
    return args, plain, norms


def _params_norms(out: str) -> list[float]:
    import re

    return [float(m) for m in re.findall(r"\| params norm: (\S+) \|", out)]


def _grad_norms(out: str) -> list[float]:
    import re

    return [float(m) for m in re.findall(r"\| grad norm: (\S+) \|", out)]


@pytest.mark.slow
def test_partial_offload_equals_the_plain_run_and_resumes_exactly(tmp_path):
    """ZeRO-2 and ZeRO-3 on one process, and ZeRO-2 over two data-parallel gloo ranks (each rank's shards of the
    kept block and root stay on its device)."""
    from distributed import losses, single, torchrun

    args, plain, norms = _partial_offload_equals_the_plain_run(tmp_path, "cpu")
    partial = ["--cpu-offload", "--optimizer-offload-fraction", "0.001", "--overlap-cpu-optimizer-d2h-h2d"]
    for out in (single(args + ["--zero-stage", "3"] + partial), torchrun(2, args + ["--zero-stage", "2"] + partial)):
        assert "the last 1 of 2 blocks in host memory" in out, out[-2000:]
        assert losses(out) == pytest.approx(plain, abs=1e-5) and _grad_norms(out) == pytest.approx(norms, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU lane)")
def test_partial_offload_on_a_gpu_equals_the_plain_run_and_resumes_exactly(tmp_path):
    """The blocks kept on the GPU are updated there by the main thread, the offloaded one by the host's."""
    _partial_offload_equals_the_plain_run(tmp_path, "cuda")


def test_the_planner_names_the_least_offload_that_fits(capsys):
    """`gptrain plan --evaluate` with --cpu-offload: the smallest fraction (whole last blocks) whose planned peak
    fits the GPU, one block fewer not fitting; with few blocks offloaded the peak is the backward's end, where
    the kept units' fp32 gradients are all held."""
    from gptrain.config import parse_megatron_args
    from gptrain.plan.cli import plan_main
    from gptrain.plan.hardware import load_gpu
    from gptrain.plan.memory import block_params
    from gptrain.plan.offload_fit import least_offload_fraction
    from gptrain.plan.search import predict

    flags = ("--num-layers 36 --hidden-size 4096 --num-attention-heads 32 --seq-length 1024 "
             "--max-position-embeddings 1024 --bf16 --recompute-granularity full --micro-batch-size 8 "
             "--global-batch-size 8 --zero-stage 2 --cpu-offload --mock-data --train-iters 1").split()
    cfg, _ = parse_megatron_args(flags, world_size=1)
    cfg = cfg.with_tokenizer(50257, 50256)
    gpu = load_gpu("h100")
    fraction, peak = least_offload_fraction(cfg, 1, gpu, 8)
    block = block_params(cfg, 1) / cfg.model.num_parameters()

    def at(f):
        return predict(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, offload_fraction=f)), 1, gpu, 8)

    assert 0 < fraction < 1 and at(fraction).fits and at(fraction).peak_gib == peak
    assert not at(fraction - block).fits
    # the printed value offloads the blocks planned
    sizes = [cfg.model.num_parameters() - cfg.model.num_layers * block_params(cfg, 1),
             *[block_params(cfg, 1)] * cfg.model.num_layers]
    assert offloaded_count(sizes, float(f"{fraction:.3g}")) == offloaded_count(sizes, fraction) == round(fraction / block + 0.5)
    p = at(block)  # one block offloaded
    assert p.memory.weights == 0 and p.memory.grads >= p.memory.main_params  # the backward's end
    assert plan_main(flags + ["--world-size", "1", "--gpu", "h100", "--evaluate"]) == 0
    assert f"least offload that fits 80 GiB: --optimizer-offload-fraction {fraction:.3g} (peak {peak:.1f} GiB" \
        in capsys.readouterr().out
