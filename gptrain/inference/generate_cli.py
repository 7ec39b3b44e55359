"""``gptrain generate --load CKPT --prompt "..."``: the completion streamed to the terminal."""
from __future__ import annotations

import argparse
import sys


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", required=True, help="a gptrain or Megatron-LM checkpoint folder, or a HF GPT-2 folder")
    p.add_argument("--vocab-file", default=None, help="gpt2-vocab.json (default: the checkpoint's, else GPT-2's)")
    p.add_argument("--merge-file", default=None)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default: bf16 on a GPU, fp32 on the CPU)")


def load_from_flags(args):
    from gptrain.inference.load import load_for_inference
    from gptrain.inference.text import pick_device, pick_dtype

    device = pick_device(args.device)
    return load_for_inference(args.load, device, pick_dtype(args.dtype, device), args.vocab_file, args.merge_file)


def generate_main(argv: list[str]) -> int:
    from gptrain.inference.generate import SamplingParams, generate
    from gptrain.inference.text import TextStream

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
        loaded = load_from_flags(args)
        tok = loaded.tokenizer
        prompt = tok.encode(args.prompt) or [tok.eod]  # an empty prompt starts at <|endoftext|>
        params = SamplingParams(max_new_tokens=args.tokens, temperature=0.0 if args.greedy else args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_ids=(tok.eod,),
                                stop_on_eol=args.stop_on_eol, stop_on_double_eol=args.stop_on_double_eol)
        stream = TextStream(tok)
        sys.stdout.write(args.prompt)
        sys.stdout.flush()

        def show(row: int, token: int) -> None:
            if token != tok.eod:
                sys.stdout.write(stream.push(token))
                sys.stdout.flush()

        generate(loaded.model, [prompt], params, on_token=show)
        sys.stdout.write(stream.flush() + "\n")
    except (OSError, ValueError) as err:
        return _fail(str(err))
    return 0


def _fail(message: str) -> int:
    print(f"gptrain generate: error: {message}", file=sys.stderr)
    return 2
