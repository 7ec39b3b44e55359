"""The parallel layout: world size = pp x dp x tp, validated before any work, and the one DeviceMesh.

Rank order follows Megatron's: tensor-parallel ranks are adjacent (innermost), then data-parallel,
then pipeline stages (outermost), so a TP group stays inside one node and pipeline stages cross nodes.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gptrain.parallel.comm_options import CommOptions

MESH_DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    cpu_offload: bool = False
    offload_fraction: float = 1.0  # --optimizer-offload-fraction: the share of the parameters offloaded
    # per mesh dimension, its NCCL communicator's options (comm_options.comm_options), and the groups named
    # in --nccl-communicator-config-path that have no dimension here
    comm: tuple[tuple[str, CommOptions], ...] = ()
    comm_ignored: tuple[str, ...] = ()

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def distributed_optimizer(self) -> bool:
        """ZeRO-1 on whole replicas (Megatron's distributed optimizer, parallel/distributed_optimizer.py):
        over several data-parallel ranks, without pipelines or offload (FSDP2 keeps ZeRO-1 there)."""
        return self.zero_stage == 1 and self.dp > 1 and self.pp == 1 and not self.cpu_offload

    @property
    def sharded(self) -> bool:
        """Parameters live in FSDP2 (ZeRO-2/3, and ZeRO-1 where the distributed optimizer does not reach);
        plain data parallelism keeps whole replicas, and ZeRO over one rank shards nothing (Megatron's scripts
        pass --use-distributed-optimizer on one GPU), but ZeRO-3 with --cpu-offload on one rank still moves
        the state to host memory (ZeRO-Offload)."""
        return self.zero_stage > 0 and (self.dp > 1 or self.cpu_offload) and not self.distributed_optimizer

    @property
    def replicated(self) -> bool:
        """Every data-parallel rank holds the whole model: the gradients are all-reduced (plain data
        parallelism) or, under the distributed optimizer, reduce-scattered."""
        return self.dp > 1 and not self.sharded

    def validate(self, num_layers: int, num_heads: int, micro_batch_size: int, global_batch_size: int,
                 uneven_stages: bool = False) -> None:
        """Every impossible layout is refused here, with its numbers, before anything is built."""
        for name, value in (("--tensor-model-parallel-size", self.tp), ("--pipeline-model-parallel-size", self.pp)):
            if value < 1:
                raise ValueError(f"{name} {value} must be at least 1")
        if self.world_size % (self.tp * self.pp):
            raise ValueError(f"world size {self.world_size} is not divisible by tensor-model-parallel size "
                             f"{self.tp} x pipeline-model-parallel size {self.pp} = {self.tp * self.pp}")
        if num_heads % self.tp:
            raise ValueError(f"--num-attention-heads {num_heads} is not divisible by tensor-model-parallel size "
                             f"{self.tp}")
        if num_layers % self.pp and not uneven_stages:  # uneven: checked by pipeline.stage_layer_counts
            raise ValueError(f"--num-layers {num_layers} is not divisible by pipeline-model-parallel size {self.pp}")
        if global_batch_size % (micro_batch_size * self.dp):
            raise ValueError(f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size "
                             f"{micro_batch_size} x data-parallel size {self.dp} = {micro_batch_size * self.dp}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage {self.zero_stage}: use 0, 1, 2 or 3")
        if self.cpu_offload and self.zero_stage == 0:
            raise ValueError("--cpu-offload needs --zero-stage 1, 2 or 3 (got 0): the offloaded state is FSDP2's shards")
        if not 0.0 < self.offload_fraction <= 1.0:
            raise ValueError(f"--optimizer-offload-fraction {self.offload_fraction} must be above 0 and at most 1")
        if self.offload_fraction < 1.0 and not self.cpu_offload:
            raise ValueError(f"--optimizer-offload-fraction {self.offload_fraction} needs --cpu-offload "
                             "(or --optimizer-cpu-offload)")
        if self.pp > 1 and self.zero_stage > 1:
            # as in DeepSpeed: gradients and parameters sharded over data-parallel ranks would be
            # reduced or gathered once per micro-batch inside the pipeline schedule
            raise ValueError(f"--zero-stage {self.zero_stage} with pipeline parallelism: use ZeRO-1 "
                             "(--use-distributed-optimizer) or no ZeRO with --pipeline-model-parallel-size "
                             f"{self.pp}")

    def describe(self) -> str:
        return (f"using world size: {self.world_size}, data-parallel-size: {self.dp}, "
                f"tensor-model-parallel size: {self.tp}, pipeline-model-parallel size: {self.pp}")

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The (pp, dp, tp) mesh; each dimension named in ``comm`` gets its own NCCL communicator with those
        options (gloo, beside it for CPU tensors, has none)."""
        if not self.distributed and not self.sharded:
            return None
        override = {}
        if device_type == "cuda" and self.comm and dist.get_backend() != "fake":
            override = {dim: ("cpu:gloo,cuda:nccl", options.nccl()) for dim, options in self.comm}
        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_DIMS,
                                **({"backend_override": override} if override else {}))


def world_from_env() -> tuple[int, int, int]:
    """(world size, global rank, local rank) as torchrun sets them; (1, 0, 0) without torchrun."""
    return (int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")),
            int(os.environ.get("LOCAL_RANK", "0")))


def _attempt_store(timeout: datetime.timedelta | None) -> dist.Store | None:
    """Under torchrun the workers share the agent's store, which outlives a restart of the group: the
    keys each rank wrote there in the last attempt (gloo's and NCCL's addresses among them) are still
    there, and a restarted rank that reads one before its peer rewrites it connects to a dead process
    ("connectFullMesh ... Connection refused"). Each attempt gets keys of its own."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        return None
    from torch.distributed import distributed_c10d

    agent = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout or distributed_c10d.default_pg_timeout)
    return dist.PrefixStore(f"gptrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)


def init_distributed(device: torch.device, timeout_minutes: float | None = None,
                     alone: bool = False) -> torch.device:
    """Join the process group torchrun describes: NCCL on GPUs (one per local rank), gloo on CPU.
    Returns this rank's device. ``timeout_minutes`` (--distributed-timeout-minutes) bounds every
    collective of every process group: the default one, and the groups made later (DeviceMesh's,
    the checkpoint writer's), which torch would otherwise give its own defaults (30 minutes for
    gloo); NCCL's async error handling tears the process down when one times out."""
    world, _, local_rank = world_from_env()
    if dist.is_initialized() or (world == 1 and not alone):
        return device
    if world == 1:  # one process that still needs a group (ZeRO-Offload's FSDP2): a group of itself
        if device.type != "cuda":
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            return device
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)  # NCCL's device_id needs an index; gloo beside it as below (offloaded shards)
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
        return device
    kwargs = {}
    if timeout_minutes is not None:
        from torch.distributed import distributed_c10d

        timeout = datetime.timedelta(minutes=timeout_minutes)
        distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = timeout
        kwargs["timeout"] = timeout
    store = _attempt_store(kwargs.get("timeout"))
    if store is not None:
        kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=world)
    if device.type == "cuda":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # gloo beside NCCL: CPU-offloaded shards are gathered on the CPU (checkpoints of --cpu-offload)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)
    return device


def is_logging_rank() -> bool:
    """Rank 0 speaks (and a simulated rank, alone in its fake world); before the process group
    exists, torchrun's RANK says who that is."""
    if dist.is_initialized():
        return dist.get_rank() == 0 or dist.get_backend() == "fake"
    return world_from_env()[1] == 0
