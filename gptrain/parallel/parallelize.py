"""Apply the layout and the run-time transformations to a built (meta-device) model: activation
recompute -> tensor parallelism -> compile -> FSDP2.

ZeRO-2, ZeRO-3 and ZeRO-1 with pipelines or --cpu-offload run on FSDP2 ``fully_shard`` with a
mixed-precision policy (ZeRO-1 elsewhere: parallel/distributed_optimizer.py): the parameters the
optimizer sees are fp32 shards (the main parameters), each block computes in bf16/fp16 on an
all-gathered copy. ZeRO-2 and ZeRO-3 reduce-scatter the gradients in fp32 as each block's backward
finishes, so communication overlaps compute; ZeRO-1 keeps them whole (fp32) across the step's
micro-batches and reduce-scatters them once, during the last one's backward (train/loop.py). ZeRO-3
frees the gathered copy after each block's forward (and gathers it again for the backward); ZeRO-1
and ZeRO-2 keep it until the backward.

One device and plain data parallelism keep the whole model, compiled as one graph, with fp32 main
copies (train/main_params.py); data parallelism all-reduces the fp32 main-gradient buffer once per
step (parallel/data_parallel.py), or bucket by bucket during the backward with --overlap-grad-reduce
(parallel/grad_buckets.py; the step then compiled in graphs cut where the buckets end,
parallel/bucketed_compile.py). Measured faster than FSDP2 without
resharding, whose per-block hooks cut the compiled graph into blocks and add host work
(benchmarks/RESULTS.md, s5). For the same reason ZeRO-1 over whole replicas (no pipeline, no offload) is
Megatron's distributed optimizer on that path (parallel/distributed_optimizer.py), not FSDP2.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from gptrain.model.gpt import GPT
from gptrain.parallel.dims import ParallelDims


def apply_recompute(model: GPT, mode: str | None) -> None:
    """Megatron's recompute: "full" reruns each block's forward in the backward, "selective" only
    its core attention."""
    model.recompute_blocks = mode == "full"
    for block in model.layers.values():
        block.attn.recompute_core = mode == "selective"


def describe_sharding(dims: ParallelDims, overlap: bool = False, reduce_bf16: bool = False) -> str:
    if dims.distributed_optimizer:
        return (f"ZeRO-1 over {dims.dp} ranks as Megatron's distributed optimizer: whole model on each, each rank's "
                f"1/{dims.dp} of every parameter's rows in fp32 with AdamW's state, gradients reduce-scattered in "
                f"{'bf16' if reduce_bf16 else 'fp32'} once per step, the updated weights all-gathered")
    if dims.replicated:
        when = "in buckets during the last micro-batch's backward" if overlap else "once per step, after the backward"
        return (f"data parallel over {dims.dp} ranks: whole model on each, fp32 main parameters and gradients, "
                f"gradients all-reduced in {'bf16' if reduce_bf16 else 'fp32'} {when}")
    if not dims.sharded:
        where = "one device" if dims.world_size == 1 else "no data parallelism"
        return f"{where}: whole model, fp32 main parameters and gradients"
    how = {1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[dims.zero_stage]
    keep = "gathered per block, freed after its forward" if dims.zero_stage == 3 else \
        "gathered per block, kept until its backward"
    grads = "kept whole (fp32) across the micro-batches and reduce-scattered once, in the last one's backward" \
        if dims.zero_stage == 1 or dims.cpu_offload else "reduce-scattered in fp32 during each backward"
    offload = "; parameters, gradients and optimizer state in host memory" if dims.cpu_offload else ""
    if dims.cpu_offload and dims.offload_fraction < 1:
        offload += (f" for the last whole blocks holding at least --optimizer-offload-fraction "
                    f"{dims.offload_fraction:g} of the parameters")
    return (f"{how} over {dims.dp} rank{'s' if dims.dp > 1 else ''} on FSDP2: fp32 parameter and optimizer-state shards, parameters "
            f"{keep}, gradients {grads}{offload}")


def apply_fsdp(roots: list[nn.Module], model: GPT, mesh: DeviceMesh, dims: ParallelDims,
               param_dtype: torch.dtype | None, offloaded: set[nn.Module] = frozenset()) -> None:
    """FSDP2 over each block and the roots; ``offloaded``: the units whose state lives in host memory
    (--cpu-offload, parallel/offload_split.py)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # pinned host memory only where there is a GPU to copy to (a CPU run's offload is the same memory)
    host = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())

    def offload(module):
        return host if module in offloaded else OffloadPolicy()

    # with tensor parallelism the parameters are already DTensors on the tp dimension: FSDP2 shards
    # them further over dp (a 2-D layout)
    dp_mesh = mesh["dp"]
    reshard = dims.zero_stage == 3
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, offload_policy=offload(block), reshard_after_forward=reshard)
    # the root holds the embeddings, the tied output layer and the final LayerNorm; the backward
    # starts with them, so they are never freed after the forward
    # (with pipeline parallelism each stage is a root)
    for root in roots:
        fully_shard(root, mesh=dp_mesh, mp_policy=policy, offload_policy=offload(root), reshard_after_forward=False)


def parallelize(train_module: nn.Module, model: GPT, dims: ParallelDims, mesh: DeviceMesh | None,
                recompute: str | None, param_dtype: torch.dtype | None, compile_model: bool,
                compile_mode: str | None, sequence_parallel: bool = False,
                pipeline_chunks: list[nn.Module] | None = None, bucket_bytes: int = 0,
                comm_overlap: bool = False, offloaded: set[nn.Module] = frozenset(), tp_copy_engine: bool = False):
    """Transform in place; returns the callable the trainer runs forward through:
    ``(tokens, labels, loss_mask) -> loss`` (None with pipeline parallelism: the schedule runs the
    ``pipeline_chunks``) and the tensor-parallel ``ShardLayout`` (empty without tensor parallelism).
    ``bucket_bytes``: on whole replicas, compile the step in graphs of about that many bytes of
    parameters, so gradients reach their hooks as each graph's backward ends (overlapped data-parallel
    reduction, parallel/bucketed_compile.py). ``comm_overlap``:
    async tensor parallelism (parallel/async_tp.py). ``offloaded``: the FSDP2 units --cpu-offload keeps in host
    memory (parallel/offload_split.py). ``tp_copy_engine``: --tp-comm-copy-engine (parallel/copy_engine.py)."""
    from gptrain.parallel.tensor_parallel import ShardLayout, VocabParallelLMLoss, apply_tensor_parallel

    apply_recompute(model, recompute)
    layout = ShardLayout()
    if dims.tp > 1:
        layout = apply_tensor_parallel(model, mesh, sequence_parallel, comm_overlap, tp_copy_engine)
        if comm_overlap:
            from gptrain.parallel.async_tp import enable_async_tp

            enable_async_tp(mesh["tp"].get_group())
        loss = train_module.loss
        train_module.loss = VocabParallelLMLoss(loss.vocab_size, layout.tp, tuned=loss.tuned)
    return _compile_and_shard(train_module, model, dims, mesh, param_dtype, compile_model, compile_mode,
                              pipeline_chunks, bucket_bytes, offloaded), layout


def _compile_and_shard(train_module, model, dims, mesh, param_dtype, compile_model, compile_mode, pipeline_chunks,
                       bucket_bytes, offloaded):
    if not dims.sharded and not pipeline_chunks:
        if not compile_model:
            return train_module
        if bucket_bytes:  # --overlap-grad-reduce: cut where the gradient buckets end
            from gptrain.parallel.bucketed_compile import compile_in_buckets

            return compile_in_buckets(train_module, compile_mode, bucket_bytes)
        # one device or whole replicas: the whole step's forward compiles as one graph
        return torch.compile(train_module, mode=compile_mode)
    if compile_model:
        # per block, so FSDP2's hooks sit between compiled regions and each block's gradient
        # reduction starts as soon as its backward ends (and a pipeline stage is a run of blocks)
        for block in model.layers.values():
            block.compile(mode=compile_mode)
        train_module.loss.compile(mode=compile_mode)
    if dims.sharded:
        apply_fsdp(pipeline_chunks or [train_module], model, mesh, dims, param_dtype, offloaded)
    return None if pipeline_chunks else train_module
