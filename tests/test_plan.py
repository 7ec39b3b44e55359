"""``gptrain plan``: its memory arithmetic against the bytes a CPU run allocates, its proposals against
the training command's own checks, its JSON, and its 175B prediction against Megatron's published
iteration time (arXiv 2205.05198 Table 5: GPT-3 175B, TP8 x PP8 on 64 A100s, global batch 64,
sequence parallelism and selective recompute, 13.75 s)."""
from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.tensor import DTensor

from gptrain.config import parse_megatron_args
from gptrain.parallel import simulate
from gptrain.plan.cli import plan_main
from gptrain.plan.memory import block_params, state_memory
from gptrain.plan.search import _stage_params, predict
from gptrain.plan.hardware import load_gpu
from gptrain.train.build import build_training, parallel_dims
from tests.tiny import TINY_FLAGS

RUN = ["--mock-data", "--train-iters", "1", "--seq-length", "16", "--max-position-embeddings", "16"]
# examples/gpt3_175b_flags.sh's model and training flags (seeds/002), without data and checkpoint paths
GPT3_175B = ("--mock-data --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
             "--max-position-embeddings 2048 --micro-batch-size 1 --train-samples 10846761 --lr 6.0e-5 "
             "--min-lr 6.0e-6 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 "
             "--adam-beta2 0.95 --init-method-std 0.006 --fp16 --tensor-model-parallel-size 8 "
             "--pipeline-model-parallel-size 8").split()


def _unique_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


@pytest.mark.parametrize("precision", [["--bf16"], []], ids=["bf16", "fp32"])
def test_state_bytes_equal_a_cpu_run(precision):
    cfg, _ = parse_megatron_args(TINY_FLAGS + RUN + ["--micro-batch-size", "2"] + precision, world_size=1)
    cfg = cfg.with_tokenizer(1000, 0)
    dims = parallel_dims(cfg, 1)
    parts = build_training(cfg, torch.device("cpu"), dims, None, log=lambda s: None)
    tokens = torch.randint(0, 1000, (2, 16))
    parts.forward(tokens, tokens, None).backward()
    if parts.main is not None:
        parts.main.accumulate_grads()
    model_params = list(parts.model.parameters())
    allocated = _unique_bytes(model_params + [p.grad for p in model_params])
    if parts.main is not None:
        allocated += _unique_bytes(parts.main.main) + _unique_bytes([parts.main.grad_flat])
    allocated += _unique_bytes(t for state in parts.optimizer.state.values() for t in state.values())
    params = _stage_params(tuple(sorted(vars(cfg.model).items())), 1, 1, None, None)[0]
    assert params == sum(p.numel() for p in model_params)
    predicted = state_memory(cfg, dims, params, cfg.model.num_layers).state_bytes()
    assert predicted == pytest.approx(allocated, rel=0.02)


def _local_bytes(tensors) -> int:
    return _unique_bytes(t.to_local() if isinstance(t, DTensor) else t for t in tensors)


def _fsdp_params(module):
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    for m in module.modules():
        state = _get_module_fsdp_state(m)
        if state is not None and state._fsdp_param_group is not None:
            yield from state._fsdp_param_group.fsdp_params


@pytest.mark.parametrize("layout", [["--zero-stage", "1"], ["--zero-stage", "2"], ["--zero-stage", "3"],
                                    ["--tensor-model-parallel-size", "2"]], ids=["zero1-distributed-optimizer", "zero2", "zero3", "tp2"])
def test_state_bytes_of_a_rank_of_two_equal_a_simulated_cpu_rank(layout):
    """Rank 0 of two through the rank simulator (fake process group, this process), each kind of state
    where it peaks: the distributed optimizer's (ZeRO-1's) whole fp32 gradient buffer and its rows of the main
    weights, ZeRO-2/3's gradient shards, the half-precision copies ZeRO-2 gathers for the step, and ZeRO-3's:
    the root's and the running block's (and the next block, which a GPU prefetches)."""
    with simulate.simulated_world(2):
        cfg, _ = parse_megatron_args(TINY_FLAGS + RUN + ["--num-layers", "4", "--micro-batch-size", "2",
                                                         "--global-batch-size", "8", "--bf16"] + layout, world_size=2)
        cfg = cfg.with_tokenizer(1000, 0)
        dims = parallel_dims(cfg, 2)
        parts = build_training(cfg, torch.device("cpu"), dims, dims.build_mesh("cpu"), log=lambda s: None)
        model, zero = parts.model, dims.zero_stage
        gathered = []

        def half_copies(*_):
            gathered.append(_unique_bytes(p for p in model.parameters() if not isinstance(p, DTensor)))
        if zero == 3:
            model.layers["1"].mlp.register_forward_hook(half_copies)
        tokens = torch.randint(0, 1000, (2, 16))
        loss = parts.forward(tokens, tokens, None)
        if zero == 2:
            half_copies()
        loss.backward()
        if parts.main is not None:
            parts.main.accumulate_grads()
        params = _stage_params(tuple(sorted(vars(cfg.model).items())), dims.tp, 1, None, None)[0]
        predicted = state_memory(cfg, dims, params, cfg.model.num_layers)
        optimizer = _local_bytes(t for state in parts.optimizer.state.values() for t in state.values())
        assert optimizer == pytest.approx(predicted.optimizer, rel=0.02)
        if dims.sharded:
            assert _local_bytes(model.parameters()) == pytest.approx(predicted.main_params, rel=0.02)
            assert _local_bytes([p.grad for p in model.parameters()]) == pytest.approx(predicted.grads, rel=0.02)
            prefetched = 2 * block_params(cfg, 1) if zero == 3 else 0
            assert gathered[0] + prefetched == pytest.approx(predicted.weights, rel=0.02)
        else:
            assert params == sum(p.numel() for p in model.parameters())
            assert _local_bytes(model.parameters()) == pytest.approx(predicted.weights, rel=0.02)
            assert _local_bytes(parts.main.main) == pytest.approx(predicted.main_params, rel=0.02)
            assert _local_bytes([parts.main.grad_flat]) == pytest.approx(predicted.grads, rel=0.02)


def _plan(argv, capsys) -> tuple[int, str]:
    code = plan_main(argv)
    return code, capsys.readouterr().out


SMALL = TINY_FLAGS + ["--mock-data", "--train-iters", "1", "--bf16", "--global-batch-size", "8",
                      "--world-size", "8", "--gpu", "h100", "--json", "--top", "0"]


def test_json_ranking_deterministic_and_every_proposal_accepted_by_train(capsys):
    code, out = _plan(SMALL, capsys)
    assert code == 0
    layouts = json.loads(out)
    assert layouts and json.loads(_plan(SMALL, capsys)[1]) == layouts  # the same ranking twice
    keys = {"tp", "pp", "dp", "zero_stage", "micro_batch_size", "recompute", "tokens_per_s_per_gpu", "mfu", "peak_gib"}
    for layout in layouts:
        assert keys <= set(layout)
        assert layout["tp"] * layout["pp"] * layout["dp"] == 8 and layout["fits"]
    speeds = [layout["tokens_per_s_per_gpu"] for layout in layouts]
    assert all(a >= b - 1e-6 for a, b in zip(speeds, speeds[1:]))
    # each kind of proposal (micro-batches aside), as the flags a user would paste, passes gptrain train's checks
    kinds = {(x["tp"], x["pp"], x["zero_stage"], x["sequence_parallel"], x["recompute"]): x for x in layouts}
    for layout in kinds.values():
        argv = TINY_FLAGS + ["--mock-data", "--train-iters", "1", "--bf16", "--global-batch-size", "8"]
        argv += layout["flags"].split()
        cfg, _ = parse_megatron_args(argv, world_size=8)
        dims = parallel_dims(cfg, 8)
        assert (dims.tp, dims.pp, dims.dp, dims.zero_stage) == (layout["tp"], layout["pp"], layout["dp"],
                                                                layout["zero_stage"])
    # what train refuses is reported, never proposed: ZeRO-2/3 with pipelines, TP beyond 4 heads
    assert not any(layout["pp"] > 1 and layout["zero_stage"] > 1 for layout in layouts)
    assert not any(layout["tp"] == 8 for layout in layouts)


def test_evaluate_is_one_object_and_bad_input_is_one_line(capsys):
    code, out = _plan(TINY_FLAGS + ["--mock-data", "--train-iters", "1", "--world-size", "2", "--gpu", "h200",
                                    "--tensor-model-parallel-size", "2", "--evaluate", "--json"], capsys)
    assert code == 0
    (layout,) = json.loads(out)
    assert (layout["tp"], layout["dp"], layout["recompute"]) == (2, 1, "none")
    assert plan_main(TINY_FLAGS + ["--mock-data", "--train-iters", "1", "--world-size", "2"]) == 2
    assert plan_main(TINY_FLAGS + ["--mock-data", "--train-iters", "1", "--world-size", "2", "--gpu", "h100",
                                   "--tensor-model-parallel-size", "8", "--evaluate"]) == 2
    # the schedule's rule, now checked by parallel_dims before anything is built
    assert plan_main(TINY_FLAGS + ["--mock-data", "--train-iters", "1", "--world-size", "2", "--gpu", "h100",
                                   "--pipeline-model-parallel-size", "2", "--evaluate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 3 and "give --gpu" in err and "not divisible" in err
    assert "needs at least 2 micro-batches per step" in err
    if not torch.cuda.is_available():
        assert plan_main(["--calibrate"]) == 2
        assert "--calibrate measures a CUDA GPU" in capsys.readouterr().err


def test_gpt3_175b_on_64_a100_within_15_percent_of_megatron():
    cfg, _ = parse_megatron_args(GPT3_175B + ["--global-batch-size", "64", "--sequence-parallel",
                                              "--recompute-activations"], world_size=64)
    p = predict(cfg.with_tokenizer(50257, 50256), 64, load_gpu("a100"), 8)
    assert (p.tp, p.pp, p.dp, p.micro_batches) == (8, 8, 1, 64)
    assert p.step_s == pytest.approx(13.75, rel=0.15)
    assert p.fits


def test_several_micro_batches_keep_the_fp32_gradient_buffer_through_the_later_forwards():
    """One process, bf16: after the first micro-batch the fp32 main-gradient buffer (4 bytes a parameter)
    stays until the step, beside the next micro-batches' activations (train/main_params.py); a 345M at
    global batch 128 peaked 1.33 GiB above global batch 16 on an H200 (RESULTS.md, s24)."""
    m345 = ("--mock-data --train-iters 1 --num-layers 24 --hidden-size 1024 --num-attention-heads 16 "
            "--seq-length 1024 --max-position-embeddings 1024 --bf16 --micro-batch-size 16").split()
    peaks = []
    for gbs in (16, 128):
        cfg, _ = parse_megatron_args(m345 + ["--global-batch-size", str(gbs)])
        peaks.append(predict(cfg.with_tokenizer(50257, 50256), 1, load_gpu("h200"), 8).peak_gib)
    params = 24 * (12 * 1024**2 + 13 * 1024) + 50304 * 1024 + 1024 * 1024 + 2 * 1024  # the 345M, padded vocabulary
    assert peaks[1] - peaks[0] == pytest.approx(4 * params / 2**30, rel=1e-3)


def test_dry_run_prints_the_prediction_of_its_layout():
    from gptrain.train.run import dry_run

    cfg, _ = parse_megatron_args(TINY_FLAGS + RUN + ["--tensor-model-parallel-size", "2", "--bf16"], world_size=4)
    cfg = cfg.with_tokenizer(1000, 0)
    lines = []
    dry_run(cfg, 4, lines.append)
    (line,) = [x for x in lines if x.startswith(" > plan on 4 x ")]
    p = predict(cfg, 4, load_gpu(line.split(" x ")[1].split()[0]), 8)
    assert f"{p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU" in line and f"peak {p.peak_gib:.2f} GiB" in line


def test_cpu_offload_moves_the_state_to_host_memory(capsys):
    """--cpu-offload (one GPU included): the GPU keeps the gathered copies; the fp32 parameter, gradient and
    moment shards (16 bytes a parameter) are host memory, printed beside the GPU's."""
    flags = TINY_FLAGS + ["--mock-data", "--train-iters", "1", "--bf16", "--world-size", "1", "--gpu", "h100",
                          "--evaluate"]
    code, out = _plan(flags + ["--json"], capsys)
    plain = json.loads(out)[0]
    code, out = _plan(flags + ["--json", "--zero-stage", "3", "--cpu-offload"], capsys)
    offload = json.loads(out)[0]
    assert code == 0 and offload["memory_gib"]["optimizer"] == 0 and offload["memory_gib"]["main_params"] == 0
    assert offload["peak_gib"] < plain["peak_gib"]
    code, out = _plan(flags + ["--zero-stage", "3", "--cpu-offload"], capsys)
    assert code == 0 and "host memory per rank (--cpu-offload" in out and "as measured on one host" in out


def test_offload_with_a_host_norm_is_planned_slower(capsys):
    """With tensor or pipeline parallelism the offload step still takes the gradient norm over the host's copies
    (train/build.py sums it on the GPU only without them): the planner counts that pass."""
    from gptrain.plan.timing import OFFLOAD_FETCH_S_PER_PARAM, OFFLOAD_HOST_NORM_S_PER_PARAM, OFFLOAD_STEP_S_PER_PARAM

    flags = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
             "--micro-batch-size 2 --global-batch-size 8 --mock-data --train-iters 1 --bf16 --gpu h100 --evaluate "
             "--json --cpu-offload").split()
    one = json.loads(_plan(flags + ["--world-size", "1", "--zero-stage", "3"], capsys)[1])[0]
    two = json.loads(_plan(flags + ["--world-size", "2", "--zero-stage", "1", "--pipeline-model-parallel-size", "2"],
                           capsys)[1])[0]
    per_param_one = one["time_split_s"]["optimizer"] / (OFFLOAD_STEP_S_PER_PARAM + 4 * OFFLOAD_FETCH_S_PER_PARAM)
    per_param_two = two["time_split_s"]["optimizer"] / (OFFLOAD_STEP_S_PER_PARAM + OFFLOAD_HOST_NORM_S_PER_PARAM)
    # the same parameter count: the whole model on one GPU, the larger stage (the embeddings) of the pipeline
    assert per_param_one > per_param_two > per_param_one / 2


def test_the_largest_model_that_fits_with_offload_is_the_last_layer_count_that_fits(capsys):
    """`gptrain plan --evaluate` with --cpu-offload names the most layers of the flags' width that fit the GPU
    and the host (16 bytes a parameter on the host, HOST_USABLE of it): one more layer does not fit."""
    from gptrain.plan.offload_fit import HOST_USABLE, _with_layers
    from gptrain.plan.memory import offload_host_gib

    flags = ("--mock-data --train-iters 1 --num-layers 4 --hidden-size 4096 --num-attention-heads 32 "
             "--seq-length 1024 --max-position-embeddings 1024 --bf16 --micro-batch-size 8 --global-batch-size 8 "
             "--recompute-granularity full --zero-stage 3 --cpu-offload").split()
    cfg, fit = _largest_offload_fit(flags, 1)  # the s18 host: a 32 x 4096 trained there
    assert fit is not None and fit.layers >= 32
    over = _with_layers(cfg, fit.layers + 1)
    assert offload_host_gib(over, parallel_dims(cfg, 1)) > HOST_USABLE * 125.0 >= fit.host_gib  # the host limits
    code, out = _plan(flags + ["--world-size", "1", "--gpu", "h100", "--evaluate", "--host-memory-gib", "125"], capsys)
    assert code == 0 and f"largest with --cpu-offload at this width: {fit.layers} layers x 4096" in out


def test_the_largest_offload_model_steps_over_layer_counts_the_layout_refuses():
    """An uneven first stage takes only some layer counts (the rest must split over the other stages): the
    search lands on one it takes, and no larger count fits."""
    from gptrain.plan.offload_fit import _fits, _with_layers

    flags = ("--mock-data --train-iters 1 --num-layers 12 --hidden-size 1024 --num-attention-heads 16 "
             "--seq-length 1024 --max-position-embeddings 1024 --bf16 --micro-batch-size 4 --global-batch-size 64 "
             "--zero-stage 1 --cpu-offload --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 3").split()
    cfg, fit = _largest_offload_fit(flags, 4)
    assert fit is not None and (fit.layers - 3) % 3 == 0
    for more in range(fit.layers + 1, fit.layers + 7):
        got = _fits(_with_layers(cfg, more), 4, load_gpu("h100"), 8, 125.0)
        assert got is None or not got[0], more


def _largest_offload_fit(flags: list[str], world: int, host_total: float = 125.0):
    """The flags' config and the largest model with --cpu-offload on H100s with ``host_total`` GiB of host memory."""
    from gptrain.plan.offload_fit import largest_offload_model

    cfg, _ = parse_megatron_args(flags, world_size=world)
    cfg = cfg.with_tokenizer(50257, 50256)
    return cfg, largest_offload_model(cfg, world, load_gpu("h100"), 8, host_total=host_total)
