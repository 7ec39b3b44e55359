"""``gptrain plan <gptrain train flags> --world-size N --gpu h100|h200|a100|a800``: every layout ranked by
predicted tokens/s per GPU, or (``--evaluate``) the one the flags describe; ``--calibrate`` measures
this GPU's table instead."""
from __future__ import annotations

import argparse
import json
import sys

from gptrain.plan.hardware import GPUS, load_gpu

SPLIT = (("compute", "compute"), ("tp_comm", "TP"), ("dp_comm", "DP"), ("pp_comm", "PP"), ("bubble", "bubble"),
         ("optimizer", "optim"), ("host", "host"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gptrain plan", usage="gptrain plan TRAIN_FLAGS --world-size N --gpu GPU [options]",
        description="Predict step time, tokens/s per GPU, MFU and peak memory per GPU for every parallel layout "
        "(TP x PP x DP x ZeRO x recompute x micro-batch x virtual stages) of a gptrain train command line, "
        "fastest first; layouts gptrain train refuses are left out with its reason. The model, sequence, "
        "global batch and precision come from the training flags (any `gptrain train` flag is accepted).")
    p.add_argument("--gpu", choices=GPUS, default=None, help="the GPU to plan for (required but with --calibrate)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node: TP stays inside one (default 8)")
    p.add_argument("--intra-node-gbps", type=float, default=None,
                   help="all-reduce bus bandwidth inside a node, GB/s (default: the GPU's calibration)")
    p.add_argument("--inter-node-gbps", type=float, default=None,
                   help="bandwidth per GPU across nodes, GB/s (default: the GPU's calibration)")
    p.add_argument("--evaluate", action="store_true", help="predict only the layout the training flags describe")
    p.add_argument("--host-memory-gib", type=float, default=None,
                   help="with --cpu-offload and --evaluate: the host memory of a node, for the largest model that fits "
                   "(default: this machine's)")
    p.add_argument("--json", action="store_true", help="print a JSON list of layouts instead of the table")
    p.add_argument("--top", type=int, default=10, help="layouts to print (0: every one that fits; default 10)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this GPU's matmul, attention and memory-bound efficiencies (under two minutes) and "
                   "write its table to the cache dir, which later plans for the same GPU then use")
    return p


def _fail(message: str) -> int:
    print(f"gptrain: error: {message}", file=sys.stderr)
    return 2


def plan_main(argv: list[str]) -> int:
    args, train_argv = _parser().parse_known_args(argv)
    if args.calibrate:
        from gptrain.plan.calibrate import calibrate_main

        return calibrate_main()
    if args.gpu is None:
        return _fail("give --gpu (one of " + ", ".join(GPUS) + ")")
    if args.gpus_per_node < 1:
        return _fail(f"--gpus-per-node {args.gpus_per_node} must be at least 1")
    from gptrain.config import planned_world_size
    from gptrain.data.assemble import setup
    from gptrain.plan.memory import offload_host_gib
    from gptrain.plan.search import predict, search
    from gptrain.train.build import parallel_dims

    try:
        world = planned_world_size(train_argv)
        if world < 1:
            raise ValueError(f"--world-size {world} must be at least 1")
        cfg, _ = setup(train_argv, log=lambda s: None)
        gpu = load_gpu(args.gpu, args.intra_node_gbps, args.inter_node_gbps)
        if args.evaluate:
            predictions, result = [predict(cfg, world, gpu, args.gpus_per_node)], None
        else:
            result = search(cfg, world, gpu, args.gpus_per_node)
            predictions = result.ranked if args.top == 0 else result.ranked[:args.top]
    except (ValueError, FileNotFoundError) as err:
        return _fail(str(err))
    if args.json:
        print(json.dumps([p.to_json() for p in predictions], indent=1))
        return 0
    print(f"gptrain plan: {cfg.model.num_layers} x {cfg.model.hidden_size} ({cfg.model.num_parameters() / 1e9:.2f} B "
          f"parameters), seq {cfg.model.seq_length}, global batch {cfg.train.global_batch_size}, {cfg.precision.name}, "
          f"{world} x {gpu.name} ({gpu.memory_gib:.0f} GiB, {args.gpus_per_node} per node; calibration: {gpu.source})")
    print(table(predictions))
    if args.evaluate:
        p = predictions[0]
        print(f"memory (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in p.to_json()["memory_gib"].items())
              + ("" if p.fits else f" -- does not fit in {gpu.memory_gib:.0f} GiB with the allocator's slack"))
        host = offload_host_gib(cfg, parallel_dims(cfg, world))
        if host:
            print(f"host memory per rank (--cpu-offload: fp32 parameter, gradient and AdamW moment shards): {host:.2f} GiB")
            print(_largest_offload_line(cfg, world, gpu, args))
            print(_least_offload_line(cfg, world, gpu, args))
            print("with --cpu-offload the optimizer's time is the host's AdamW and PCIe copies as measured on one "
                  "host (16 cores, PCIe 5): yours may differ (measure it: gptrain bench)")
    else:
        print(left_out(result, gpu))
    return 0


def _largest_offload_line(cfg, world: int, gpu, args) -> str:
    from gptrain.plan.offload_fit import host_memory_gib, largest_offload_model

    total = args.host_memory_gib or host_memory_gib()
    if not total:
        return "largest with --cpu-offload: give --host-memory-gib (this machine's memory is not known)"
    fit = largest_offload_model(cfg, world, gpu, args.gpus_per_node, total)
    if fit is None:
        return f"largest with --cpu-offload: none of this width fits {gpu.memory_gib:.0f} GiB and {total:.0f} GiB of host memory"
    return fit.describe(cfg, gpu, total) + ("" if args.host_memory_gib else " (this machine's host memory)")


def _least_offload_line(cfg, world: int, gpu, args) -> str:
    from gptrain.plan.offload_fit import least_offload_fraction

    least = least_offload_fraction(cfg, world, gpu, args.gpus_per_node)
    if least is None:
        return f"least offload that fits: none fits {gpu.memory_gib:.0f} GiB, even whole offload"
    fraction, peak = least
    return (f"least offload that fits {gpu.memory_gib:.0f} GiB: --optimizer-offload-fraction {fraction:.3g} "
            f"(peak {peak:.1f} GiB; the blocks kept on the GPU are updated there, not by the host)")


def table(predictions) -> str:
    head = ("| # | TP | PP | DP | ZeRO | SP | recompute | mbs | v | tokens/s/GPU | MFU | peak GiB | step s | "
            + " | ".join(f"{label} %" for _, label in SPLIT) + " |")
    rows = [head, "|" + " --- |" * (13 + len(SPLIT))]
    for i, p in enumerate(predictions, 1):
        split = p.time.split()
        rows.append(f"| {i} | {p.tp} | {p.pp} | {p.dp} | {p.zero_stage} | {'y' if p.sequence_parallel else '-'} | "
                    f"{p.recompute} | {p.micro_batch_size} | {p.virtual_stages} | {p.tokens_per_s_per_gpu:,.0f} | "
                    f"{100 * p.mfu:.1f}% | {p.peak_gib:.1f}{'' if p.fits else ' (!)'} | {p.step_s:.3f} | "
                    + " | ".join(f"{100 * split[k] / p.step_s:.1f}" for k, _ in SPLIT) + " |")
    return "\n".join(rows)


def left_out(result, gpu) -> str:
    lines = [f"{len(result.ranked)} layouts fit; left out:"]
    if result.too_big:
        small = result.too_big[0]
        lines.append(f"  {len(result.too_big)} allowed but over {gpu.memory_gib:.0f} GiB with the allocator's slack "
                     f"(the smallest: {small.peak_gib:.1f} GiB, {small.flags()})")
    for message, count in sorted(result.refused.items(), key=lambda kv: (-kv[1], kv[0]))[:12]:
        lines.append(f"  {count} refused by gptrain train: {message}")
    if len(result.refused) > 12:
        lines.append(f"  ... and {sum(sorted(result.refused.values())[:-12])} more refused for "
                     f"{len(result.refused) - 12} other reasons (same rules, other numbers)")
    return "\n".join(lines)
