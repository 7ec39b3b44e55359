"""Seconds per optimizer step of a layout, split by where the time goes:

- compute: each block's four matmuls at the calibrated efficiency of their shape (forward, and twice
  its FLOPs in the backward; full recompute runs the forward again, selective the core attention),
  attention on the FLOPs the MFU formula counts, element-wise and memory-bound work (LayerNorms, GELU,
  residuals, dropout, the loss) at the memory bandwidth;
- tensor parallelism: 2 all-reduces forward and 2 backward per block (all-gathers and reduce-scatters
  with --sequence-parallel, the same bytes) over the node's links; the backward's first one overlaps
  the weight-gradient matmul (parallel/tensor_parallel.py), the other three are exposed;
- data parallelism as gptrain does it: whole replicas all-reduce the fp32 (or bf16) main gradients
  after the backward, exposed, unless --overlap-grad-reduce; ZeRO (FSDP2) gathers parameters and
  reduce-scatters gradients block by block under the compute;
- pipeline: the p2p sends of 1F1B, and the bubble (p - 1) / v of a stage's micro-batch time, taken at
  the slowest stage (the last runs the output layer and the loss);
- the optimizer step at the memory bandwidth; the host's time to launch a micro-batch where it exceeds
  the device's (measured per block for one compiled graph, blocks compiled one by one, tensor-parallel
  ranks, FSDP2's hooks; none under CUDA graphs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gptrain.config import RunConfig
from gptrain.parallel.dims import ParallelDims
from gptrain.plan.hardware import Gpu
from gptrain.train.build import overlap_grad_reduce

ELEMENTWISE_BYTES = 74.0  # per token, per hidden unit, per block: fitted to the 345M step's element-wise time
LOSS_BYTES = 8.0  # per token per vocabulary entry: the loss's passes over the half-precision logits
OPTIMIZER_BYTES = 40.0  # per parameter: fused AdamW's reads and writes, the copy back, the norm, the zeroing
COLLECTIVE_LATENCY_S = 20e-6


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
        return max(self.device, self.host)


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
    if ranks == 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * nbytes / (gbps * 1e9) + COLLECTIVE_LATENCY_S


def gather_s(nbytes: float, ranks: int, gbps: float) -> float:
    """All-gather (or reduce-scatter) of ``nbytes`` whole over ``ranks``."""
    if ranks == 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / (gbps * 1e9) + COLLECTIVE_LATENCY_S


def host_kind(cfg: RunConfig, dims: ParallelDims, sp: bool) -> str | None:
    """Which measured host cost per block and micro-batch applies (calibration's host_ms_per_layer):
    graphs replayed by CUDA graphs never wait on the host."""
    if cfg.train.compile_mode == "reduce-overhead":
        return None
    if not cfg.train.compile:
        return "eager"
    if dims.sharded:
        return "fsdp"
    if dims.tp > 1:
        return "tp_sp" if sp else "tp"
    if dims.pp > 1 or overlap_grad_reduce(cfg, dims):
        return "blocks"  # compiled block by block
    return "graph"


def stage_time(cfg: RunConfig, dims: ParallelDims, gpu: Gpu, layers: int, last: bool, sp: bool,
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
    per_block = 3 * (block_mm + attention) + elementwise  # the element-wise bytes are forward and backward's
    if recompute == "full":
        per_block += block_mm + attention + elementwise / 3
    elif recompute == "selective":
        per_block += attention
    compute = layers * per_block
    if last:
        vocab = m.padded_vocab_size // t
        compute += 3 * gpu.matmul_s(tokens, h, vocab) + gpu.memory_s(LOSS_BYTES * tokens * vocab)
    collectives = 3 + (2 if recompute == "full" else 0)  # exposed per block
    if cfg.parallel.tp_comm_overlap:
        collectives = 1
    tp_comm = layers * collectives * all_reduce_s(2.0 * tokens * h, t, tp_gbps) if t > 1 else 0.0
    kind = host_kind(cfg, dims, sp)
    host = gpu.host_ms_per_layer[kind] * 1e-3 * layers if kind else 0.0
    return StageTime(compute, tp_comm, host)


def data_parallel_s(cfg: RunConfig, dims: ParallelDims, params: int, stage: StageTime, n_micro: int,
                    layers: int, gbps: float) -> float:
    """Exposed data-parallel communication per step."""
    d = dims.dp
    if d == 1:
        return 0.0
    half = 2.0 if cfg.precision.half_params else 4.0
    if dims.replicated:
        grad_bytes = (2.0 if cfg.parallel.grad_reduce_in_bf16 else 4.0) * params
        reduce = all_reduce_s(grad_bytes, d, gbps)
        if overlap_grad_reduce(cfg, dims):  # hidden under the last micro-batch's backward but its last bucket
            backward = stage.device * 2 / 3
            return max(reduce - backward, reduce / max(1, layers))
        return reduce
    # FSDP2: gathers under the forward (and the backward at ZeRO-3), reduce-scatters under the backward
    gather = gather_s(half * params, d, gbps)
    scatter = gather_s(4.0 * params, d, gbps)
    forward, backward = stage.device / 3, stage.device * 2 / 3
    if dims.zero_stage == 1:  # gathered once per step, reduce-scattered once, in the last backward
        per_step = max(0.0, gather - forward) + max(0.0, scatter - backward)
        return per_step + (gather + scatter) / max(1, layers)
    backward_comm = scatter + (gather if dims.zero_stage == 3 else 0.0)
    per_micro = max(0.0, gather - forward) + max(0.0, backward_comm - backward)
    return n_micro * per_micro + (gather + scatter) / max(1, layers)
