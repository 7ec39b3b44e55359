"""``gptrain generate --load CKPT --prompt "..."``: the completion streamed to the terminal."""
from __future__ import annotations

import argparse
import sys


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", required=True, help="a gptrain or Megatron-LM checkpoint folder, or a HF GPT-2 folder")
    p.add_argument("--vocab-file", default=None, help="gpt2-vocab.json (default: the checkpoint's, else GPT-2's)")
    p.add_argument("--merge-file", default=None)
    p.add_argument("--tokenizer-type", default=None, choices=("GPT2BPETokenizer", "HuggingFaceTokenizer"),
                   help="default: the checkpoint's (a Hugging Face folder's tokenizer.json, a run's flags), else GPT-2's")
    p.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer: a folder holding tokenizer.json, or the file")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default: bf16 on a GPU, fp32 on the CPU)")
    p.add_argument("--tensor-model-parallel-size", dest="tensor_parallel", type=int, default=1,
                   metavar="N", help="split each layer over this many processes of one host, as Megatron serves "
                        "(start with torchrun --nproc-per-node N; one GPU each)")


def load_from_flags(args, decode: bool = True):
    """The model of ``--load`` (this rank's shard under tensor parallelism: the process group is
    joined here; ``close_distributed`` leaves it). ``decode``: the decode loop runs next, so what
    its first step needs is prepared beside the read (``early_init``)."""
    from gptrain.inference import early_init
    from gptrain.inference.load import load_for_inference
    from gptrain.device import pick_device
    from gptrain.inference.text import pick_dtype

    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    device, mesh = _tensor_parallel_mesh(args.tensor_parallel, device)
    early = early_init.start(device) if decode and mesh is None else None
    loaded = load_for_inference(args.load, device, dtype, args.vocab_file, args.merge_file, tp_mesh=mesh,
                                tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model)
    if early is not None:
        early.join()
    return loaded


def _tensor_parallel_mesh(tp: int, device):
    """(this rank's device, the tensor-parallel mesh or None); the layout is checked before any work."""
    from gptrain.parallel.dims import world_from_env

    world = world_from_env()[0]
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size {tp} must be at least 1")
    if world != tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} needs {tp} process{'es' if tp > 1 else ''} "
                         f"(torchrun --nproc-per-node {tp}); this run has {world}")
    if tp == 1:
        return device, None
    from torch.distributed.device_mesh import init_device_mesh

    from gptrain.parallel.dims import init_distributed

    device = init_distributed(device)
    return device, init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))


def close_distributed(model=None) -> None:
    """End the process group, after ``model``'s captured decode graphs are gone (see
    ``host_loop.release_model_caches``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if model is not None:
            from gptrain.inference.host_loop import release_model_caches

            release_model_caches(model)
        from gptrain.parallel.teardown import end_process_group

        end_process_group()


def is_rank0() -> bool:
    from gptrain.parallel.dims import world_from_env

    return world_from_env()[1] == 0


def generate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gptrain generate", description=__doc__.splitlines()[0])
    add_model_flags(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokens-to-generate", "--max-new-tokens", dest="tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--greedy", action="store_true", help="same as --temperature 0")
    p.add_argument("--stop-on-eol", action="store_true")
    p.add_argument("--stop-on-double-eol", action="store_true")
    args = p.parse_args(argv)
    if args.tokens < 0:
        return _fail("--tokens-to-generate must be >= 0")
    if args.temperature < 0 or args.top_k < 0 or not 0 <= args.top_p <= 1:
        return _fail("--temperature and --top-k must be >= 0, --top-p in [0, 1]")
    try:
        return _generate(args)
    except (OSError, ValueError) as err:
        return _fail(str(err))
    finally:
        close_distributed()


def _generate(args) -> int:
    from gptrain.inference.steps import fused_decodable
    from gptrain.inference.generate import SamplingParams, generate
    from gptrain.inference.text import TextStream
    from gptrain.start_clock import StartClock

    clock = StartClock()
    clock.mark("imports")
    loaded = load_from_flags(args)
    clock.mark("load")
    tok = loaded.tokenizer
    prompt = tok.encode(args.prompt) or [tok.eod]  # an empty prompt starts at <|endoftext|>
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.0 if args.greedy else args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_ids=(tok.eod,),
                            stop_on_eol=args.stop_on_eol, stop_on_double_eol=args.stop_on_double_eol)
    stream = TextStream(tok)
    out = sys.stdout if is_rank0() else None  # under tensor parallelism every rank decodes; rank 0 writes
    if out:
        out.write(args.prompt)
        out.flush()

    def show(row: int, token: int) -> None:
        if out and token != tok.eod:
            out.write(stream.push(token))
            out.flush()

    model = loaded.model
    cuda = model.word_embeddings.weight.is_cuda
    if cuda and fused_decodable(model):
        from gptrain.inference.rows import fused_generate  # the CUDA-graph decode loop

        # one stream: nothing to be batch invariant against, so the single-stream decoder (faster); under
        # tensor parallelism every rank runs the same steps, rank 0's ids broadcast inside them
        fused_generate(model, [prompt], params, on_token=show, batch_invariant=False)
    elif loaded.group is not None or cuda:
        from gptrain.inference.graph_step import graph_step_generate  # layers the fused kernels do not cover

        sync = None
        if loaded.group is not None:  # rank 0's ids after each step (StepSync)
            from gptrain.inference.tensor_parallel import StepSync

            sync = StepSync(loaded.group)
        graph_step_generate(model, [prompt], params, on_token=show, sync=sync)
    else:
        generate(model, [prompt], params, on_token=show)
    if loaded.group is not None:
        close_distributed(model)  # its graphs first (see close_distributed)
    if out:
        out.write(stream.flush() + "\n")
        out.flush()
        clock.mark("generation, first-call compiles and capture included")
        print(f"gptrain generate: done in {clock.line()}", file=sys.stderr, flush=True)
    return 0


def _fail(message: str) -> int:
    print(f"gptrain generate: error: {message}", file=sys.stderr)
    return 2
