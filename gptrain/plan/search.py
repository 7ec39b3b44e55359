"""Predict one layout (``predict``) and every layout of a world (``search``): each candidate is first
put to ``train.build.parallel_dims``, the checks ``gptrain train`` runs before it builds anything, so
a layout training would refuse is never proposed (its message says why it was left out)."""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from gptrain.config import RunConfig
from gptrain.parallel.dims import ParallelDims
from gptrain.parallel.layout import parameter_counts
from gptrain.parallel.pipeline import stage_layer_counts, virtual_stages
from gptrain.plan.hardware import Gpu
from gptrain.plan.memory import GIB, Memory, fits, offloaded_share, stage_memory
from gptrain.parallel.reduced_grad_norm import sums_on_device
from gptrain.plan.timing import (OPTIMIZER_BYTES, StepTime, all_reduce_s, data_parallel_s, grad_accumulation_s, offload_s, p2p_s,
                                 stage_time)
from gptrain.train.build import parallel_dims

RECOMPUTE = (None, "selective", "full")


@dataclass
class Prediction:
    tp: int
    pp: int
    dp: int
    zero_stage: int
    micro_batch_size: int
    recompute: str
    sequence_parallel: bool
    virtual_stages: int
    micro_batches: int
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    peak_gib: float
    fits: bool
    time: StepTime
    memory: Memory

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in ("tp", "pp", "dp", "zero_stage", "micro_batch_size", "recompute",
                                             "sequence_parallel", "virtual_stages", "micro_batches", "step_s",
                                             "tokens_per_s_per_gpu", "mfu", "peak_gib", "fits")}
        out["time_split_s"] = self.time.split()
        out["memory_gib"] = {k: v / GIB for k, v in dataclasses.asdict(self.memory).items()}
        out["flags"] = self.flags()
        return out

    def flags(self) -> str:
        """The training flags that select this layout."""
        f = [f"--tensor-model-parallel-size {self.tp}", f"--pipeline-model-parallel-size {self.pp}",
             f"--micro-batch-size {self.micro_batch_size}"]
        if self.zero_stage:
            f.append(f"--zero-stage {self.zero_stage}")
        if self.sequence_parallel:
            f.append("--sequence-parallel")
        if self.recompute == "selective":
            f.append("--recompute-activations")
        elif self.recompute == "full":
            f.append("--recompute-granularity full --recompute-method uniform")
        return " ".join(f)

    def sort_key(self) -> tuple:
        return (-round(self.tokens_per_s_per_gpu, 6), round(self.peak_gib, 6), self.tp, self.pp, self.zero_stage,
                self.micro_batch_size, RECOMPUTE.index(None if self.recompute == "none" else self.recompute),
                self.sequence_parallel, self.virtual_stages)


@lru_cache(maxsize=256)
def _stage_params(model_key: tuple, tp: int, pp: int, first: int | None, last: int | None) -> tuple[int, ...]:
    from gptrain.model.gpt import GPTConfig

    model = GPTConfig(**dict(model_key))
    counts = parameter_counts(model, ParallelDims(world_size=tp * pp, tp=tp, pp=pp), first, last)
    return tuple(counts[(0, stage)] for stage in range(pp))


def predict(cfg: RunConfig, world: int, gpu: Gpu, gpus_per_node: int) -> Prediction:
    """The step time, throughput and peak memory of the layout ``cfg`` describes; ValueError (the
    training command's own message) where ``gptrain train`` would refuse it."""
    dims = parallel_dims(cfg, world)
    m, par = cfg.model, cfg.parallel
    sp = par.sequence_parallel
    virtual = virtual_stages(m.num_layers, dims.pp, par.layers_per_virtual_stage)
    n_micro = cfg.train.micro_batches_per_step(dims.dp)
    layer_counts = stage_layer_counts(m.num_layers, dims.pp, par.first_stage_layers, par.last_stage_layers)
    params = _stage_params(tuple(sorted(dataclasses.asdict(m).items())), dims.tp, dims.pp,
                           par.first_stage_layers, par.last_stage_layers)
    # links: TP inside a node; a DP group (ranks tp apart) or the next stage (tp x dp ranks on) crosses
    # nodes once tp x dp ranks fill one
    intra, inter = gpu.intra_node_gbps, gpu.inter_node_gbps
    tp_gbps = intra if dims.tp <= gpus_per_node else inter
    dp_gbps = intra if dims.tp * dims.dp <= gpus_per_node else inter
    pp_gbps = intra if dims.tp * dims.dp * dims.pp <= gpus_per_node else inter
    stages = [stage_time(cfg, dims, gpu, layer_counts[r], r == 0, r == dims.pp - 1, sp, tp_gbps)
              for r in range(dims.pp)]
    slowest = max(range(dims.pp), key=lambda r: stages[r].wall)
    st = stages[slowest]
    time = StepTime(compute=n_micro * st.compute, tp_comm=n_micro * st.tp_comm, host=n_micro * (st.wall - st.device))
    if dims.pp > 1:  # filling and draining the pipeline: one micro-batch through each other stage
        time.bubble = sum(stage.wall for r, stage in enumerate(stages) if r != slowest) / virtual
        message = 2.0 * cfg.train.micro_batch_size * m.seq_length * m.hidden_size / (dims.tp if sp else 1)
        time.pp_comm = 2 * (n_micro * virtual + dims.pp - 1) * p2p_s(message, pp_gbps)
        if not getattr(m, "untie_embeddings_and_output_weights", False):  # the tied copies' fp32 gradients summed
            time.pp_comm += all_reduce_s(4.0 * m.padded_vocab_size / dims.tp * m.hidden_size, 2, pp_gbps)
    biggest = max(range(dims.pp), key=lambda r: params[r])
    time.dp_comm = data_parallel_s(cfg, dims, gpu, params[biggest], stages[biggest], n_micro, layer_counts[biggest],
                                   dp_gbps)
    time.compute += grad_accumulation_s(cfg, dims, gpu, params[biggest], n_micro)
    local_params = params[biggest] / (dims.dp if dims.sharded or dims.distributed_optimizer else 1)
    if dims.cpu_offload:  # the gradient norm on the host where train/build.py cannot sum it on the GPU
        share = offloaded_share(cfg, dims)
        time.optimizer = offload_s(local_params * share, dims.zero_stage, n_micro, host_norm=not sums_on_device(dims),
                                   overlapped=cfg.parallel.overlap_cpu_optimizer) + \
            gpu.memory_s(OPTIMIZER_BYTES * local_params * (1.0 - share), gpu.optimizer_efficiency)
    else:
        time.optimizer = gpu.memory_s(OPTIMIZER_BYTES * local_params, gpu.optimizer_efficiency)
    memories = [stage_memory(cfg, dims, params[r], layer_counts[r], r, virtual, sp) for r in range(dims.pp)]
    memory = max(memories, key=lambda mem: mem.total)
    step = time.total
    tokens_per_gpu = cfg.train.global_batch_size * m.seq_length / step / world
    mfu = tokens_per_gpu * m.flops_per_token() / (gpu.peak_tflops * 1e12)
    return Prediction(dims.tp, dims.pp, dims.dp, dims.zero_stage, cfg.train.micro_batch_size,
                      cfg.kernels.recompute or "none", sp, virtual, n_micro, step, tokens_per_gpu, mfu, memory.gib,
                      fits(memory.gib, gpu.memory_gib), time, memory)


def layout_config(cfg: RunConfig, tp: int, pp: int, zero: int, sp: bool, recompute: str | None, mbs: int,
                  layers_per_virtual_stage: int | None) -> RunConfig:
    """``cfg`` with another layout (the vocabulary padding follows the tensor-parallel size, as Megatron's does)."""
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, tensor_parallel_size=tp),
        train=dataclasses.replace(cfg.train, micro_batch_size=mbs),
        kernels=dataclasses.replace(cfg.kernels, recompute=recompute),
        parallel=dataclasses.replace(cfg.parallel, tensor_parallel=tp, pipeline_parallel=pp, zero_stage=zero,
                                     sequence_parallel=sp, layers_per_virtual_stage=layers_per_virtual_stage,
                                     first_stage_layers=None, last_stage_layers=None))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: RunConfig, world: int):
    """Every layout of ``world`` GPUs worth asking about: TP x PP over the world's divisors, each ZeRO
    stage (above 0 only where there is data parallelism to shard over), sequence parallelism with TP,
    each recompute mode, power-of-two micro-batches up to 64 (and the flags' own), and the interleaved
    schedule's virtual stages."""
    micro = sorted({1, 2, 4, 8, 16, 32, 64, cfg.train.micro_batch_size})
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            per_stage = cfg.model.num_layers // pp
            virtual = [None] + [per_stage // v for v in (2, 3, 4) if pp > 1 and per_stage % v == 0
                                and cfg.model.num_layers % pp == 0]
            for zero in ((0, 1, 2, 3) if dp > 1 else (0,)):
                for sp in ((False, True) if tp > 1 else (False,)):
                    for recompute in RECOMPUTE:
                        for mbs in micro:
                            for lpvs in virtual:
                                yield tp, pp, zero, sp, recompute, mbs, lpvs


@dataclass
class SearchResult:
    ranked: list[Prediction]  # fitting layouts, fastest first
    too_big: list[Prediction]  # allowed but over the GPU's memory
    refused: Counter  # gptrain train's message -> how many candidates it refused


def search(cfg: RunConfig, world: int, gpu: Gpu, gpus_per_node: int) -> SearchResult:
    ranked, too_big, refused = [], [], Counter()
    for tp, pp, zero, sp, recompute, mbs, lpvs in candidates(cfg, world):
        if tp > gpus_per_node:
            refused[f"tensor parallelism beyond one node ({gpus_per_node} GPUs): not proposed"] += 1
            continue
        try:
            candidate = layout_config(cfg, tp, pp, zero, sp, recompute, mbs, lpvs)
            p = predict(candidate, world, gpu, gpus_per_node)
        except ValueError as err:
            refused[str(err)] += 1
            continue
        (ranked if p.fits else too_big).append(p)
    ranked.sort(key=Prediction.sort_key)
    too_big.sort(key=lambda p: (p.peak_gib, p.sort_key()))
    return SearchResult(ranked, too_big, refused)
