"""How much of an NCCL all-reduce hides under a matmul running beside it, as a tensor-parallel rank's
backward issues them (the input gradient's all-reduce on NCCL's stream, the weight gradient's matmul on
the compute stream): each alone, then both, eagerly and inside one CUDA graph, with the group's NCCL on a
normal or a high-priority stream, and with the matmul held off some SMs (cuBLASLt's SM count target
through torch's carveout knob); on two GPUs also an all-reduce made of copy-engine transfers (symmetric memory).

    torchrun --standalone --nproc-per-node 2 benchmarks/comm_overlap.py [--mb 32] [--carveouts 0 16 32]

"hidden" = (AR alone + matmul alone - both) / the shorter of the two: 100% = the shorter one is free.
NCCL's own environment (NCCL_PROTO, NCCL_MAX_CTAS) and CUDA_GRAPHS_USE_NODE_PRIORITY act as set.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from cuda_timing import cuda_ms  # benchmarks/cuda_timing.py
from gptrain.parallel.copy_engine import CopyEngineAllReduce


def graphed(fn):
    """``fn`` captured once into a CUDA graph; returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_engine(x: torch.Tensor, rank: int) -> CopyEngineAllReduce | None:
    """The copy-engine all-reduce for ``x``'s size, its sum first checked against NCCL's; None (and a line saying
    why) where it cannot run."""
    try:
        ce = CopyEngineAllReduce(dist.group.WORLD, x.numel(), x.dtype, x.device)
        probe = torch.randn_like(x)
        expected = probe.clone()
        dist.all_reduce(expected)
        ce(probe)
        torch.testing.assert_close(probe, expected, rtol=0, atol=0)  # a sum of two is exact both ways
        return ce
    except Exception as e:  # noqa: BLE001 - a machine without peer mappings: say so, keep the other rows
        if rank == 0:
            print(f"copy engine (symmetric memory) not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return None


def copy_engine_pair(ce: CopyEngineAllReduce, matmul, x: torch.Tensor, reps: int) -> tuple[float, float, float]:
    """(all-reduce alone, matmul alone, both) in ms, eagerly, the all-reduce on a side stream."""
    side = torch.cuda.Stream()

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ce(x)
        matmul()
        torch.cuda.current_stream().wait_stream(side)
    return tuple(cuda_ms(fn, reps) for fn in (lambda: ce(x), matmul, both))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=32, help="all-reduce size, MB of bf16 (a 345M micro-batch of 16: 32)")
    parser.add_argument("--tokens", type=int, default=16384, help="the matmul's reduced dimension (tokens)")
    parser.add_argument("--shapes", nargs="+", default=["1536x1024", "2048x1024"],
                        help="weight-gradient shapes OUTxIN (a TP2 rank's QKV and fc1 of the 345M)")
    parser.add_argument("--carveouts", type=int, nargs="+", default=[0, 16, 32], help="SMs kept from the matmul")
    parser.add_argument("--blas", nargs="+", default=["cublas", "cublaslt"], choices=["cublas", "cublaslt"],
                        help="torch's BLAS library for the matmul (the carveout acts on cuBLASLt only)")
    parser.add_argument("--groups", nargs="+", default=["normal", "high-priority"], choices=["normal", "high-priority"])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    from torch.distributed import ProcessGroupNCCL

    options = {"normal": None, "high-priority": ProcessGroupNCCL.Options(is_high_priority_stream=True)}
    groups = {name: dist.new_group(backend="nccl", pg_options=options[name]) for name in args.groups}
    x = torch.randn(args.mb * 2 ** 20 // 2, dtype=torch.bfloat16, device="cuda")
    env = {k: os.environ[k] for k in ("NCCL_PROTO", "NCCL_MAX_CTAS", "NCCL_MIN_CTAS", "CUDA_GRAPHS_USE_NODE_PRIORITY")
           if k in os.environ}
    ce = copy_engine(x, rank) if dist.get_world_size() == 2 else None
    if rank == 0:
        print(f"{dist.get_world_size()} x {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs; "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; torch {torch.__version__}; env {env or 'none'}")
        print("| group | blas | carveout | shape | mode | AR ms | matmul ms | both ms | hidden |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for blas in args.blas:
        torch.backends.cuda.preferred_blas_library(blas)
        for carveout in args.carveouts:
            torch._C._set_sm_carveout_experimental(carveout or None)
            for shape in args.shapes:
                out_dim, in_dim = (int(v) for v in shape.split("x"))
                g = torch.randn(args.tokens, out_dim, dtype=torch.bfloat16, device="cuda")
                a = torch.randn(args.tokens, in_dim, dtype=torch.bfloat16, device="cuda")

                x.normal_()  # each row from finite values (the rows before summed it in place many times)

                def matmul():
                    return g.t() @ a
                pairs = {}
                if ce is not None:
                    pairs[("copy engine (symmetric memory)", "eager")] = copy_engine_pair(ce, matmul, x, args.reps)
                for name, group in groups.items():
                    def all_reduce(group=group):
                        dist.all_reduce(x, group=group)

                    def both(group=group):
                        work = dist.all_reduce(x, group=group, async_op=True)
                        matmul()
                        work.wait()
                    for mode in ("eager", "graph"):
                        fns = (all_reduce, matmul, both) if mode == "eager" else map(graphed, (all_reduce, matmul, both))
                        pairs[(name, mode)] = tuple(cuda_ms(fn, args.reps) for fn in fns)
                for (name, mode), (t_ar, t_mm, t_both) in pairs.items():
                    if rank == 0:
                        print(f"| {name} | {blas} | {carveout} | {shape} | {mode} | {t_ar:.3f} | {t_mm:.3f} | "
                              f"{t_both:.3f} | {(t_ar + t_mm - t_both) / min(t_ar, t_mm):.0%} |", flush=True)
    torch._C._set_sm_carveout_experimental(None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
