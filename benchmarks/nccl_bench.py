"""NCCL collective speed between the GPUs of one host, as the parallel layouts use them: all-reduce
(tensor-parallel activations, data-parallel gradients), all-gather and reduce-scatter (sequence
parallel, ZeRO), bf16, at sizes from a 345M layer's activations up to its whole gradient.

    torchrun --standalone --nproc-per-node 2 benchmarks/nccl_bench.py
"""
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name()}; NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        print("| collective | MB | ms | algbw GB/s | busbw GB/s |\n| --- | --- | --- | --- | --- |")
    for mb in (8, 32, 128, 512):
        n = mb * 2 ** 20 // 2
        x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(n * world, dtype=torch.bfloat16, device="cuda")
        shard = torch.empty(n // world, dtype=torch.bfloat16, device="cuda")
        ops = {"all_reduce": (lambda: dist.all_reduce(x), 2 * (world - 1) / world),
               "all_gather": (lambda: dist.all_gather_into_tensor(out, x), (world - 1) / world),
               "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, x), (world - 1) / world)}
        for name, (op, factor) in ops.items():
            for _ in range(5):
                op()
            torch.cuda.synchronize()
            reps = 20
            start = time.perf_counter()
            for _ in range(reps):
                op()
            torch.cuda.synchronize()
            sec = (time.perf_counter() - start) / reps
            size = x.numel() * 2 * (world if name == "all_gather" else 1)
            if rank == 0:
                print(f"| {name} | {size / 2 ** 20:.0f} | {sec * 1000:.3f} | {size / sec / 1e9:.1f} | "
                      f"{size / sec / 1e9 * factor:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
