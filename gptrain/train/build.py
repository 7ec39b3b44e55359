"""The one model-assembly pipeline, in torchtitan's order:

    build on the meta device -> converters (fp8, kernels) -> parallelize (recompute, compile,
    FSDP2) -> to_empty -> init_weights -> (one device: fp32 main copies) -> optimizer

The Trainer receives the parts. Weights are initialised after sharding, each process drawing
only the elements it holds from a counter-based generator keyed by each element's place in the
full tensor (model/init_draw.py), so for a seed the full weights are the same at every layout.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from gptrain.config import RunConfig
from gptrain.kernels.convert import KernelChoice, apply_kernels
from gptrain.model.fp8 import convert_to_fp8
from gptrain.model.gpt import GPT
from gptrain.model.loss import LMLoss
from gptrain.parallel.comm_options import comm_options
from gptrain.parallel.dims import ParallelDims
from gptrain.parallel.parallelize import describe_sharding, parallelize
from gptrain.parallel.tensor_parallel import ShardLayout
from gptrain.parallel.pipeline import Pipeline, StageShapes, check_micro_batches, pipeline_chunks, prune_for_stage, stage_layer_counts, virtual_stages
from gptrain.train.checkpoint import init_optimizer_state
from gptrain.parallel.distributed_optimizer import ShardedMainParams
from gptrain.train.main_params import MainParams
from gptrain.train.rampup import rampup_of


class TrainModule(nn.Module):
    """The model and its loss as one module: what is compiled on one device and what FSDP2's root
    wraps, so the tied output layer's weight is gathered while the loss uses it."""

    def __init__(self, model: GPT, loss: LMLoss):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None):
        return self.loss(self.model(tokens), self.model.output_layer.weight, labels, loss_mask)


@dataclass
class TrainingParts:
    model: GPT
    train_module: TrainModule
    forward: Callable  # (tokens, labels, loss_mask) -> mean loss
    # the fp32 main copies: whole (one device, plain data parallelism, bf16/fp16 parameters) or this rank's rows
    # (the distributed optimizer, any precision)
    main: MainParams | ShardedMainParams | None
    opt_params: dict[str, torch.Tensor]  # what the optimizer updates and checkpoints hold, by name
    optimizer: torch.optim.Optimizer
    dims: ParallelDims
    mesh: DeviceMesh | None
    impls: dict[str, KernelChoice | str]  # what runs, by part, for the log (kernels' choices typed)
    fp8_layers: int
    pipeline: Pipeline | None = None  # pipeline parallelism: the schedule runs forward and backward
    layout: ShardLayout = field(default_factory=ShardLayout)  # which parameter is split over tensor-parallel ranks
    grad_buckets: object = None  # --overlap-grad-reduce: parallel/grad_buckets.GradBuckets
    host_step: object = None  # --overlap-cpu-optimizer-d2h-h2d: train/host_optimizer_step.OverlappedHostStep
    grad_squares: object = None  # --cpu-offload: parallel/reduced_grad_norm.ReducedGradSquares
    local_step: object = None  # the distributed optimizer: train/fused_step.FusedStep over its DTensors' local rows


def parallel_dims(cfg: RunConfig, world_size: int) -> ParallelDims:
    p = cfg.parallel
    comm, ignored = comm_options(p.nccl_communicator_config_path, p.high_priority_stream_groups)
    dims = ParallelDims(world_size=world_size, tp=p.tensor_parallel, pp=p.pipeline_parallel,
                        zero_stage=p.zero_stage, cpu_offload=p.cpu_offload,
                        offload_fraction=p.offload_fraction,
                        comm=tuple(comm.items()), comm_ignored=tuple(ignored))
    par = cfg.parallel
    uneven = par.first_stage_layers is not None or par.last_stage_layers is not None
    dims.validate(cfg.model.num_layers, cfg.model.num_attention_heads, cfg.train.micro_batch_size,
                  cfg.train.global_batch_size, uneven_stages=uneven)
    if uneven:
        if par.layers_per_virtual_stage:
            raise ValueError("--decoder-first/last-pipeline-num-layers with --num-layers-per-virtual-pipeline-stage "
                             "is not built: use one or the other")
        stage_layer_counts(cfg.model.num_layers, dims.pp, par.first_stage_layers, par.last_stage_layers)
    if cfg.parallel.sequence_parallel and dims.tp == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size above 1")
    if cfg.parallel.sequence_parallel and cfg.model.seq_length % dims.tp:
        raise ValueError(f"--sequence-parallel: --seq-length {cfg.model.seq_length} is not divisible by "
                         f"tensor-model-parallel size {dims.tp}")
    if cfg.parallel.tp_comm_copy_engine and cfg.parallel.no_tp_comm_copy_engine:
        raise ValueError("--tp-comm-copy-engine and --no-tp-comm-copy-engine contradict each other: give one")
    if cfg.parallel.tp_comm_copy_engine and (dims.tp != 2 or cfg.parallel.tp_comm_overlap):
        raise ValueError("--tp-comm-copy-engine moves a tensor-parallel pair's activations by the copy engines: "
                         f"it needs --tensor-model-parallel-size 2 (got {dims.tp}) without --tp-comm-overlap")
    if cfg.parallel.tp_comm_copy_engine and cfg.precision.autocast:
        # its ops multiply inside themselves, in the parameters' dtype, and trade buffers of that dtype
        raise ValueError("--tp-comm-copy-engine with --autocast is not built: its buffers and matmuls take the "
                         "parameters' dtype (use half-precision parameters: leave out --autocast)")
    if cfg.parallel.grad_reduce_copy_engine and not overlap_grad_reduce(cfg, dims):
        raise ValueError("--grad-reduce-copy-engine reduces --overlap-grad-reduce's buckets: it needs "
                         "--overlap-grad-reduce with plain data parallelism (no ZeRO stage, no pipeline)")
    if cfg.parallel.grad_reduce_copy_engine and dims.dp != 2:
        raise ValueError(f"--grad-reduce-copy-engine joins two GPUs of one host: data-parallel size {dims.dp}")
    if cfg.parallel.overlap_cpu_optimizer and not dims.cpu_offload:
        raise ValueError("--overlap-cpu-optimizer-d2h-h2d overlaps the host's optimizer step: it needs --cpu-offload")
    if cfg.parallel.overlap_cpu_optimizer and dims.pp > 1:
        raise ValueError("--overlap-cpu-optimizer-d2h-h2d with pipeline parallelism is not built yet (the stages' "
                         "forwards are the schedule's): leave it out or use --pipeline-model-parallel-size 1")
    if (dims.sharded or dims.distributed_optimizer or dims.tp > 1 or dims.pp > 1) and cfg.precision.fp8:
        raise ValueError("--fp8 with ZeRO, tensor or pipeline parallelism is not built yet (fp8 runs on one "
                         "device or with plain data parallelism)")
    virtual = virtual_stages(cfg.model.num_layers, dims.pp, cfg.parallel.layers_per_virtual_stage)
    check_micro_batches(cfg.train.micro_batches_per_step(dims.dp), dims.pp, virtual)
    rampup = rampup_of(cfg.train)
    for batch in (rampup.sizes() if rampup is not None and dims.pp > 1 else []):
        try:  # the pipeline runs each ramp-up batch's micro-batch count (parallel/pipeline.py)
            check_micro_batches(batch // (cfg.train.micro_batch_size * dims.dp), dims.pp, virtual)
        except ValueError as err:
            raise ValueError(f"--rampup-batch-size: at global batch {batch}, {err}") from None
    return dims


DECOUPLED_LR_PARAMS = ("word_embeddings.weight", "output_layer.weight")  # Megatron's is_embedding_or_output_parameter


def build_optimizer(params: dict[str, torch.Tensor], cfg: RunConfig) -> torch.optim.AdamW:
    """AdamW over the named parameters; biases and LayerNorm parameters without weight decay
    (Megatron's rule); with --decoupled-lr the word embeddings and output layer in groups marked
    ``decoupled`` (the Trainer gives those their own rate)."""
    from torch.distributed.tensor import DTensor

    # one group per (weight decay, DTensor or not, decoupled rate): the fused kernel takes one kind of tensor per
    # call, and tensor parallelism leaves LayerNorms and position embeddings plain
    decoupled_lr = cfg.optim.decoupled_lr is not None
    groups: dict[tuple[bool, bool, bool], list[torch.Tensor]] = {}
    for name, p in params.items():
        groups.setdefault((p.ndim > 1, isinstance(p, DTensor), decoupled_lr and name in DECOUPLED_LR_PARAMS),
                          []).append(p)
    groups = [{"params": ps, "weight_decay": cfg.optim.weight_decay if decay else 0.0, "decoupled": decoupled}
              for (decay, _, decoupled), ps in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1],
                                                                                        kv[0][2]))]
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2),
                             eps=cfg.optim.adam_eps, fused=True)


def _kernels_for_layout(cfg: RunConfig, device: torch.device, dims: ParallelDims):
    """The kernel settings this layout can use: async tensor parallelism needs torch's matmuls."""
    if not cfg.parallel.tp_comm_overlap:
        return cfg.kernels
    from gptrain.parallel.async_tp import check_async_tp

    simulated = torch.distributed.is_initialized() and torch.distributed.get_backend() == "fake"
    check_async_tp(dims.tp, cfg.parallel.sequence_parallel, cfg.train.compile, device, simulated,
                   cfg.train.compile_mode)
    if cfg.kernels.linear_impl == "cublaslt":
        raise ValueError("--tp-comm-overlap runs the linear layers on torch's matmuls: leave out --linear-impl cublaslt")
    return dataclasses.replace(cfg.kernels, linear_impl="torch")


def build_training(cfg: RunConfig, device: torch.device, dims: ParallelDims, mesh: DeviceMesh | None,
                   log=print) -> TrainingParts:
    p = cfg.precision
    kernels = _kernels_for_layout(cfg, device, dims)
    compute_dtype = torch.bfloat16 if p.bf16 else torch.float16 if p.fp16 else torch.float32
    param_dtype = compute_dtype if p.half_params else None  # None: fp32 parameters (autocast or fp32)
    with torch.device("meta"):
        model = GPT(cfg.model)
        loss_vocab = cfg.model.padded_vocab_size if cfg.kernels.softmax_over_padded_vocab else cfg.model.vocab_size
        loss = LMLoss(loss_vocab, fused=cfg.kernels.fused_cross_entropy)
        plan, chunks = None, None
        if dims.pp > 1:  # this rank's layers only, and the stages it runs over them
            plan = prune_for_stage(model, dims, mesh["pp"].get_local_rank(),
                                   virtual_stages(cfg.model.num_layers, dims.pp, cfg.parallel.layers_per_virtual_stage),
                                   cfg.parallel.first_stage_layers, cfg.parallel.last_stage_layers)
            chunks = pipeline_chunks(model, plan)
    train_module = TrainModule(model, loss)
    # converters: module swaps on the meta model, told the device and dtype the parameters will have
    fp8_layers = convert_to_fp8(model, p.fp8, p.fp8_recipe, emulate=device.type != "cuda") if p.fp8 else 0
    impls = apply_kernels(model, loss, kernels, device, param_dtype or torch.float32,
                          cfg.train.micro_batch_size * cfg.model.seq_length, fp8=bool(p.fp8),
                          compiled=cfg.train.compile, sharded=dims.sharded,
                          tensor_parallel=dims.tp)
    mode = step_compile_mode(cfg, dims, device.type == "cuda")
    offloaded = set()
    if dims.cpu_offload:  # the units whose state lives in host memory, chosen on the full shapes
        from gptrain.parallel.offload_split import offloaded_modules

        offloaded = offloaded_modules(chunks or [train_module], list(model.layers.values()), dims.offload_fraction)
    wanted = tp_copy_engine_wanted(cfg, dims)
    tp_copy_engine = wanted and _set_up_tp_copy_engine(cfg, mesh, device, param_dtype, impls)
    if dims.tp == 2 and not wanted and not cfg.parallel.tp_comm_overlap:
        impls["tensor parallel"] = _why_tp_on_nccl(cfg)
    forward, layout = parallelize(train_module, model, dims, mesh, cfg.kernels.recompute, param_dtype,
                                  cfg.train.compile, mode, cfg.parallel.sequence_parallel, chunks,
                                  bucket_bytes=overlap_bucket_bytes(cfg, dims, param_dtype),
                                  comm_overlap=cfg.parallel.tp_comm_overlap, offloaded=offloaded,
                                  tp_copy_engine=tp_copy_engine)
    if mode != cfg.train.compile_mode:
        impls["compile"] = ("CUDA graphs over the compiled step (--compile-mode reduce-overhead, the default for "
                            "tensor parallelism on GPUs; --compile-mode default leaves them out)")
    impls["parameters"] = describe_sharding(dims, overlap_grad_reduce(cfg, dims), cfg.parallel.grad_reduce_in_bf16)
    if dims.cpu_offload and dims.offload_fraction < 1.0:
        blocks = list(model.layers.values())
        kept = len([b for b in blocks if b not in offloaded])
        first = f"the first {kept} blocks and " if kept else ""
        impls["offload"] = (f"--optimizer-offload-fraction {dims.offload_fraction:g}: the last "
                            f"{len(blocks) - kept} of {len(blocks)} blocks in host memory, {first}the root "
                            f"(embeddings, output layer) on the {'GPU' if device.type == 'cuda' else device.type}")
    # everything in host memory at fraction 1, the loss's module too (a pipeline's roots are its chunks)
    whole = dims.cpu_offload and dims.offload_fraction >= 1
    materialize(train_module, offloaded | ({train_module} if whole else set()), device)
    model.tie_output_layer()  # to_empty made new tensors
    model.init_weights(cfg.data.seed, layout.region if dims.tp > 1 else None)
    main = None
    if dims.distributed_optimizer:  # this rank's rows of the fp32 main weights, whatever the parameters' dtype
        main = ShardedMainParams(model, param_dtype or torch.float32, mesh["dp"])
    elif p.half_params and not dims.sharded:
        # one device: bf16/fp16 model, fp32 main copies taken from the exact initialisation
        main = MainParams(model, compute_dtype)
        if chunks:  # the schedule runs every micro-batch's backward: accumulate in fp32 as they come
            main.accumulate_on_backward()
    opt_params = main.named() if main else dict(model.named_parameters())
    buckets = None
    if overlap_grad_reduce(cfg, dims):
        from gptrain.parallel.grad_buckets import overlap_reduction

        buckets = overlap_reduction(list(opt_params.values()), main, mesh["dp"].get_group(), dims.dp,
                                    cfg.parallel.ddp_bucket_size,
                                    torch.bfloat16 if cfg.parallel.grad_reduce_in_bf16 else None,
                                    copy_engine=cfg.parallel.grad_reduce_copy_engine,
                                    timeout_s=60 * cfg.parallel.distributed_timeout_minutes)
        impls["gradient reduction"] = (f"overlapped with the backward in buckets of "
                                       f"{cfg.parallel.ddp_bucket_size or 40_000_000:,} elements "
                                       f"({len(buckets.spans)} buckets), the compiled step cut where they end"
                                       + (", all-reduced by the copy engines" if buckets.copy_engine else ""))
    optimizer = build_optimizer(opt_params, cfg)
    local_step = None
    if dims.distributed_optimizer:
        from gptrain.train.fused_step import FusedStep

        local_step = FusedStep(optimizer, {id(p) for p in opt_params.values()})
        if cfg.parallel.overlap_grad_reduce:
            impls["gradient reduction"] = ("reduce-scattered once after the backward: --overlap-grad-reduce is not "
                                           "built for the distributed optimizer yet")
    # AdamW's state exists from the start (what fused AdamW would create at its first step), so a
    # checkpoint written before the first update (fp16's first steps are skipped) holds it all
    init_optimizer_state(opt_params, optimizer)
    if dims.cpu_offload:
        from gptrain.train.host_threads import offload_threads

        threads = offload_threads()
        if threads is not None:
            torch.set_num_threads(threads[0])
            impls["host threads"] = f"{threads[0]} for the offloaded optimizer ({threads[1]})"
    grad_squares = None
    # the squares FSDP2's hook sees are this rank's share of the norm only where nothing changes the reduced
    # gradients after it (train/loop.py: sequence parallelism's sums and a pipeline's tied embedding do) and
    # FSDP2 divides them inside the collective (fp32 reduction, parallelize.apply_fsdp: no post-division)
    from gptrain.parallel.reduced_grad_norm import ReducedGradSquares, sums_on_device

    if sums_on_device(dims):

        grad_squares = ReducedGradSquares([*model.layers.values(), train_module], device)
    host_step = None
    if cfg.parallel.overlap_cpu_optimizer:
        from gptrain.train.host_optimizer_step import OverlappedHostStep, block_order

        host_step = OverlappedHostStep(optimizer, block_order(train_module, model, opt_params), device)
        impls["optimizer"] = ("the host's AdamW on a thread, block by block, each block's next forward waiting "
                              "for its update")
    pipeline = None
    if chunks:
        n_micro = cfg.train.micro_batches_per_step(dims.dp)
        shapes = StageShapes.of(cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.hidden_size,
                                param_dtype or torch.float32, dims.tp if cfg.parallel.sequence_parallel else 1)
        pipeline = Pipeline(model, train_module.loss, chunks, plan, dims, mesh, device, n_micro,
                            None if p.half_params else compute_dtype if compute_dtype != torch.float32 else None,
                            shapes)
        impls["pipeline"] = pipeline.describe()
    return TrainingParts(model, train_module, forward, main, opt_params, optimizer, dims, mesh, impls, fp8_layers,
                         pipeline, layout, buckets, host_step, grad_squares, local_step)


def materialize(train_module: nn.Module, offloaded: set[nn.Module], device: torch.device) -> None:
    """The meta model's tensors made real, uninitialised: the offloaded units' in host memory (FSDP2's
    CPUOffloadPolicy takes them there), the rest on the device."""
    on_host = {id(m) for unit in offloaded for m in unit.modules()}
    # children first: an FSDP2 unit's own _apply (run by to_empty) lays out its shards from its submodules'
    for module in reversed(list(train_module.modules())):
        module.to_empty(device=torch.device("cpu") if id(module) in on_host else device, recurse=False)


def step_compile_mode(cfg: RunConfig, dims: ParallelDims, cuda: bool) -> str | None:
    """torch.compile's mode for the step: the flag's; by default CUDA graphs (reduce-overhead) for tensor
    parallelism on GPUs where the whole step compiles as one graph, since a TP rank's smaller kernels and
    its collectives otherwise leave the GPU waiting on the host's launches (benchmarks/RESULTS.md, the
    rank simulator); ``--compile-mode default`` leaves them out."""
    mode = cfg.train.compile_mode
    if mode is not None or not cfg.train.compile or dims.tp == 1 or not cuda:
        return mode
    if dims.sharded or dims.pp > 1 or overlap_grad_reduce(cfg, dims) or cfg.parallel.tp_comm_overlap:
        return None  # several compiled graphs with hooks between them, or async TP (which graphs do not take)
    return "reduce-overhead"


def overlap_bucket_bytes(cfg: RunConfig, dims: ParallelDims, param_dtype: torch.dtype | None) -> int:
    """Bytes of parameters per compiled graph under --overlap-grad-reduce (0: none): a gradient
    bucket's elements in the parameters' dtype, so each graph's backward completes about one bucket."""
    if not overlap_grad_reduce(cfg, dims):
        return 0
    from gptrain.parallel.grad_buckets import DEFAULT_BUCKET_SIZE

    itemsize = torch.empty(0, dtype=param_dtype or torch.float32).element_size()
    return (cfg.parallel.ddp_bucket_size or DEFAULT_BUCKET_SIZE) * itemsize


def overlap_grad_reduce(cfg: RunConfig, dims: ParallelDims) -> bool:
    """--overlap-grad-reduce where gptrain does it: plain data parallelism without pipelines (ZeRO's
    FSDP2 reduce-scatters during the backward anyway; a pipeline reduces after its schedule)."""
    return cfg.parallel.overlap_grad_reduce and dims.replicated and dims.pp == 1 and not dims.distributed_optimizer


def _set_up_tp_copy_engine(cfg: RunConfig, mesh, device: torch.device, param_dtype, impls: dict) -> bool:
    """The tensor-parallel pair's copy-engine buffers, set up before anything is compiled (symmetric memory must not
    be allocated inside a compiled step's first run, whose allocations CUDA graphs take into their pool), in the
    activations' dtype: without sequence parallelism the column-parallel layers' input gradients (the micro-batch's
    tokens x hidden), with it the trades of half of them. Whether they run: required (--tp-comm-copy-engine) they
    run or the build stops with the reason; by default, where they cannot (a CPU, the rank simulator, two hosts, no
    peer mapping) NCCL's collectives run and ``impls`` says why (decided alike on both ranks)."""
    from gptrain.parallel.copy_engine import set_up_tp_exchange
    from gptrain.parallel.peer_swap import set_up_swap

    required = cfg.parallel.tp_comm_copy_engine
    simulated = torch.distributed.get_backend() == "fake"
    if simulated and required:
        raise ValueError("--tp-comm-copy-engine maps the other GPU's memory: the rank simulator has none "
                         "(leave the flag out of --simulate-world-size runs)")
    fallback = "(--no-tp-comm-copy-engine: always)"
    if required and device.type != "cuda":
        raise ValueError(f"--tp-comm-copy-engine joins two GPUs of one host by their copy engines: the device here is "
                         f"{device.type} (leave the flag out)")
    if simulated or device.type != "cuda":
        impls["tensor parallel"] = (f"NCCL's collectives: the copy engines need two GPUs' memory mapped, and this "
                                    f"{'simulated rank' if simulated else device.type + ' run'} has none {fallback}")
        return False
    group, tokens = mesh["tp"].get_group(), cfg.train.micro_batch_size * cfg.model.seq_length
    timeout_s, dtype = 60 * cfg.parallel.distributed_timeout_minutes, param_dtype or torch.float32
    flag_name = "--tp-comm-copy-engine" if required else "the copy engines (the default)"
    try:
        if cfg.parallel.sequence_parallel:
            set_up_swap(group, tokens // 2 * cfg.model.hidden_size, dtype, device, timeout_s, flag_name)
        else:
            set_up_tp_exchange(group, tokens * cfg.model.hidden_size, dtype, device, timeout_s, flag_name)
    except ValueError as e:  # the same reason on both ranks (paired_setup)
        if required:
            raise
        impls["tensor parallel"] = f"NCCL's collectives: {e} {fallback}"
        return False
    how = "required by --tp-comm-copy-engine" if required else "the default; --no-tp-comm-copy-engine: NCCL's"
    impls["tensor parallel"] = (("the sequence-parallel gathers and scatters as copy-engine trades, half the tokens "
                                 "under the matmuls" if cfg.parallel.sequence_parallel else
                                 "the column-parallel layers' input gradients summed by the copy engines beside "
                                 "their weight gradients") + f" ({how})" + ("" if cfg.parallel.sequence_parallel else
                                 "; --sequence-parallel would also trade every region's gathers and scatters under "
                                 "the matmuls, the faster two-GPU layout (benchmarks/RESULTS.md)"))
    return True


def _why_tp_on_nccl(cfg: RunConfig) -> str:
    """The log's line for a TP-2 run that the copy engines do not serve by default."""
    if cfg.parallel.no_tp_comm_copy_engine:
        return "NCCL's collectives (--no-tp-comm-copy-engine)"
    if cfg.precision.autocast:
        return "NCCL's collectives (--autocast: the copy engines' ops multiply in the parameters' dtype)"
    return ("NCCL's collectives (the copy engines are the default of a lone pair only, not yet run beside other "
            "dimensions, offload or full recompute: --tp-comm-copy-engine asks for them)")


def tp_copy_engine_wanted(cfg: RunConfig, dims: ParallelDims) -> bool:
    """Whether tensor parallelism's collectives go to the copy engines (parallel/copy_engine.py, peer_swap.py):
    required by --tp-comm-copy-engine; by default where they have been run and measured on GPUs: a pair alone (TP 2,
    no data-parallel or pipeline dimension, no offload) without full recompute, --tp-comm-overlap or --autocast,
    unless --no-tp-comm-copy-engine (elsewhere the flag asks for them). Where they are wanted by default, whether they
    can run (CUDA, one host, the other GPU's memory mapped) is found at the build, which falls back to NCCL; the
    planner assumes they run."""
    p = cfg.parallel
    if p.tp_comm_copy_engine:
        return True
    alone = dims.tp == 2 and dims.dp == 1 and dims.pp == 1 and not dims.cpu_offload
    return alone and cfg.kernels.recompute != "full" and not (
        p.no_tp_comm_copy_engine or p.tp_comm_overlap or cfg.precision.autocast)


def parameter_count(model: GPT) -> int:
    """Parameters of this (tensor, pipeline) model-parallel rank: tensor-parallel shards count what
    this rank holds, data-parallel (FSDP) shards count whole, as Megatron counts them."""
    return sum(p.numel() for p in model.parameters())
