"""Seconds per optimizer step of a layout, split by where the time goes (the constants below and the
calibration's efficiencies fitted to every measurement in benchmarks/RESULTS.md; benchmarks/plan_error.py
prints each against its prediction):

- compute: each block's four matmuls at the calibrated efficiency of their shape (forward, and twice
  its FLOPs in the backward; full recompute runs the forward again, selective the core attention),
  attention on the FLOPs the MFU formula counts, element-wise and memory-bound work (LayerNorms, GELU,
  residuals, dropout, the loss) at the memory bandwidth, more of it where the blocks are compiled one
  by one (growing with the square root of a micro-batch's tokens beyond BLOCK_TOKENS; FSDP2, pipeline
  stages: no fusion across blocks; --overlap-grad-reduce, whose compile is cut
  where its buckets end, costs about as much: its NCCL kernels slow the backward's matmuls beside them,
  which s22's two-H200 rows hold within 2.4%), FSDP2's casts and
  copies around its collectives, each tensor-parallel collective's copies; and the device's gaps
  between kernels;
- tensor parallelism, not overlapped with compute: 2 all-reduces forward and 2 backward per block (with
  --sequence-parallel 4 all-gathers or reduce-scatters each way), the embedding's and the head's,
  each its bytes over the link plus a latency; at TP 2 with --sequence-parallel (the copy engines by default,
  --no-tp-comm-copy-engine: NCCL) each a trade of half the tokens under a matmul, of which a share and a fixed
  cost show; without it the blocks' backward all-reduces on the copy engines, of which a share hides under the
  weight gradients' matmuls;
- data parallelism as gptrain does it: whole replicas all-reduce the fp32 (or bf16) main gradients
  after the backward, exposed, unless --overlap-grad-reduce; the distributed optimizer (ZeRO-1 on whole
  replicas) reduce-scatters them and all-gathers the new weights in their dtype, exposed, and updates 1/dp of
  them; ZeRO on FSDP2 gathers parameters and reduce-scatters gradients block by block under the compute;
- pipeline: the p2p sends, the tied embeddings' gradient sum, and the bubble: one micro-batch through
  each stage but the slowest (over v with interleaving), the slowest setting the pace (the last runs
  the output layer and the loss);
- gradients kept over several micro-batches (autograd's adds, or a pipeline's hooks adding into the
  fp32 main gradients as they arrive) at the memory bandwidth;
- the optimizer step at the memory bandwidth; the host's time to launch a micro-batch (per block for
  one compiled graph, blocks compiled one by one, tensor-parallel ranks, FSDP2's hooks, plus each
  NCCL collective; none under CUDA graphs), which sets the pace where it exceeds the device's and
  slows it where the two are close;
- --cpu-offload: the host's AdamW over the rank's fp32 shards and the step's PCIe copies, per parameter,
  and at ZeRO-3 the shards fetched again for every micro-batch; measured on one host (the H100
  machines': 16 cores, PCIe 5), so another host's CPU and bus move it; with
  --overlap-cpu-optimizer-d2h-h2d the share of it the next forward hides.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from gptrain.config import RunConfig
from gptrain.parallel.dims import ParallelDims
from gptrain.plan.hardware import Gpu
from gptrain.plan.memory import block_params
from gptrain.train.build import overlap_grad_reduce, step_compile_mode, tp_copy_engine_wanted

ELEMENTWISE_BYTES = 80.0  # per token, per hidden unit, per block: fitted to the 345M step's element-wise time
LOSS_BYTES = 8.0  # per token per vocabulary entry: the loss's passes over the half-precision logits
OPTIMIZER_BYTES = 40.0  # per parameter: fused AdamW's reads and writes, the copy back, the norm, the zeroing
COLLECTIVE_LATENCY_S = 50e-6  # per collective inside a step: launch, the ranks meeting (fitted)
# per token, hidden unit and block, where blocks are compiled one by one: what one graph fuses across
# the blocks' boundaries and between forward and backward, written and read again (fitted)
BLOCK_BYTES = 70.0
# above this many tokens a micro-batch, what compiling the blocks one by one adds grows with the square root of
# the tokens, not with them (fitted to the micro-batch-64 rows of RESULTS.md's one-call table, which linear growth
# made pessimistic: pipeline, ZeRO and the overlapped reduction alike)
BLOCK_TOKENS = 16_384
DEVICE_GAPS = 0.02  # the device's idle time between kernels, a fraction of their time (fitted)
HOST_DEVICE_SHARPNESS = 8.0  # how fast the wall time approaches max(device, host) as they part (fitted)
BF16_REDUCE_CAST_BYTES = 12.0  # per parameter: fp32 read and bf16 written, bf16 read and fp32 written back
GATHER_EFFICIENCY = 0.83  # all-gather / reduce-scatter bus bandwidth over all-reduce's (NCCL, 2 x H200)
COLLECTIVE_HOST_S = 30e-6  # the host's time to launch an NCCL collective, beyond the simulator's fake one
# --tp-comm-copy-engine with --sequence-parallel, a trade of half a micro-batch's activations between two GPUs:
# the share of its transfer the matmul beside it leaves showing, and what each trade adds besides (its barrier,
# the received half's add or copy, the halves' smaller matmuls); fitted to s32's 2 x H200 rows at micro-batch 16
# and 64
TRADE_EXPOSED = 0.425
TRADE_FIXED_S = 33.3e-6
# TP2's copy-engine backward without sequence parallelism (parallel/copy_engine.py): the share of each column-parallel
# input gradient's sum that hides under the weight gradients' matmuls beside it; fitted to s30-s34's TP2 rows on copy
# engines against NCCL's (2.2-2.5 ms a step saved at micro-batch 16, 4.4-6.5 at 64)
EXCHANGE_HIDDEN = 0.3
# --cpu-offload, per fp32 parameter of the rank (s25, a 2.7B at ZeRO-2 and ZeRO-3 with 1 and 8 micro-batches):
# the host's fused AdamW with the step's gradient and parameter copies, none overlapped with the GPU
OFFLOAD_STEP_S_PER_PARAM = 0.30e-9
OFFLOAD_FETCH_S_PER_PARAM = 0.15e-9  # ZeRO-3: the shards copied in again for each micro-batch
# with tensor or pipeline parallelism the gradient norm is still taken over the host's copies (train/build.py): the
# s18 rows' step beyond the s25 ones (0.76e-9 then, before the norm moved to the GPU)
OFFLOAD_HOST_NORM_S_PER_PARAM = 0.46e-9
# --overlap-cpu-optimizer-d2h-h2d: the share of that time the first micro-batch's forward hides, beside the
# host's AdamW slowed by the forward's copies (s27, the 2.7B at ZeRO-2, one micro-batch: 77 and 86 ms saved, of
# the 0.79 s of offload time this model gives it)
OFFLOAD_OVERLAP_SAVING = 0.10
# per parameter of a block, FSDP2's copies around each all-gather (the fp32 shard cast to half
# precision, the gathered buffer split into the parameters) and each reduce-scatter (the gradients
# cast to fp32 and copied into its input)
FSDP_GATHER_BYTES = 4.0
FSDP_SCATTER_BYTES = 14.0
# per parameter and micro-batch, gradients kept over a step's micro-batches on whole replicas: autograd adds
# each micro-batch's half-precision gradient to .grad (2 + 2 read, 2 written); a pipeline schedule's hooks
# (and --overlap-grad-reduce's buckets) add it into the fp32 main gradient as it arrives (4 + 2 read, 4
# written; zeroed first, 4); fp32 parameters accumulate in fp32 (4 + 4 read, 4 written). One micro-batch's
# move into the main gradients (6) is in OPTIMIZER_BYTES' fit.
AUTOGRAD_ADD_BYTES = 6.0
MAIN_GRAD_ADD_BYTES = 10.0
FP32_ADD_BYTES = 12.0


@dataclass
class StageTime:
    """One micro-batch's forward and backward on one pipeline stage, in seconds."""
    compute: float
    tp_comm: float
    host: float  # the host's time to launch it (0: never the bottleneck)

    @property
    def device(self) -> float:
        return self.compute + self.tp_comm

    @property
    def wall(self) -> float:
        return wall_s(self.device, self.host)


@dataclass
class StepTime:
    compute: float = 0.0
    tp_comm: float = 0.0
    dp_comm: float = 0.0
    pp_comm: float = 0.0
    bubble: float = 0.0
    optimizer: float = 0.0
    host: float = 0.0  # host-bound time beyond the device's
    parts: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.dp_comm + self.pp_comm + self.bubble + self.optimizer + self.host

    def split(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("compute", "tp_comm", "dp_comm", "pp_comm", "bubble", "optimizer",
                                              "host")}


def all_reduce_s(nbytes: float, ranks: int, gbps: float) -> float:
    """Ring all-reduce at ``gbps`` bus bandwidth (an all-gather plus a reduce-scatter, the same)."""
    if ranks == 1 or math.isinf(gbps):
        return 0.0
    return 2.0 * (ranks - 1) / ranks * nbytes / (gbps * 1e9) + COLLECTIVE_LATENCY_S


def p2p_s(nbytes: float, gbps: float) -> float:
    """One send to the next pipeline stage."""
    return 0.0 if math.isinf(gbps) else nbytes / (gbps * 1e9) + COLLECTIVE_LATENCY_S


def gather_s(nbytes: float, ranks: int, gbps: float) -> float:
    """All-gather (or reduce-scatter) of ``nbytes`` whole over ``ranks``, at the lower bus bandwidth
    NCCL reaches on them than on an all-reduce of the same bytes."""
    if ranks == 1 or math.isinf(gbps):
        return 0.0
    return (ranks - 1) / ranks * nbytes / (gbps * GATHER_EFFICIENCY * 1e9) + COLLECTIVE_LATENCY_S


def host_kind(cfg: RunConfig, dims: ParallelDims, sp: bool) -> str | None:
    """Which measured host cost per block and micro-batch applies (calibration's host_ms_per_layer):
    graphs replayed by CUDA graphs never wait on the host."""
    if step_compile_mode(cfg, dims, cuda=True) == "reduce-overhead":
        return None
    if not cfg.train.compile:
        return "eager"
    if dims.sharded:
        return "fsdp"
    if dims.tp > 1:
        return "tp_sp" if sp else "tp"
    if per_block(cfg, dims):
        return "blocks"
    return "graph"


def per_block(cfg: RunConfig, dims: ParallelDims) -> bool:
    """The blocks compiled one by one (FSDP2's hooks, pipeline stages), or the overlapped gradient
    reduction's cut compile, which measures alike (see the module's docstring)."""
    return cfg.train.compile and (dims.sharded or dims.pp > 1 or overlap_grad_reduce(cfg, dims))


def wall_s(device: float, host: float) -> float:
    """A micro-batch's time when the host launches what the device runs: the larger of the two, and
    more where they are close (the launch queue drains and refills, so each waits on the other)."""
    top = max(device, host)
    if top <= 0.0 or min(device, host) <= 0.0:
        return top
    k = HOST_DEVICE_SHARPNESS
    return top * ((device / top) ** k + (host / top) ** k) ** (1.0 / k)


def tp_collectives(cfg: RunConfig, layers: int, first: bool, last: bool, sp: bool) -> float:
    """Collectives of one micro-batch on a tensor-parallel stage, each over the micro-batch's
    activations; with --sequence-parallel an all-gather or a reduce-scatter each, else an all-reduce."""
    full = cfg.kernels.recompute == "full"
    if sp:  # per block: 2 gathers and 2 scatters forward, their transposes backward (the gathered inputs kept)
        forward, backward = 4.0 * layers, 4.0 * layers
        forward += (1 if first else 0) + (1 if last else 0)  # embedding scatter, the head's gather
        backward += 1 if last else 0
    else:  # per block: the row-parallel outputs forward, the column-parallel input gradients backward
        forward, backward = 2.0 * layers, 2.0 * layers
        forward += 1 if first else 0  # the vocabulary-parallel embedding
        backward += 1 if last else 0  # the head's input gradient
    if full:
        forward += (4.0 if sp else 2.0) * layers
    return forward + backward


def per_block_tokens(tokens: int) -> float:
    """The tokens a micro-batch's per-block compilation costs as if it moved BLOCK_BYTES for each."""
    return tokens if tokens <= BLOCK_TOKENS else BLOCK_TOKENS * math.sqrt(tokens / BLOCK_TOKENS)


def stage_time(cfg: RunConfig, dims: ParallelDims, gpu: Gpu, layers: int, first: bool, last: bool, sp: bool,
               tp_gbps: float) -> StageTime:
    m, t = cfg.model, dims.tp
    b, s, h, f = cfg.train.micro_batch_size, m.seq_length, m.hidden_size, m.ffn_hidden_size
    tokens = b * s
    recompute = cfg.kernels.recompute
    block_mm = (gpu.matmul_s(tokens, h, 3 * h // t) + gpu.matmul_s(tokens, h // t, h)
                + gpu.matmul_s(tokens, h, f // t) + gpu.matmul_s(tokens, f // t, h))
    attention = gpu.attention_s(4.0 * b * s * s * h / t, m.head_dim)
    shard = 1.0 / t if sp else (1.0 / 3 + 2.0 / (3 * t))  # without SP, LayerNorms and residuals run whole
    elementwise = gpu.memory_s(ELEMENTWISE_BYTES * tokens * h * shard)
    if per_block(cfg, dims):
        elementwise += gpu.memory_s(BLOCK_BYTES * per_block_tokens(tokens) * h * shard)
    per_block_s = 3 * (block_mm + attention) + elementwise  # the element-wise bytes are forward and backward's
    if recompute == "full":
        per_block_s += block_mm + attention + elementwise / 3
    elif recompute == "selective":
        per_block_s += attention
    compute = layers * per_block_s
    if last:
        vocab = m.padded_vocab_size // t
        compute += 3 * gpu.matmul_s(tokens, h, vocab) + gpu.memory_s(LOSS_BYTES * tokens * vocab)
    tp_comm, launches = 0.0, 0.0
    if t > 1:
        count = tp_collectives(cfg, layers, first, last, sp)
        nbytes = 2.0 * tokens * h
        one = gather_s(nbytes, t, tp_gbps) if sp else all_reduce_s(nbytes, t, tp_gbps)
        # each collective's buffer copied in and out (functional collectives are out of place)
        compute += count * gpu.memory_s(2.0 * nbytes * (1.0 / t if sp else 1.0))
        tp_comm = count * one
        launches = 0.0 if math.isinf(tp_gbps) else count * COLLECTIVE_HOST_S
        copy_engines = tp_copy_engine_wanted(cfg, dims) and not math.isinf(tp_gbps)  # TP 2 only
        if cfg.parallel.tp_comm_overlap:  # async TP: the gathers and scatters run under the matmuls
            tp_comm /= 4
        elif copy_engines and sp:
            # the blocks' gathers and scatters as copy-engine trades of half the tokens each way, each under the
            # matmul of a half (parallel/sequence_parallel_ce.py): a share of the transfer shows, and a fixed cost
            # a trade; the embedding's and the head's stay NCCL's
            trades = tp_collectives(cfg, layers, False, False, sp)  # the blocks' (a full recompute's too)
            tp_comm = (count - trades) * one + trades * (TRADE_EXPOSED * (nbytes / 2) / (tp_gbps * 1e9)
                                                         + TRADE_FIXED_S)
        elif copy_engines:
            # the blocks' column-parallel input gradients (QKV's and fc1's) summed by the copy engines beside the
            # weight gradients: a share of each hides
            tp_comm -= EXCHANGE_HIDDEN * 2.0 * layers * one
    if dims.sharded:  # per micro-batch: ZeRO-1/2 gather once a step, ZeRO-1 reduce-scatters once a step
        n_micro = cfg.train.micro_batches_per_step(dims.dp)
        gathers = 2.0 if dims.zero_stage == 3 else 1.0 / n_micro
        scatters = 1.0 if dims.zero_stage > 1 else 1.0 / n_micro
        compute += gpu.memory_s((gathers * FSDP_GATHER_BYTES + scatters * FSDP_SCATTER_BYTES) * block_params(cfg, t)
                                * layers)
    compute *= 1.0 + DEVICE_GAPS
    kind = host_kind(cfg, dims, sp)
    host = gpu.host_ms_per_layer[kind] * 1e-3 * layers + launches if kind else 0.0
    return StageTime(compute, tp_comm, host)


def data_parallel_s(cfg: RunConfig, dims: ParallelDims, gpu: Gpu, params: int, stage: StageTime, n_micro: int,
                    layers: int, gbps: float) -> float:
    """Exposed data-parallel communication per step."""
    d = dims.dp
    if d == 1:
        return 0.0
    half = 2.0 if cfg.precision.half_params else 4.0
    if dims.replicated:
        low = cfg.parallel.grad_reduce_in_bf16
        grad_bytes = (2.0 if low else 4.0) * params
        reduce = all_reduce_s(grad_bytes, d, gbps)
        if dims.distributed_optimizer:  # reduce-scattered, the new weights all-gathered in their dtype and copied in
            reduce = gather_s(grad_bytes, d, gbps) + gather_s(half * params, d, gbps) + gpu.memory_s(2.0 * half * params)
        # --grad-reduce-in-bf16: the fp32 gradients cast down before and copied back after, on the device
        cast = gpu.memory_s(BF16_REDUCE_CAST_BYTES * params) if low else 0.0
        if overlap_grad_reduce(cfg, dims):  # hidden under the last micro-batch's backward but its last bucket
            backward = stage.device * 2 / 3
            return cast + max(reduce - backward, reduce / max(1, layers))
        return cast + reduce
    # FSDP2: gathers under the forward (and the backward at ZeRO-3), reduce-scatters under the backward
    gather = gather_s(half * params, d, gbps)
    scatter = gather_s(4.0 * params, d, gbps)
    forward, backward = stage.device / 3, stage.device * 2 / 3
    if dims.zero_stage == 1 and n_micro > 1:  # gathered once per step, reduce-scattered once, in the last backward
        per_step = max(0.0, gather - forward) + max(0.0, scatter - backward)
        return per_step + (gather + scatter) / max(1, layers)
    backward_comm = scatter + (gather if dims.zero_stage == 3 else 0.0)
    per_micro = max(0.0, gather - forward) + max(0.0, backward_comm - backward)
    return n_micro * per_micro + (gather + scatter) / max(1, layers)


def grad_accumulation_s(cfg: RunConfig, dims: ParallelDims, gpu: Gpu, params: float, n_micro: int) -> float:
    """A step's gradient traffic beyond one micro-batch's, on whole replicas (FSDP2 keeps its own:
    FSDP_SCATTER_BYTES a micro-batch)."""
    if dims.sharded:
        return 0.0
    if not cfg.precision.half_params:
        extra = FP32_ADD_BYTES * (n_micro - 1)
    elif dims.pp > 1:  # each gradient added into its main gradient as it arrives, from the first micro-batch
        extra = 4.0 + MAIN_GRAD_ADD_BYTES * n_micro - AUTOGRAD_ADD_BYTES
    elif overlap_grad_reduce(cfg, dims):  # copied in the first micro-batch, added after
        extra = MAIN_GRAD_ADD_BYTES * (n_micro - 1)
    else:
        extra = AUTOGRAD_ADD_BYTES * (n_micro - 1)
    return gpu.memory_s(extra * params)


def offload_s(local_params: float, zero_stage: int, n_micro: int, host_norm: bool = False,
              overlapped: bool = False) -> float:
    """Seconds a step of --cpu-offload spends on the host and the PCIe bus (the optimizer's share); ``host_norm``:
    the gradient norm is taken on the host."""
    fetch = OFFLOAD_FETCH_S_PER_PARAM * n_micro if zero_stage == 3 else 0.0
    norm = OFFLOAD_HOST_NORM_S_PER_PARAM if host_norm else 0.0
    step = OFFLOAD_STEP_S_PER_PARAM * (1 - OFFLOAD_OVERLAP_SAVING if overlapped else 1)
    return local_params * (step + fetch + norm)
