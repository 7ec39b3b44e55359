"""Bytes per GPU of a layout, following what gptrain keeps in which dtype:

- one device or whole replicas with --bf16/--fp16 (train/main_params.py): half-precision weights (2 B),
  fp32 main copies (4 B) and AdamW moments (8 B) always; the fp32 main-gradient buffer (4 B) from the
  first backward to the optimizer step, beside the model's half-precision gradients until they are
  moved into it (after the backward; as they arrive under a pipeline or --overlap-grad-reduce);
- fp32 parameters (no --bf16/--fp16, or --autocast): weights 4 B, gradients 4 B, moments 8 B;
- ZeRO-1 as the distributed optimizer (parallel/distributed_optimizer.py): as whole replicas, but the fp32 main
  weights and moments of this rank's rows only (12 B / dp; with fp32 parameters the model's own rows, 8 B / dp,
  beside the whole gradient buffer and the model's gradients, 8 B);
- ZeRO-2/3 on FSDP2, and ZeRO-1 with pipelines or offload (parallel/parallelize.py): fp32 parameter and moment shards (12 B / dp; in host memory with
  --cpu-offload, 16 B / dp with the gradients, leaving the gathered copies on the GPU, and the fp32
  gradients whole over several micro-batches), gradients whole
  in fp32 at ZeRO-1 over several micro-batches, else fp32 shards; half-precision copies gathered per
  block (kept until the backward at ZeRO-1/2; at ZeRO-3 the root's, the running and the prefetched block's);
- activations per layer and micro-batch (Korthikanti et al. 2022, arXiv 2205.05198, in units of s b h
  bytes): 34 on one GPU (32 without hidden dropout: its two 1-byte masks); 10 + 24/t with tensor
  parallelism; 34/t with sequence parallelism, plus the gathered inputs of QKV and fc1 that gptrain's column-parallel layers keep (4 (t-1)/t); the 5 a s / h
  attention-score term only without a flash kernel; selective recompute saves the core attention's
  output (2/t); full recompute keeps each block's input (2, or 2/t with SP) and one block's working set;
- the micro-batches a pipeline stage holds (1F1B: p - stage; interleaved: Megatron's 1 + (p-1)/(p v)),
  the logits (bf16; the vocabulary-parallel loss adds an fp32 temporary), gradient-reduction buckets.

The figures are what PyTorch's allocator reports as max allocated; ``fits`` adds the allocator's slack
and the CUDA context.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from functools import lru_cache

import torch

from gptrain.config import RunConfig
from gptrain.parallel.dims import ParallelDims
from gptrain.train.build import overlap_grad_reduce, tp_copy_engine_wanted

GIB = 1024 ** 3
ALLOCATOR_SLACK = 0.05  # reserved over allocated: fragmentation of the caching allocator
CONTEXT_GIB = 1.0  # CUDA context, cuBLAS workspaces and NCCL buffers, outside the allocator
FLASH_BACKENDS = ("auto", "flash", "fused", "flash4")  # SDPA kernels that never hold the s x s scores


@dataclass
class Memory:
    """Bytes at the step's peak on the fullest rank, by kind."""
    weights: float = 0.0  # the parameters the forward reads (half or fp32)
    main_params: float = 0.0  # fp32 main copies or FSDP2's fp32 shards
    grads: float = 0.0
    optimizer: float = 0.0  # AdamW's two moments
    activations: float = 0.0
    logits: float = 0.0
    buckets: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def gib(self) -> float:
        return self.total / GIB

    def state_bytes(self) -> float:
        """Parameters, gradients and optimizer state (what a run allocates before activations)."""
        return self.weights + self.main_params + self.grads + self.optimizer


@lru_cache(maxsize=64)
def _block_params(model_key: tuple, tp: int) -> int:
    from gptrain.model.gpt import GPT, GPTConfig
    from gptrain.parallel.layout import _tp_numel

    with torch.device("meta"):
        model = GPT(GPTConfig(**{**dict(model_key), "num_layers": 1}))
    return sum(_tp_numel(n, p.numel(), tp) for n, p in model.named_parameters() if n.startswith("layers."))


def block_params(cfg: RunConfig, tp: int) -> int:
    """One transformer block's parameters on a tensor-parallel rank."""
    return _block_params(tuple(sorted(dataclasses.asdict(cfg.model).items())), tp)


def fits(memory_gib: float, gpu_gib: float) -> bool:
    return memory_gib * (1 + ALLOCATOR_SLACK) + CONTEXT_GIB <= gpu_gib


def activation_units(cfg: RunConfig, tp: int, sp: bool, recompute: str | None) -> float:
    """Bytes per layer per token-times-hidden (s b h) held for the backward."""
    m = cfg.model
    scores = 0.0 if cfg.kernels.attention_backend in FLASH_BACKENDS else 5.0 * m.num_attention_heads * m.seq_length / m.hidden_size / tp
    if recompute == "full":
        return 2.0 / tp if sp else 2.0
    masks = 2.0 if m.hidden_dropout > 0 else 0.0  # the two hidden-dropout masks (1 B each)
    if tp == 1:
        units = 32.0 + masks + scores
    elif sp:
        units = (32.0 + masks) / tp + 4.0 * (tp - 1) / tp + scores
    else:
        units = 8.0 + masks + 24.0 / tp + scores
    if recompute == "selective":
        units -= 2.0 / tp + scores
    return units


def in_flight(pp: int, stage: int, micro_batches: int, virtual: int) -> float:
    """Micro-batches whose activations a pipeline stage holds at once."""
    if pp == 1:
        return 1.0
    held = min(micro_batches, pp - stage)
    if virtual > 1:
        held *= 1 + (pp - 1) / (pp * virtual)
    return held


def stage_memory(cfg: RunConfig, dims: ParallelDims, params: int, layers: int, stage: int, virtual: int,
                 sp: bool) -> Memory:
    """Peak bytes of one rank of pipeline stage ``stage`` holding ``params`` parameters and ``layers`` blocks."""
    m, t = cfg.model, dims.tp
    b, s, h = cfg.train.micro_batch_size, m.seq_length, m.hidden_size
    n_micro = cfg.train.micro_batches_per_step(dims.dp)
    recompute = cfg.kernels.recompute
    half = cfg.precision.half_params
    act = activation_units(cfg, t, sp, recompute) * s * b * h * layers * in_flight(dims.pp, stage, n_micro, virtual)
    # the block being recomputed holds its whole working set
    working = activation_units(cfg, t, sp, None) * s * b * h if recompute == "full" else 0.0
    act += working
    last = stage == dims.pp - 1
    logits = 0.0
    if last and not cfg.kernels.fused_cross_entropy:
        vocab = m.padded_vocab_size / t
        logits = s * b * vocab * (2.0 if half else 4.0) + (s * b * vocab * 4.0 if t > 1 else 0.0)
    mem = state_memory(cfg, dims, params, layers)
    mem.activations, mem.logits = act, logits
    if overlap_grad_reduce(cfg, dims) and cfg.parallel.grad_reduce_in_bf16:
        mem.buckets = 2.0 * (cfg.parallel.ddp_bucket_size or 40_000_000)  # the bf16 copy of a bucket
    if tp_copy_engine_wanted(cfg, dims):
        # the copy engines' buffer (TP 2's default): a micro-batch's input gradient, or with sequence parallelism
        # two receiving slots of half its tokens: the same size
        mem.buckets += (2.0 if half else 4.0) * s * b * h
    if overlap_grad_reduce(cfg, dims) and cfg.parallel.grad_reduce_copy_engine:
        # the copy engines' symmetric buffer: a bucket's two halves, in the reduction's dtype
        mem.buckets += (2.0 if cfg.parallel.grad_reduce_in_bf16 else 4.0) * (cfg.parallel.ddp_bucket_size or 40_000_000)
    if dims.cpu_offload and dims.pp == 1:
        _offload_peak(mem, cfg, dims, params, layers, act, working, logits)
    if dims.pp == 1 and half and not dims.sharded and not overlap_grad_reduce(cfg, dims):
        # gradients move into the fp32 buffer after the backward, when the activations are gone: the
        # first forward's end holds no gradients, the backward's end the half-precision ones and the
        # buffer, which then stays through the later micro-batches' forwards until the step
        grads = mem.grads
        held = grads if n_micro > 1 else 0.0
        if grads + 2.0 * params > act + logits + held:
            mem.grads, mem.activations, mem.logits = grads + 2.0 * params, 0.0, 0.0
        else:
            mem.grads = held
    return mem


def _offload_peak(mem: Memory, cfg: RunConfig, dims: ParallelDims, params: int, layers: int, act: float,
                  working: float, logits: float) -> None:
    """With --cpu-offload the GPU holds no optimizer state (but for the units --optimizer-offload-fraction keeps),
    and its peak (measured, benchmarks/memory_peak.py) is either the forward's end (the saved block inputs and the
    logits) or the first blocks' backward, after the logits are freed: the recomputed block's working set, a
    block's fp32 gradients on their way to the host, and the root's gradient (the tied embedding's, from the loss
    on), which the root reduces last. With several micro-batches the whole fp32 gradients they accumulate into are
    held through both. ``working``: the recomputed block's share of ``act``."""
    root_grad = (2.0 if cfg.precision.half_params else 4.0) * (params - layers * block_params(cfg, dims.tp))
    held = mem.grads if cfg.train.micro_batches_per_step(dims.dp) > 1 else 0.0
    backward = mem.grads + act + root_grad
    forward_end = held + act - working + logits
    # --optimizer-offload-fraction: the backward's end holds the kept units' fp32 gradients (their fp32 shards are
    # main_params), every block's gathered copy freed; with few blocks offloaded that is the peak
    kept_grads = mem.main_params + 4.0 * block_params(cfg, dims.tp)
    if kept_grads > mem.weights + max(backward, forward_end):
        mem.weights, mem.grads, mem.activations, mem.logits = 0.0, kept_grads, 0.0, 0.0
    elif backward >= forward_end:
        mem.grads, mem.activations, mem.logits = mem.grads + root_grad, act, 0.0
    else:
        mem.grads, mem.activations, mem.logits = held, act - working, logits


def offloaded_share(cfg: RunConfig, dims: ParallelDims) -> float:
    """The share of the parameters --cpu-offload keeps in host memory: whole units picked on the full shapes as
    train/build.py picks them (parallel/offload_split.py)."""
    if not dims.cpu_offload:
        return 0.0
    if dims.offload_fraction >= 1.0:
        return 1.0
    from gptrain.parallel.offload_split import offloaded_count

    sizes = unit_sizes(cfg)
    return sum(sizes[len(sizes) - offloaded_count(sizes, dims.offload_fraction):]) / sum(sizes)


def unit_sizes(cfg: RunConfig) -> list[int]:
    """The FSDP2 units' parameter counts in forward order, on the full shapes: the root's, then each block's."""
    layers, block = cfg.model.num_layers, block_params(cfg, 1)
    return [cfg.model.num_parameters() - layers * block, *([block] * layers)]


def offload_host_gib(cfg: RunConfig, dims: ParallelDims) -> float:
    """Host memory a rank's --cpu-offload takes: fp32 parameter, gradient and AdamW moment shards."""
    if not dims.cpu_offload:
        return 0.0
    return 16.0 * offloaded_share(cfg, dims) * cfg.model.num_parameters() / (dims.tp * dims.pp * dims.dp) / GIB


def state_memory(cfg: RunConfig, dims: ParallelDims, params: int, layers: int) -> Memory:
    """Parameters, gradients (after the backward, accumulated in their step-long dtype) and AdamW's
    state of one rank holding ``params`` parameters in ``layers`` blocks."""
    half = cfg.precision.half_params
    if dims.sharded:
        d = dims.dp
        # ZeRO-3 holds the root's parameters (embeddings, final LayerNorm) gathered, and two blocks'
        gathered = params if dims.zero_stage < 3 else params - max(0, layers - 2) * block_params(cfg, dims.tp)
        if dims.cpu_offload:  # FSDP2's CPU offload: shards, gradients and moments in host memory
            # (offload_host_gib); on the GPU the gathered copies and a block's fp32 gradients in flight,
            # or with several micro-batches the whole gradients they accumulate into (train/loop.py); the units
            # --optimizer-offload-fraction keeps on the GPU hold their fp32 shards and moments there (their reduced
            # gradients come at the backward's end, the first blocks' and the root's, when the activations are gone)
            accumulate = cfg.train.micro_batches_per_step(dims.dp) > 1
            kept = (1.0 - offloaded_share(cfg, dims)) * params / d
            return Memory(weights=(2.0 if half else 4.0) * gathered, main_params=4.0 * kept, optimizer=8.0 * kept,
                          grads=4.0 * (params if accumulate else block_params(cfg, dims.tp)))
        # ZeRO-1 reduce-scatters in the last micro-batch's backward: with one, its gradients are ZeRO-2's
        whole = dims.zero_stage == 1 and cfg.train.micro_batches_per_step(d) > 1
        return Memory(weights=(2.0 if half else 4.0) * gathered,
                      main_params=4.0 * params / d, optimizer=8.0 * params / d,
                      grads=4.0 * params if whole else 4.0 * params / d)
    # the distributed optimizer: its rows' fp32 main weights (the model's own with fp32 parameters) and moments; the
    # whole gradient buffer (beside the model's fp32 gradients when those are fp32, as plain data parallelism's
    # flattened copy; the reduced rows fit in the freed half-precision gradients)
    d = dims.dp if dims.distributed_optimizer else 1
    if not half:
        autocast_copies = 2.0 * params if cfg.precision.autocast else 0.0
        return Memory(weights=4.0 * params + autocast_copies, grads=4.0 * params * (2 if d > 1 else 1),
                      optimizer=8.0 * params / d)
    return Memory(weights=2.0 * params, main_params=4.0 * params / d, grads=4.0 * params, optimizer=8.0 * params / d)
