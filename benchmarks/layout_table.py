"""Every layout's training step, one after another in the same processes: tokens/s per GPU, MFU and peak memory
beside the planner's prediction (``gptrain plan --evaluate``'s) for each, and nanoGPT's step (DDP at DP2) as the
anchor. The processes and their process group stay up from row to row, so a row costs its build, its compilation
and its timing, not a new torchrun, imports and communicators: the whole table fits one call of a lent machine.

    torchrun --standalone --nproc-per-node 2 benchmarks/layout_table.py --best-micro-batch -- \\
        --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 \\
        --max-position-embeddings 1024 --hidden-dropout 0 --attention-dropout 0 --bf16 --compile

One-GPU rows run first, on the first rank alone before the group exists; the layouts over the world follow, each
compared with the one-GPU row at its micro-batch. ``--best-micro-batch`` adds, after the rows, each layout at the
micro-batch the planner ranks fastest among 4-64, where that is not the row's own. Between rows the compiled code,
CUDA graphs and every process group the row made are released, so a row starts much as a new process would, with
the compile caches warm. A row's peak memory is its own: above what was still allocated when it started, which the
table shows beside it (on GPUs some rows have left memory behind; the largest tensors still reachable are then
printed with their holders).
"""
from __future__ import annotations

import argparse
import gc
import sys
import threading
import time
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gptrain.bench import GcPauses, bench_baseline, measure, synthetic_trainer
from gptrain.config import parse_megatron_args
from gptrain.parallel.dims import init_distributed, is_logging_rank, world_from_env
from gptrain.parallel.teardown import end_process_group, release_compiled_graphs
from gptrain.plan.report import local_gpu, prediction
from gptrain.train import metrics


@dataclass(frozen=True)
class Row:
    name: str
    gpus: int
    micro_batch: int
    global_batch: int
    flags: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "Row":
        """``NAME:GPUS:MICRO_BATCH:GLOBAL_BATCH:FLAGS`` (FLAGS space-separated; run.sh's layout notation)."""
        parts = text.split(":", 4)
        if len(parts) != 5:
            raise ValueError(f"--row {text!r}: give NAME:GPUS:MICRO_BATCH:GLOBAL_BATCH:FLAGS")
        name, gpus, mbs, gbs, flags = parts
        return cls(name, int(gpus), int(mbs), int(gbs), tuple(flags.split()))

    def argv(self, model_flags: list[str]) -> list[str]:
        return [*model_flags, "--micro-batch-size", str(self.micro_batch), "--global-batch-size",
                str(self.global_batch), *self.flags]

    def config(self, model_flags: list[str]):
        """The row's run configuration (ValueError where gptrain train would refuse it)."""
        return parse_megatron_args(self.argv(model_flags) + ["--mock-data", "--train-iters", "1"],
                                   world_size=self.gpus)[0]


# the layouts of two GPUs at micro-batch 16; data parallelism at one micro-batch a step (its reduction once a step,
# unhidden by accumulation), pipelines at eight (their bubble as a training run at that batch has it); TP2 with its
# default (the copy engines, on GPUs of one host) and on NCCL
LAYOUTS = [Row.parse(r) for r in (
    "1gpu:1:16:16:", "dp2:2:16:32:", "dp2_overlap:2:16:32:--overlap-grad-reduce",
    "tp2:2:16:16:--tensor-model-parallel-size 2",
    "tp2_sp:2:16:16:--tensor-model-parallel-size 2 --sequence-parallel",
    "tp2_nccl:2:16:16:--tensor-model-parallel-size 2 --no-tp-comm-copy-engine",
    "tp2_sp_nccl:2:16:16:--tensor-model-parallel-size 2 --sequence-parallel --no-tp-comm-copy-engine",
    "pp2:2:16:128:--pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 10",
    "pp2_interleaved:2:16:128:--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 6",
    "zero1_dp2:2:16:32:--zero-stage 1", "zero2_dp2:2:16:32:--zero-stage 2", "zero3_dp2:2:16:32:--zero-stage 3")]
BASELINE_ROWS = ("1gpu", "dp2")  # nanoGPT's step beside rows of these names (--row's too): alone, and under DDP
MICRO_BATCHES = (4, 8, 16, 32, 64)


def best_micro_batch_row(row: Row, model_flags: list[str], gpu: str | None) -> Row | None:
    """The row at the micro-batch the planner ranks fastest (fitting this GPU), keeping its micro-batches a step
    (at least one a data-parallel rank); None where that is the row's own or there is no planner for this GPU."""
    if gpu is None:
        return None
    cfg = row.config(model_flags)
    dp = row.gpus // (cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel)
    per_step = row.global_batch // (row.micro_batch * dp)
    best, best_tps = None, -1.0
    for mbs in MICRO_BATCHES:
        candidate = Row(f"{row.name}_mb{mbs}", row.gpus, mbs, mbs * dp * per_step, row.flags)
        try:
            c = candidate.config(model_flags)
        except ValueError:
            continue
        p = prediction(c, row.gpus, gpu)
        if p is not None and p.fits and p.tokens_per_s_per_gpu > best_tps:
            best, best_tps = candidate, p.tokens_per_s_per_gpu
    return None if best is None or best.micro_batch == row.micro_batch else best


def _process_groups() -> set:
    """The process groups that exist now (torch keeps no public list of them)."""
    return set(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else set()


def _release_layout(groups_before: set) -> None:
    """The row's compiled code, CUDA graphs (before the communicators they captured) and every process group made
    since ``groups_before`` (the mesh's, the pipeline's embedding groups ...)."""
    release_compiled_graphs()
    from gptrain.parallel.copy_engine import release_tp_exchanges
    from gptrain.parallel.peer_swap import release_swaps

    release_tp_exchanges()
    release_swaps()
    made = _process_groups() - groups_before - {dist.group.WORLD}
    names = dist.distributed_c10d._world.pg_names
    for group in sorted(made, key=lambda g: names.get(g, ""), reverse=True):  # the same order on every rank
        dist.destroy_process_group(group)
    torch.compiler.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Result:
    row: Row
    seconds: float  # per step
    host_seconds: float  # per step, until the last timed step returned (near ``seconds``: a host-bound step)
    gc_seconds: float  # per step, in Python's collector during the timed steps
    peak_gib: float | None  # the row's own: above what was allocated when it started
    left_gib: float | None  # GPU memory still allocated when the row started (what earlier rows left behind)
    loss: float
    tokens_per_gpu: float
    baseline_seconds: float | None
    wall: dict[str, float]


LEFT_GIB = 0.25  # above this, a row reports what earlier rows left allocated


def _allocated_gib() -> float | None:
    return torch.cuda.memory_allocated() / 2 ** 30 if torch.cuda.is_available() else None


def left_behind(limit: int = 5, chain: bool = False) -> str:
    """The largest CUDA tensors Python can still reach, and who holds each (what a row failed to release; tensors
    held only from C++, by a communicator's pending work say, do not show); ``chain``: also what keeps the largest
    alive, up to a module, frame or thread (``holder_chain``: several scans of the heap)."""
    storages = {}  # one tensor a storage (views share theirs); plain tensors only (a subclass's storage may not be
    for o in gc.get_objects():  # reachable, and it wraps plain ones anyway)
        if type(o) in (torch.Tensor, torch.nn.Parameter) and o.is_cuda:
            try:
                storages.setdefault(o.untyped_storage().data_ptr(), o)
            except RuntimeError:
                continue
    largest = sorted(storages.values(), key=lambda t: -t.untyped_storage().nbytes())[:limit]
    mine = {id(storages), id(largest)}
    found = [f"{tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes() / 2 ** 30:.2f} GiB held by "
             + ", ".join(sorted({type(r).__name__ for r in gc.get_referrers(t) if id(r) not in mine} - {"frame"}))
             for t in largest]
    if largest and chain:
        found.append(f"the largest kept alive through {holder_chain(largest[0], mine | {id(found)})}")
    return "; ".join(found) or "no CUDA tensor reachable from Python"


def _describe(o) -> str:
    if isinstance(o, types.ModuleType):
        return f"module {o.__name__}"
    if isinstance(o, (types.FunctionType, types.MethodType)):
        return f"{type(o).__name__} {o.__qualname__}"
    if isinstance(o, types.FrameType):
        return f"frame {getattr(o.f_code, 'co_qualname', o.f_code.co_name)}"
    if isinstance(o, type):
        return f"class {o.__qualname__}"
    return type(o).__name__


def holder_chain(obj, ignore: set[int] = frozenset(), max_depth: int = 16, width: int = 64) -> str:
    """The shortest chain of referrers from ``obj`` up to what keeps it alive: a module, a thread, a class or a
    frame object (one a traceback keeps: from Python 3.11 an executing function's locals are not visible to ``gc``,
    so a tensor held only by a running function's local shows no holder); else the longest chain found within
    ``max_depth`` links, each level's first ``width`` referrers followed, marked as ending without a root. Each link
    is named by its type (functions, frames and classes by name), so a leak reads ``Tensor <- GradBuckets <- method
    ... <- module x``. One scan of the heap per level."""
    own_frames = (holder_chain.__code__, left_behind.__code__)
    parents: dict[int, int | None] = {id(obj): None}
    objects = {id(obj): obj}
    level, end = [obj], None
    for _ in range(max_depth):
        ids = {id(o) for o in level}
        found = []
        for r in gc.get_referrers(*level):
            if id(r) in ignore or id(r) in parents or r is level or r is found or r is objects or r is parents:
                continue
            if isinstance(r, types.FrameType) and r.f_code in own_frames:
                continue  # the search's own frames
            parent = next((p for p in gc.get_referents(r) if id(p) in ids), None)
            if parent is None:
                continue
            parents[id(r)], objects[id(r)] = id(parent), r
            if isinstance(r, (types.ModuleType, types.FrameType, threading.Thread, type)):
                end = id(r)
                break
            found.append(r)
        if end is not None or not found:
            break
        level = found[:width]
    rooted = end is not None
    if not rooted:
        end = next(reversed(parents))  # the last found: as far up as the search went
    chain = []
    while end is not None:
        chain.append(_describe(objects[end]))
        end = parents[end]
    return " <- ".join(chain[::-1]) + ("" if rooted else f" (no module, thread or class within {max_depth} links)")


def run_row(row: Row, model_flags: list[str], warmup: int, iters: int, baseline: bool, explain: bool = True) -> Result:
    """One row, timed. ``explain``: where earlier rows left memory allocated, say what keeps it (the first time)."""
    left = _allocated_gib()
    if left and left > LEFT_GIB and is_logging_rank():
        print(f"{row.name}: {left:.2f} GiB still allocated from earlier rows: {left_behind(chain=explain)}", flush=True)
    groups = _process_groups()
    wall, t0 = {}, time.perf_counter()
    trainer, loader = synthetic_trainer(row.argv(model_flags), warmup + iters + 1, world=row.gpus)
    device, cfg = trainer.device, trainer.cfg
    wall["build"] = time.perf_counter() - t0
    step = lambda: trainer.train_step(loader)  # noqa: E731
    pauses = GcPauses()
    try:
        seconds, host, peak = measure(step, warmup, iters, device, row.name, settle=trainer.settle, gc_pauses=pauses)
        loss = trainer.mean_unlogged_loss()
    finally:
        pauses.close()
        trainer.settle()
        loader.close()
    wall["steps"] = time.perf_counter() - t0 - wall["build"]
    dp = trainer.dp_size
    del trainer, loader, step
    _release_layout(groups)
    base = None
    if baseline:
        t1 = time.perf_counter()
        base = bench_baseline(cfg, device, warmup, iters, cfg.train.compile, dp)[0]
        _release_layout(groups)
        wall["baseline"] = time.perf_counter() - t1
    tokens = cfg.train.global_batch_size * cfg.model.seq_length / row.gpus
    own_peak = None if peak is None else peak - (left or 0.0)
    return Result(row, seconds, host, pauses.seconds / iters, own_peak, left, loss, tokens / seconds, base, wall)


def _sharded_alone(row: Row, model_flags: list[str]) -> bool:
    from gptrain.train.build import parallel_dims

    return parallel_dims(row.config(model_flags), row.gpus).sharded


def reference(r: Result, results: list[Result]) -> Result | None:
    """The one-GPU row ``r`` is compared with: the one at its micro-batch, else the first."""
    ones = [x for x in results if x.row.gpus == 1]
    return next((x for x in ones if x.row.micro_batch == r.row.micro_batch), ones[0] if ones else None)


def _percent(x: float | None, ref: float | None) -> str:
    return "" if x is None or not ref else f"{100 * x / ref:.1f}%"


def format_row(r: Result, ref: Result | None, model_flags: list[str], device: torch.device) -> str:
    cfg = r.row.config(model_flags)
    gpu = local_gpu(device)
    p = prediction(cfg, r.row.gpus, gpu) if gpu else None
    peak_flops = metrics.device_peak_tflops(device, cfg.train.peak_tflops)
    fpt = cfg.model.flops_per_token()
    cells = [r.row.name, str(r.row.gpus), str(r.row.micro_batch), str(r.row.global_batch)]
    mfu = f"{100 * r.tokens_per_gpu * fpt / 1e12 / peak_flops:.1f}%" if peak_flops else "n/a"
    cells += [f"{1000 * r.seconds:.1f}", f"{1000 * r.host_seconds:.1f} ({1000 * r.gc_seconds:.1f})",
              f"{r.tokens_per_gpu:,.0f}",
              _percent(r.tokens_per_gpu, ref.tokens_per_gpu if ref else None), mfu,
              "n/a" if r.peak_gib is None else f"{r.peak_gib:.2f}"]
    if p is None:
        cells.append("n/a")
    else:
        # errors as benchmarks/plan_error.py gives them, predicted over measured: a positive time error is an
        # optimistic planner, a positive memory error a pessimistic one
        cells.append(f"{p.tokens_per_s_per_gpu:,.0f} ({p.tokens_per_s_per_gpu / r.tokens_per_gpu - 1:+.1%}); "
                     f"{p.peak_gib:.2f} GiB" + ("" if r.peak_gib is None else f" ({p.peak_gib / r.peak_gib - 1:+.1%})"))
    cells.append(f"{r.loss:.6f}")
    if r.baseline_seconds is not None:
        base_tps = cfg.train.global_batch_size * cfg.model.seq_length / r.row.gpus / r.baseline_seconds
        cells.append(f"{1000 * r.baseline_seconds:.1f} ms, {base_tps:,.0f}")
    else:
        cells.append("")
    cells.append("" if r.left_gib is None else f"{r.left_gib:.2f}")
    cells.append(", ".join(f"{k} {v:.0f}" for k, v in r.wall.items()))
    return "| " + " | ".join(cells) + " |"


HEADER = ("| row | GPUs | micro-batch | global batch | ms/iter | host ms/iter (in gc) | tokens/s per GPU | of 1 GPU | "
          "MFU (datasheet) | peak GiB | plan: tokens/s (error); peak (error) | mean loss | nanoGPT beside it | "
          "GiB left by earlier rows | row's wall s |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Flags after -- are gptrain train flags for every row (the model, precision, "
                                "--compile ...); each row adds its micro-batch, global batch and layout flags.")
    p.add_argument("--rows", default=" ".join(r.name for r in LAYOUTS),
                   help="the built-in layouts to run, in this order (default: all: %(default)s)")
    p.add_argument("--row", action="append", default=[], type=Row.parse,
                   help="a further row NAME:GPUS:MICRO_BATCH:GLOBAL_BATCH:FLAGS (repeatable)")
    p.add_argument("--best-micro-batch", nargs="?", const="", default=None, metavar="NAMES",
                   help="after the rows, each layout again at the planner's fastest micro-batch where that differs "
                   "(NAMES: only these rows', in this order; none given: every row's)")
    p.add_argument("--no-baseline", action="store_true", help="leave nanoGPT's step out")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps a row (compilation happens here)")
    p.add_argument("--iters", type=int, default=8, help="timed steps a row (1 with --warmup 2: warm a machine's "
                   "compile caches for a later run)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds after which no further row starts (those left are listed as not run)")
    args, model_flags = p.parse_known_args(argv)
    model_flags = [f for f in model_flags if f != "--"]
    by_name = {r.name: r for r in LAYOUTS}
    unknown = [n for n in args.rows.split() if n not in by_name]
    if unknown:
        print(f"layout_table: unknown row(s) {', '.join(unknown)}; built in: {', '.join(by_name)}", file=sys.stderr)
        return 2
    rows = [by_name[n] for n in args.rows.split()] + args.row
    world = world_from_env()[0]
    too_big = [r.name for r in rows if r.gpus not in (1, world)]
    if too_big:
        print(f"layout_table: rows {', '.join(too_big)} need another world size than this {world}", file=sys.stderr)
        return 2
    needs_group = [r.name for r in rows if r.gpus == 1 and _sharded_alone(r, model_flags)]
    if needs_group:
        print(f"layout_table: one-GPU rows {', '.join(needs_group)} need a process group of their own (--cpu-offload): "
              "measure them with gptrain bench", file=sys.stderr)
        return 2
    start = time.perf_counter()
    cuda = torch.cuda.is_available() and "--device" not in model_flags
    if cuda:
        torch.cuda.set_device(world_from_env()[2])
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.best_micro_batch is not None:
        names = args.best_micro_batch.split() or [r.name for r in rows]
        missing = [n for n in names if n not in {r.name for r in rows}]
        if missing:
            print(f"layout_table: --best-micro-batch names rows not run: {', '.join(missing)}", file=sys.stderr)
            return 2
        gpu = local_gpu(device)
        best = [best_micro_batch_row(next(r for r in rows if r.name == n), model_flags, gpu) for n in names]
        rows += [b for b in best if b is not None]
    # the one-GPU rows first, on the first rank alone (the others wait for the group, leaving it the host), before the
    # group exists (a process of a world would otherwise reduce with the others)
    order = [r for r in rows if r.gpus == 1] + [r for r in rows if r.gpus > 1]
    results, not_run = [], []
    speak = is_logging_rank()
    if speak:
        print(HEADER, flush=True)
    try:
        for row in order:
            if row.gpus == 1 and not speak:
                continue
            late = args.time_limit is not None and time.perf_counter() - start > args.time_limit
            if row.gpus > 1:
                if not dist.is_initialized():
                    init_distributed(device)
                flag = torch.tensor(float(late), device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank starts the row, or none
                late = bool(flag.item())
            if late:
                not_run.append(row.name)
                continue
            explained = any(r.left_gib and r.left_gib > LEFT_GIB for r in results)
            result = run_row(row, model_flags, args.warmup, args.iters,
                             not args.no_baseline and row.name in BASELINE_ROWS, explain=not explained)
            results.append(result)
            if speak:
                print(format_row(result, reference(result, results), model_flags, device), flush=True)
    finally:
        end_process_group()
    if speak:
        print(f"\n== the table ({len(results)} rows in {time.perf_counter() - start:.0f} s; "
              f"{torch.cuda.get_device_name(device) if cuda else 'cpu'} x {world}; 'of 1 GPU': of the tokens/s per GPU "
              "of the one-GPU row at the same micro-batch, else of the first; wall: the row's seconds, compilation in "
              "'steps')")
        print(HEADER)
        for r in results:
            print(format_row(r, reference(r, results), model_flags, device))
        if not_run:
            print(f"not run (--time-limit {args.time_limit:.0f} s): {' '.join(not_run)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
