"""parallel/reduced_grad_norm.py: the squares FSDP2's all-reduce hook sums while it reduces the gradients (before
--cpu-offload copies them to the host) are the squared norm of the gradients the optimizer then reads, on one
rank and summed over two data-parallel ranks, step after step, with the gradients accumulated over micro-batches
before the one reduction."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from distributed import free_port
from gptrain.parallel.reduced_grad_norm import ReducedGradSquares


def _worker(rank: int, world: int, port: int, errors) -> None:
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        # odd sizes: FSDP2 pads the shards of two ranks
        model = nn.Sequential(nn.Linear(7, 9), nn.GELU(), nn.Linear(9, 5), nn.LayerNorm(5), nn.Linear(5, 3))
        blocks = [model[0], model[2], model[4]]
        for block in blocks:
            fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        squares = ReducedGradSquares([*blocks, model], torch.device("cpu"))
        for step in range(3):
            for micro in range(2):  # as train/loop.py under offload: reduced once, in the last micro-batch
                model.set_requires_gradient_sync(micro == 1)
                torch.manual_seed(100 + 10 * step + 2 * rank + micro)  # each rank its own data
                model(torch.randn(6, 7)).square().mean().backward()
            from_hook = squares.take()
            dist.all_reduce(from_hook)
            own = sum(p.grad.to_local().double().square().sum() for p in model.parameters())
            dist.all_reduce(own)
            assert from_hook.item() > 0
            assert from_hook.item() == pytest.approx(own.item(), rel=1e-5), (step, from_hook, own)
            model.zero_grad(set_to_none=True)
        with pytest.raises(RuntimeError, match="no gradients were reduced"):
            squares.take()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


@pytest.mark.parametrize("world", [1, 2])
def test_hook_squares_equal_the_offloaded_gradients_norm(world):
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_worker, args=(world, free_port(), errors), nprocs=world)
    except Exception:
        messages = []
        while not errors.empty():
            messages.append(errors.get())
        raise AssertionError("; ".join(messages) or "a worker failed")
