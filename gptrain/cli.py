"""The ``gptrain`` command: a table of subcommands, each a plain function over parsed arguments."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable


def _preprocess_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gptrain preprocess",
                                description="JSONL -> Megatron indexed dataset (tools/preprocess_data.py flags)")
    p.add_argument("--input", nargs="+", required=True, help="JSONL files or globs (.gz .xz .bz2 .zst read too)")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    # --vocab: Megatron-DeepSpeed's scripts abbreviate --vocab-file, which --vocab-size would make ambiguous
    p.add_argument("--vocab-file", "--vocab", default=None, help="gpt2-vocab.json (default: the built-in GPT-2 files)")
    p.add_argument("--merge-file", default=None, help="gpt2-merges.txt")
    p.add_argument("--tokenizer-type", default="GPT2BPETokenizer",
                   help="GPT2BPETokenizer, HuggingFaceTokenizer (--tokenizer-model) or NullTokenizer (--vocab-size)")
    p.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer: a folder holding tokenizer.json, or the file")
    p.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                   help="HuggingFaceTokenizer: add the tokenizer's template tokens (a BOS, say) to each document")
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: ids 0..N-1, end-of-document id N")
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--workers", type=int, default=None, help="tokenizing threads (default: all cores)")
    p.add_argument("--chunk-size", type=int, default=64, help="documents per task, at least")
    p.add_argument("--dataset-impl", default="mmap")
    p.add_argument("--log-interval", type=int, default=100000)
    p.add_argument("--strict", action="store_true", help="stop at the first bad line instead of skipping it")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def cmd_preprocess(argv: list[str]) -> int:
    import os

    from gptrain.data.preprocess import PreprocessConfig, PreprocessError, preprocess

    from gptrain.tokenizer import build_tokenizer

    args = _preprocess_parser().parse_args(argv)
    if args.dataset_impl != "mmap":
        return _fail(f"--dataset-impl {args.dataset_impl}: only mmap (Megatron's MMIDIDX format) is written")
    try:
        config = PreprocessConfig(
            inputs=args.input, output_prefix=args.output_prefix, json_keys=args.json_keys,
            vocab_file=args.vocab_file, merge_file=args.merge_file, append_eod=args.append_eod,
            workers=args.workers or os.cpu_count() or 1, chunk_size=args.chunk_size,
            log_interval=args.log_interval, strict=args.strict, overwrite=args.overwrite,
            progress=False if args.no_progress else None,
        )
        tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                                    vocab_size=args.vocab_size, tokenizer_model=args.tokenizer_model,
                                    include_special_tokens=args.tokenizer_hf_include_special_tokens)
        if args.append_eod and tokenizer.eod is None:
            return _fail(f"--append-eod: the tokenizer {args.tokenizer_model} has no end-of-text token (no eos_token in "
                         "tokenizer_config.json / special_tokens_map.json, none of </s>, <|endoftext|>, <|end_of_text|>)")
        report = preprocess(config, tokenizer)
    except PreprocessError as err:
        _fail(str(err))
        return err.exit_code  # 128 + the signal for SIGINT/SIGTERM
    except (ValueError, FileNotFoundError) as err:
        return _fail(str(err))
    print(report.summary())
    for key, prefix in config.output_prefixes().items():
        print(f"wrote {prefix}.bin, {prefix}.idx, {prefix}.json")
    return 0


def cmd_merge_datasets(argv: list[str]) -> int:
    from gptrain.data.merge import merge_datasets

    p = argparse.ArgumentParser(prog="gptrain merge-datasets", description="concatenate indexed datasets")
    p.add_argument("--input", nargs="+", required=True, help="a directory of .bin/.idx pairs, or prefixes")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    try:
        merged = merge_datasets(args.input, args.output_prefix, overwrite=args.overwrite)
    except (OSError, ValueError) as err:
        return _fail(str(err))
    print(f"merged into {args.output_prefix}: {merged.num_documents} documents, {merged.num_tokens} tokens")
    return 0


def cmd_data(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gptrain data", description="data utilities")
    sub = p.add_subparsers(dest="action", required=True)
    b = sub.add_parser("builtin", help="export the built-in corpus (Python's documentation) as JSONL")
    b.add_argument("--output", required=True)
    i = sub.add_parser("inspect", help="statistics and a decoded document of an indexed dataset")
    i.add_argument("prefix")
    i.add_argument("--document", type=int, default=None)
    i.add_argument("--vocab-file", default=None)
    i.add_argument("--merge-file", default=None)
    i.add_argument("--tokenizer-type", default="GPT2BPETokenizer")
    i.add_argument("--tokenizer-model", default=None, help="HuggingFaceTokenizer: a folder holding tokenizer.json")
    i.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's")
    sub.add_parser("build-cache", help="build the dataset index maps of a training config ahead of a run",
                   add_help=False)
    sub.add_parser("samples", help="the token ids training reads at positions of a split (.npy)", add_help=False)
    if argv[:1] == ["samples"]:  # its own parser: the training flags pass through untouched
        from gptrain.data.samples import samples_main

        return samples_main(argv[1:])
    args, rest = p.parse_known_args(argv)
    try:
        if args.action == "builtin":
            from gptrain.data.builtin import write_builtin_corpus

            docs, size = write_builtin_corpus(args.output)
            print(f"wrote {args.output}: {docs} documents, {size / 1e6:.2f} MB")
        elif args.action == "inspect":
            from gptrain.data.inspect_data import describe
            from gptrain.tokenizer import build_tokenizer

            tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                                        vocab_size=args.vocab_size, tokenizer_model=args.tokenizer_model) \
                if args.document is not None else None
            print(describe(args.prefix, args.document, tokenizer))
        elif args.action == "build-cache":
            from gptrain.data.assemble import build_cache

            return build_cache(rest)
    except (OSError, ValueError, IndexError) as err:
        return _fail(str(err))
    if rest and args.action != "build-cache":
        return _fail(f"unrecognized arguments: {' '.join(rest)}")
    return 0


def _entry(module: str, function: str) -> Callable[[list[str]], int]:
    """A subcommand that imports its ``module`` only when it runs (``gptrain --help`` imports none)."""
    def run(argv: list[str]) -> int:
        return getattr(importlib.import_module(module), function)(argv)

    run.__name__ = function
    return run


def _fail(message: str) -> int:
    print(f"gptrain: error: {message}", file=sys.stderr)
    return 2


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "demo": (_entry("gptrain.demo", "demo_main"),
             "the main job on built-in data: prepare, train a small GPT, evaluate, sample"),
    "preprocess": (cmd_preprocess, "JSONL -> Megatron .bin/.idx (tools/preprocess_data.py flags)"),
    "merge-datasets": (cmd_merge_datasets, "concatenate indexed datasets"),
    "data": (cmd_data, "builtin corpus | inspect a dataset | build-cache | samples"),
    "train": (_entry("gptrain.train.command", "train_command"), "pretrain a GPT (pretrain_gpt.py flags)"),
    "plan": (_entry("gptrain.plan.cli", "plan_main"),
             "predicted tokens/s and memory per GPU of every parallel layout, fastest first"),
    "bench": (_entry("gptrain.bench", "bench_main"), "training throughput against a plain PyTorch baseline"),
    "generate": (_entry("gptrain.inference.generate_cli", "generate_main"),
                 "stream a completion from a gptrain, Megatron or HF GPT-2 checkpoint"),
    "serve": (_entry("gptrain.serve.main", "serve_main"),
              "text generation server: Megatron's PUT /api, OpenAI /v1/completions, a web page"),
    "client": (_entry("gptrain.serve.client", "client_main"),
               "Megatron's text_generation_cli loop against a server (or one prompt)"),
    "evaluate": (_entry("gptrain.evaluate", "evaluate_main"),
                 "perplexity / bits per byte and LAMBADA-style cloze accuracy of a checkpoint"),
    "convert": (_entry("gptrain.interop.convert", "convert_main"),
                "gptrain <-> Hugging Face GPT-2 and Megatron-LM (each checked on logits)"),
    "megatron-scripts": (_entry("gptrain.megatron_scripts", "megatron_scripts_main"),
                         "write pretrain_gpt.py and tools/*.py into DIR: Megatron scripts run unchanged there"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: gptrain COMMAND [flags]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<15} {help_text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "--version":
        from gptrain import __version__

        print(__version__)
        return 0
    if name not in COMMANDS:
        return _fail(f"unknown command {name!r}; commands: {', '.join(COMMANDS)}")
    try:
        return COMMANDS[name][0](rest)
    except KeyboardInterrupt:  # Ctrl-C before a command's own handling started (imports, start-up): no traceback
        print(f"gptrain: {name}: interrupted by SIGINT during start-up; nothing was written", file=sys.stderr)
        return 130


# commands whose process has nothing left to do once they return: they leave without the interpreter's
# teardown (freeing every module and torch's state), which takes longer than a short generation
QUICK_EXIT = ("generate",)


def console_main() -> None:
    """The ``gptrain`` command (and ``python -m gptrain``): ``main``, then the process's exit."""
    code = main()
    if len(sys.argv) > 1 and sys.argv[1] in QUICK_EXIT:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:  # a reader that went away (`| head`): nothing more to say to it
                pass
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    console_main()
