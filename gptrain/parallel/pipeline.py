"""Pipeline parallelism on ``torch.distributed.pipelining``: Megatron's layer split, 1F1B and
interleaved 1F1B, and the embedding group that keeps the tied output layer equal to the word
embeddings.

Each pipeline rank builds one ``GPT`` holding only its layers (``GPT.keep_stage``): the first rank
the word and position embeddings, the last the final LayerNorm and its own copy of the word
embeddings as the output layer's weight. With ``v`` virtual stages per rank (Megatron's
``--num-layers-per-virtual-pipeline-stage``) there are ``pp x v`` stages of consecutive layers and
rank r runs stages r, r + pp, r + 2 pp, ...: its GPT holds the layers of all of them and each stage
is a ``PipelineChunk`` over that GPT. Parameter names stay those of the whole model, so checkpoints,
the optimizer and the fp32 main copies see one model per rank, at any layout.

The loss runs on the last stage as the schedule's ``loss_fn``; the first and last ranks feed the
tokens and the labels (the middle ranks read no data). After the backward the two copies of the
word embeddings have their gradients summed over the first and last rank (Megatron's embedding
group), so the same update keeps them equal.
"""
from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from gptrain.model.gpt import GPT
from gptrain.parallel.dims import ParallelDims


@dataclass(frozen=True)
class StagePlan:
    """The pipeline stages one rank runs: global stage indices, in order, and each one's layers."""
    stages: tuple[int, ...]
    layers: tuple[tuple[int, ...], ...]
    num_stages: int
    sizes: tuple[int, ...] = ()  # every stage's number of layers

    @property
    def layer_ids(self) -> list[int]:
        return [i for ids in self.layers for i in ids]


def virtual_stages(num_layers: int, pp: int, layers_per_virtual_stage: int | None) -> int:
    """Model chunks per pipeline rank (1 without interleaving), with Megatron's checks."""
    if pp == 1 or not layers_per_virtual_stage:
        if layers_per_virtual_stage and pp == 1:
            raise ValueError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size above 1")
        return 1
    per_rank = num_layers // pp
    if per_rank % layers_per_virtual_stage:
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage} does not divide the "
                         f"{per_rank} layers of each pipeline stage (--num-layers {num_layers} / "
                         f"--pipeline-model-parallel-size {pp})")
    return per_rank // layers_per_virtual_stage


def check_micro_batches(n_micro: int, pp: int, virtual: int) -> None:
    """The schedules' rules on the micro-batches per step: at least one per stage for 1F1B, a
    multiple of the stages for interleaved 1F1B (Megatron's)."""
    if pp == 1:
        return
    if virtual == 1 and n_micro < pp:
        raise ValueError(f"pipeline parallelism over {pp} stages needs at least {pp} micro-batches "
                         f"per step (global batch / (micro-batch x data-parallel size) = {n_micro})")
    if virtual > 1 and n_micro % pp:
        raise ValueError(f"the interleaved schedule needs the number of micro-batches ({n_micro}) to be a "
                         f"multiple of --pipeline-model-parallel-size {pp} (Megatron's rule)")


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layers per pipeline stage: even, or with Megatron's ``--decoder-first-pipeline-num-layers`` /
    ``--decoder-last-pipeline-num-layers`` set and the rest split evenly over the other stages (the
    last stage also runs the output layer and the loss, so giving it fewer layers balances the
    pipeline)."""
    if first is None and last is None:
        if num_layers % pp:
            raise ValueError(f"--num-layers {num_layers} is not divisible by pipeline-model-parallel size {pp}")
        return [num_layers // pp] * pp
    if pp == 1:
        raise ValueError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size above 1")
    for flag, n in (("first", first), ("last", last)):
        if n is not None and not 1 <= n < num_layers:
            raise ValueError(f"--decoder-{flag}-pipeline-num-layers {n} must be between 1 and --num-layers - 1")
    fixed = [n for n in (first, last) if n is not None]
    others, rest = pp - len(fixed), num_layers - sum(fixed)
    if others == 0 and rest:
        raise ValueError(f"--decoder-first-pipeline-num-layers {first} + --decoder-last-pipeline-num-layers {last} "
                         f"must equal --num-layers {num_layers} with {pp} pipeline stages")
    if others and (rest < others or rest % others):
        raise ValueError(f"--num-layers {num_layers} minus the first/last stage's {sum(fixed)} leaves {rest} layers, "
                         f"which do not split evenly over the other {others} pipeline stages")
    counts = [rest // others] * others if others else []
    return ([first] if first is not None else []) + counts + ([last] if last is not None else [])


def stage_plan(num_layers: int, pp: int, rank: int, virtual: int = 1, first: int | None = None,
               last: int | None = None) -> StagePlan:
    total = pp * virtual
    stages = tuple(rank + k * pp for k in range(virtual))
    if virtual == 1:
        counts = stage_layer_counts(num_layers, pp, first, last)
        start = sum(counts[:rank])
        return StagePlan(stages, (tuple(range(start, start + counts[rank])),), total, tuple(counts))
    per_stage = num_layers // total
    layers = tuple(tuple(range(s * per_stage, (s + 1) * per_stage)) for s in stages)
    return StagePlan(stages, layers, total, (per_stage,) * total)


class PipelineChunk(nn.Module):
    """One pipeline stage over the rank's GPT: the embeddings if it is the first stage, its blocks,
    the final LayerNorm if it is the last. Registers exactly the modules it runs (and, on the last
    rank, the output layer's copy of the word embeddings), so FSDP2 can take it as a root."""

    def __init__(self, model: GPT, layer_ids: tuple[int, ...], first: bool, last: bool):
        super().__init__()
        self.blocks = nn.ModuleList(model.layers[str(i)] for i in layer_ids)
        self.first, self.last = first, last
        if first:
            self.position_embeddings = model.position_embeddings
        if first or (last and model.word_embeddings is not None):
            self.word_embeddings = model.word_embeddings
        if last:
            self.final_layernorm = model.final_layernorm
            if model.cfg.untie_embeddings_and_output_weights:  # its own weight, on this stage only
                self.output_layer = model.output_layer
        object.__setattr__(self, "_model", model)  # not a child: the chunk owns only what it runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._model.run_layers(x, list(self.blocks), self.first, self.last)


def prune_for_stage(model: GPT, dims: ParallelDims, pp_rank: int, virtual: int, first: int | None = None,
                    last: int | None = None) -> StagePlan:
    plan = stage_plan(model.cfg.num_layers, dims.pp, pp_rank, virtual, first, last)
    model.keep_stage(plan.layer_ids, pre_process=pp_rank == 0, post_process=pp_rank == dims.pp - 1)
    return plan


def pipeline_chunks(model: GPT, plan: StagePlan) -> list[PipelineChunk]:
    return [PipelineChunk(model, ids, first=s == 0, last=s == plan.num_stages - 1)
            for s, ids in zip(plan.stages, plan.layers)]


def embedding_group(mesh: DeviceMesh, dims: ParallelDims):
    """Megatron's embedding group of this rank: itself and the rank at the other end of the
    pipeline with the same data- and tensor-parallel coordinates. Every rank creates every group
    (new_group is collective); returns this rank's, or None on a middle stage."""
    ranks = mesh.mesh  # (pp, dp, tp) global ranks
    mine = None
    me = dist.get_rank()
    for d in range(dims.dp):
        for t in range(dims.tp):
            pair = [int(ranks[0, d, t]), int(ranks[dims.pp - 1, d, t])]
            group = dist.new_group(pair)
            if me in pair:
                mine = group
    return mine


@dataclass(frozen=True)
class StageShapes:
    """What travels between stages, known before the first step (no shape inference over the network
    at start, so a stage also starts alone in a simulated world): the first stage's token ids, the
    hidden states between stages (this rank's share of the tokens with sequence parallelism), and the
    last stage's output (every token again)."""
    tokens: tuple[int, int]
    hidden: tuple[int, ...]
    final: tuple[int, int, int]
    dtype: torch.dtype

    @classmethod
    def of(cls, micro_batch_size: int, seq_length: int, hidden_size: int, dtype: torch.dtype,
           sequence_parallel_size: int = 1) -> "StageShapes":
        final = (micro_batch_size, seq_length, hidden_size)
        hidden = final if sequence_parallel_size == 1 else \
            (1, micro_batch_size * seq_length // sequence_parallel_size, hidden_size)
        return cls((micro_batch_size, seq_length), hidden, final, dtype)

    def example(self, stage: int, num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) examples of a stage, on the meta device; hidden states require gradients
        (the receiving stage's buffers take it from the example: without it no gradient flows back)."""
        meta = torch.device("meta")
        x = torch.empty(self.tokens, dtype=torch.int64, device=meta) if stage == 0 else \
            torch.empty(self.hidden, dtype=self.dtype, device=meta, requires_grad=True)
        y = torch.empty(self.final if stage == num_stages - 1 else self.hidden, dtype=self.dtype, device=meta,
                        requires_grad=True)
        return x, y


def _given_shapes(shapes: StageShapes, stage: int, num_stages: int, stage_cls) -> dict:
    """PipelineStage's keyword arguments that give a stage its shapes (and, where this torch takes
    them, its gradients' shapes: the same as the tensors')."""
    x, y = shapes.example(stage, num_stages)
    given = {"input_args": x, "output_args": y}
    if "output_grads" in inspect.signature(stage_cls.__init__).parameters:
        given["output_grads"] = None if stage == num_stages - 1 else y
        given["input_grads"] = (None,) if stage == 0 else x
    return given


def _skip_warmup_vote(schedule) -> None:
    """In a simulated world (the fake process group: receives leave their buffers as they were)
    torch >= 2.13's warm-up vote, a tensor passed along the stages, would read zeros and send every
    stage to shape inference over the network; the shapes are given, so each stage is told so."""
    if not hasattr(schedule, "_warmup_p2p"):
        return  # older torch: given shapes skip inference without a vote
    from torch.distributed.pipelining.stage import InferenceMode

    def static(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = static


class Pipeline:
    """The schedule of this rank's stages and what the training loop asks of it: one step over a
    global batch's micro-batches, an evaluation pass, the tied embedding gradients' sum."""

    def __init__(self, model: GPT, loss: nn.Module, chunks: list[PipelineChunk], plan: StagePlan,
                 dims: ParallelDims, mesh: DeviceMesh, device: torch.device, n_micro: int,
                 autocast_dtype: torch.dtype | None, shapes: StageShapes):
        self.model, self.loss, self.plan, self.dims = model, loss, plan, dims
        self.pp_rank = mesh["pp"].get_local_rank()
        self.first, self.last = self.pp_rank == 0, self.pp_rank == dims.pp - 1
        self.n_micro = n_micro
        self.compute_dtype = autocast_dtype
        self.factor = 1.0
        self.chunks = chunks
        self.device, self.shapes, self.group = device, shapes, mesh["pp"].get_group()
        self.schedule = self._build_schedule(n_micro)  # the global batch's (evaluation's too)
        # --rampup-batch-size: (count, schedule) of the steps' smaller micro-batch count, one at a time (the
        # count only grows, and each schedule's stages hold receive buffers for all its micro-batches)
        self._ramp: tuple[int, object] | None = None
        self.schedule_name = type(self.schedule).__name__
        # torch >= 2.8 can skip merging the last stage's outputs, which training never reads
        params = inspect.signature(self.schedule.step).parameters
        self._no_outputs = {"return_outputs": False} if "return_outputs" in params else {}
        # an untied output layer has no copy to keep equal (every rank sees the same config)
        self.embedding_group = None if self.model.cfg.untie_embeddings_and_output_weights \
            else embedding_group(mesh, dims)

    def _build_schedule(self, n_micro: int):
        """This rank's stages over its chunks and their schedule for ``n_micro`` micro-batches per step."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        plan = self.plan
        # every stage is given its shapes: no shape inference over the network at the first step
        stages = [PipelineStage(c, s, plan.num_stages, self.device, group=self.group,
                                **_given_shapes(self.shapes, s, plan.num_stages, PipelineStage))
                  for c, s in zip(self.chunks, plan.stages)]
        check_micro_batches(n_micro, self.dims.pp, len(stages))
        if len(stages) == 1:
            schedule = Schedule1F1B(stages[0], n_micro, loss_fn=self._loss_fn, scale_grads=False)
        else:
            schedule = ScheduleInterleaved1F1B(stages, n_micro, loss_fn=self._loss_fn, scale_grads=False)
        if dist.get_backend(self.group) == "fake":
            _skip_warmup_vote(schedule)
        return schedule

    def _schedule_for(self, n_micro: int):
        if n_micro == self.n_micro:
            return self.schedule
        if self._ramp is None or self._ramp[0] != n_micro:
            self._ramp = None  # the previous count's stages and buffers go before the next are made
            self._ramp = (n_micro, self._build_schedule(n_micro))
        return self._ramp[1]

    def describe(self) -> str:
        sizes = sorted(set(self.plan.sizes))
        per_stage = sizes[0] if len(sizes) == 1 else ", ".join(map(str, self.plan.sizes))
        kind = "1F1B" if len(self.plan.stages) == 1 else f"interleaved 1F1B, {len(self.plan.stages)} virtual stages per rank"
        bubble = (self.dims.pp - 1) / (self.n_micro * len(self.plan.stages) + self.dims.pp - 1)
        # the formula holds for stages of equal time; with uneven layer counts it is only the guide
        which = "bubble" if len(sizes) == 1 else "equal-stage bubble (these stages are uneven)"
        return (f"{self.dims.pp} stages ({kind}) of {per_stage} layers, {self.n_micro} micro-batches per step, "
                f"{which} (p - 1) / (v m + p - 1) = {bubble:.1%}; tied word embeddings summed over the first "
                "and last stage")

    @property
    def needs_data(self) -> bool:
        return self.first or self.last

    def _loss_fn(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # target: labels (b, s), or labels and the loss mask stacked (b, 2, s) for --eod-mask-loss
        labels, mask = (target, None) if target.ndim == 2 else (target[:, 0], target[:, 1].float())
        untied = self.model.cfg.untie_embeddings_and_output_weights
        weight = self.model.output_layer.weight if untied else self.model.word_embeddings.weight
        return self.loss(hidden, weight, labels, mask) * self.factor

    def _autocast(self, device: torch.device):
        # --autocast (fp32 parameters): the stages' forward and the loss run under autocast
        if self.compute_dtype is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)

    @staticmethod
    def target(labels: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
        return labels if loss_mask is None else torch.stack([labels, loss_mask.to(labels.dtype)], dim=1)

    def _run(self, tokens, target, losses: list, train: bool, device: torch.device, n_micro: int | None = None) -> None:
        args = (tokens,) if self.first else ()
        kwargs = {"target": target, "losses": losses} if self.last else {}
        with self._autocast(device):
            if train:
                self._schedule_for(n_micro or self.n_micro).step(*args, **kwargs, **self._no_outputs)
            elif hasattr(self.schedule, "eval"):
                self.schedule.eval(*args, **kwargs)
            else:  # torch without schedule.eval: the same forward-only mode it sets
                has_backward = self.schedule._has_backward
                self.schedule._has_backward = False
                try:
                    self.schedule.step(*args, **kwargs)
                finally:
                    self.schedule._has_backward = has_backward

    def train_step(self, tokens, labels, loss_mask, loss_scale: float, device: torch.device,
                   n_micro: int | None = None) -> torch.Tensor:
        """Forward and backward over the step's ``n_micro`` micro-batches (default: the global batch's;
        concatenated on dim 0); returns the mean loss of the micro-batches on the last rank, zero elsewhere.
        Gradients hold the sum of the micro-batches' mean-loss gradients / n (x the fp16 loss scale)."""
        losses: list[torch.Tensor] = []
        n_micro = n_micro or self.n_micro
        self.factor = loss_scale / n_micro
        self._run(tokens, self.target(labels, loss_mask) if self.last else None, losses, True, device, n_micro)
        if not self.last:
            return torch.zeros((), device=device)
        return torch.stack([l.detach().float() for l in losses]).sum() / loss_scale

    @torch.no_grad()
    def eval_step(self, tokens, labels, loss_mask, device: torch.device) -> torch.Tensor:
        """The sum of the micro-batches' mean losses on the last rank, zero elsewhere."""
        losses: list[torch.Tensor] = []
        self.factor = 1.0
        self._run(tokens, self.target(labels, loss_mask) if self.last else None, losses, False, device)
        if not self.last:
            return torch.zeros((), device=device)
        return torch.stack([l.float() for l in losses]).sum()

    def sum_tied_gradients(self, grad: torch.Tensor | None) -> None:
        """Megatron's embedding group: the word embeddings' gradient on the first rank and the output
        layer's copy on the last are summed, in place, so both copies take the same update."""
        if self.embedding_group is None or grad is None:
            return
        from gptrain.parallel.collectives import local
        dist.all_reduce(local(grad), group=self.embedding_group)
