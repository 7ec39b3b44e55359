"""The reasons given for accepted no-op and refused Megatron flags (flag_tables.COMPATIBILITY) state
what the code does: each fact that can be checked on a CPU is checked here."""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gptrain.flag_tables import COMPATIBILITY
from gptrain.model.gpt import GPT, GPTConfig

REASONS = {c.name: c.reason for c in COMPATIBILITY}
TINY = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
                 attention_dropout=0.0)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


def _ops(model: GPT) -> set[str]:
    with _Ops() as ops:
        model(torch.randint(0, 100, (2, 16)))
    return ops.ops


def test_use_flash_attn_names_the_kernels_that_run():
    from torch.nn.attention import SDPBackend

    from gptrain.kernels import convert, flash4

    reason = REASONS["--use-flash-attn"]
    assert "flash on GPU" not in reason and "cuDNN's forward and FlashAttention-4's backward" in reason
    # auto: FlashAttention-4's ops where usable, whose forward is cuDNN's unless told otherwise ...
    assert convert.SDPA_BACKENDS["auto"] is None
    assert inspect.signature(flash4.causal_attention).parameters["cudnn_forward"].default is True
    # ... else SDPA's own pick; --attention-backend flash pins FlashAttention-2
    assert convert.SDPA_BACKENDS["flash"] == [SDPBackend.FLASH_ATTENTION]
    assert convert.SDPA_BACKENDS["fused"] == [SDPBackend.CUDNN_ATTENTION]
    model = GPT(TINY)
    assert convert.attention_choice(model, _Kernels("auto"), torch.device("cpu"), torch.float32).impl == \
        "SDPA, PyTorch's pick"


class _Kernels:
    def __init__(self, attention_backend: str):
        self.attention_backend = attention_backend


def test_masking_and_softmax_are_inside_the_attention_call():
    assert "no masked-softmax kernel" in REASONS["--no-masked-softmax-fusion"]
    ops = _ops(GPT(TINY).eval())
    assert any("scaled_dot_product" in op for op in ops)
    assert not any("softmax" in op for op in ops), ops


def test_dropout_is_a_separate_op_and_biases_are_in_the_matmuls():
    assert "dropout after attention and MLP is a separate op" in REASONS["--no-bias-dropout-fusion"]
    ops = _ops(GPT(TINY).train())
    assert "aten.bernoulli_.float" in ops or "aten.native_dropout.default" in ops
    assert "aten.addmm.default" in ops  # nn.Linear's bias added by the matmul


def test_attention_softmax_runs_in_fp32_on_bf16_inputs():
    """SDPA's math kernel (--attention-backend unfused/local) on bf16 q, k, v gives the fp32-softmax
    result rounded once to bf16, not a bf16 softmax's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    assert "softmax of bf16/fp16 scores in fp32" in REASONS["--attention-softmax-in-fp32"]
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64).bfloat16() for _ in range(3))
    mask = torch.ones(256, 256, dtype=torch.bool).triu(1)

    def reference(dtype):
        scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * 64 ** -0.5
        return (torch.softmax(scores.masked_fill(mask, float("-inf")), -1) @ v.to(dtype)).bfloat16().float()

    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).float()
    fp32_error = (out - reference(torch.float32)).abs().max().item()
    bf16_error = (out - reference(torch.bfloat16)).abs().max().item()
    assert fp32_error <= 2 ** -10 < bf16_error


def test_half_precision_gradients_accumulate_in_fp32_main_gradients():
    from gptrain.train.main_params import MainParams

    assert "fp32 main gradients" in REASONS["--no-gradient-accumulation-fusion"]
    assert "reduced in fp32 unless --grad-reduce-in-bf16" in REASONS["--accumulate-allreduce-grads-in-fp32"]
    model = GPT(TINY)
    main = MainParams(model, torch.bfloat16)
    for _ in range(2):
        model(torch.randint(0, 100, (2, 16))).float().sum().backward()
        main.accumulate_grads()
    # the buffer plain data parallelism all-reduces (parallel/data_parallel.average_flat)
    assert main.grad_flat.dtype == torch.float32
    assert all(m.grad.dtype == torch.float32 for m in main.main)


def test_schedule_settings_come_from_the_flags_and_the_step_from_the_checkpoint():
    from gptrain.config import parse_megatron_args
    from gptrain.train.schedule import LRSchedule

    assert "takes its settings from the flags" in REASONS["--override-opt_param-scheduler"]
    cfg, _ = parse_megatron_args(["--mock-data", "--train-iters", "100", "--lr", "1e-3", "--lr-warmup-iters", "10"],
                                 world_size=1)
    schedule = LRSchedule.from_config(cfg.optim, cfg.train)
    saved = dict(schedule.state_dict(), num_steps=20, max_lr=5.0, min_lr=1.0, warmup_steps=0, style="constant")
    schedule.load_state_dict(saved)
    assert schedule.num_steps == 20
    assert {k: v for k, v in schedule.state_dict().items() if k != "num_steps"} == \
        {k: v for k, v in LRSchedule.from_config(cfg.optim, cfg.train).state_dict().items() if k != "num_steps"}


def test_process_group_backend_by_device_and_timeout(monkeypatch):
    import datetime

    from torch.distributed import distributed_c10d

    from gptrain.parallel import dims

    assert REASONS["--distributed-backend"] == "NCCL on GPUs, gloo on CPUs, chosen by device"
    assert "--distributed-timeout-minutes" not in REASONS  # a real flag now (issue 33)
    calls = []
    monkeypatch.setattr(dims, "world_from_env", lambda: (2, 0, 0))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(distributed_c10d, "default_pg_timeout", distributed_c10d.default_pg_timeout)
    monkeypatch.setattr(distributed_c10d, "default_pg_nccl_timeout", distributed_c10d.default_pg_nccl_timeout)
    assert dims.init_distributed(torch.device("cpu"), 0.5) == torch.device("cpu")
    assert calls == [(("gloo",), {"timeout": datetime.timedelta(seconds=30)})]
    # the groups made later (DeviceMesh's, the checkpoint writer's) default to it too
    assert distributed_c10d._get_default_timeout("gloo") == datetime.timedelta(seconds=30)
    assert "cuda:nccl" in inspect.getsource(dims.init_distributed)  # GPUs: NCCL (not run on a CPU)


def test_batches_are_assembled_in_a_background_thread():
    from gptrain.data.loader import MicroBatchLoader

    assert REASONS["--num-workers"] == "batches are assembled in a background thread"
    loader = MicroBatchLoader([torch.zeros(17, dtype=torch.long)] * 8, 0, 2, torch.device("cpu"))
    try:
        assert loader._thread.is_alive() and loader._thread.daemon
    finally:
        loader.close()


def test_default_architecture_is_gpt2s():
    """The Llama-family flags' defaults build GPT-2's modules (tests/test_llama.py covers the others)."""
    assert "split halves" in REASONS["--rotary-interleaved"]
    model = GPT(TINY)
    assert model.output_layer.weight is model.word_embeddings.weight
    norms = [m for m in model.modules() if "norm" in type(m).__name__.lower()]
    assert norms and all(type(m) is torch.nn.LayerNorm for m in norms)
    assert isinstance(model.position_embeddings, torch.nn.Embedding)
    assert model.position_embeddings.weight.requires_grad


def test_layer_norm_is_torchs_and_no_transformer_engine_is_used():
    """--no-persist-layer-norm, --transformer-impl, --use-mcore-models / --use-legacy-models."""
    import pathlib
    import re

    assert "torch's layer_norm" in REASONS["--no-persist-layer-norm"]
    assert "aten.native_layer_norm.default" in _ops(GPT(TINY).eval())
    assert "TransformerEngine is never used" in REASONS["--transformer-impl"]
    assert REASONS["--use-mcore-models"] == REASONS["--use-legacy-models"]
    root = pathlib.Path(__file__).parents[1] / "gptrain"
    sources = {p: p.read_text() for p in root.rglob("*.py")}
    assert not [p for p, text in sources.items() if re.search(r"^\s*(import|from) transformer_engine", text, re.M)]
    # one GPT class, the one training builds
    assert [p.name for p, text in sources.items() if re.search(r"^class GPT\(nn.Module\)", text, re.M)] == ["gpt.py"]
    from gptrain.train import build

    assert "GPT(" in inspect.getsource(build)


def test_batches_follow_megatrons_single_sampler():
    """--dataloader-type single: the split's samples in order from the consumed ones, each data-parallel
    rank its micro-batch's slice of the global batch."""
    from gptrain.data.loader import MicroBatchLoader

    assert "single sampler" in REASONS["--dataloader-type"]
    data = [torch.full((17,), i, dtype=torch.long) for i in range(32)]
    firsts = []
    for rank in range(2):
        loader = MicroBatchLoader(data, 8, 2, torch.device("cpu"), dp_rank=rank, dp_size=2)
        try:
            firsts.append([loader.next()[0][:, 0].tolist() for _ in range(2)])
        finally:
            loader.close()
    assert firsts == [[[8, 9], [12, 13]], [[10, 11], [14, 15]]]


def test_one_timer_the_whole_iteration():
    from gptrain.train import metrics

    assert "whole iteration only" in REASONS["--timing-log-level"]
    line = metrics.iteration_line(1, 2, 8, 12.5, 1e-4, 8, 1.0, 1.0, 1.0, 0, 0)
    assert " elapsed time per iteration (ms): 12.5 |" in line and line.count("(ms)") == 1
