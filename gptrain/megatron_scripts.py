"""``gptrain megatron-scripts DIR``: Megatron-LM's entry points as small files that call gptrain.

It writes ``pretrain_gpt.py``, ``tools/preprocess_data.py``, ``tools/merge_datasets.py``,
``tools/run_text_generation_server.py`` and ``tools/text_generation_cli.py`` into DIR, so a Megatron
user's script runs unchanged from DIR (``torchrun ... pretrain_gpt.py $ARGS``, ``python
tools/preprocess_data.py ...``). Each file passes its command line to :func:`entry`, which runs the
gptrain command of the same job: the flags are Megatron's, and only where gptrain's command names a
flag differently (the text generation server) are they translated, each translation printed.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Megatron's file -> the gptrain command that does its job
SCRIPTS: dict[str, str] = {
    "pretrain_gpt.py": "train",
    "tools/preprocess_data.py": "preprocess",
    "tools/merge_datasets.py": "merge-datasets",
    "tools/run_text_generation_server.py": "serve",
    "tools/text_generation_cli.py": "client",
}

_TEMPLATE = '''#!/usr/bin/env python3
"""Megatron-LM's {path}, run by `gptrain {command}` (written by `gptrain megatron-scripts`).

The flags are Megatron's; `gptrain {command} --help` lists what gptrain accepts."""
import sys

try:
    from gptrain.megatron_scripts import entry
except ImportError as err:
    sys.exit(f"{{sys.argv[0]}}: gptrain is not importable by {{sys.executable}} ({{err}}): install gptrain there")

if __name__ == "__main__":
    sys.exit(entry("{path}", sys.argv[1:]))
'''


def script_text(path: str) -> str:
    """The text written for one of ``SCRIPTS``."""
    return _TEMPLATE.format(path=path, command=SCRIPTS[path])


def entry(path: str, argv: list[str]) -> int:
    """What a written script runs: the gptrain command of ``path`` over its command line."""
    from gptrain.cli import main

    command = SCRIPTS[path]
    if command == "train":
        argv = _drop_launcher_local_rank(argv)
    elif command == "preprocess":
        try:
            argv, notes = preprocess_argv(argv)
        except ValueError as err:
            print(f"gptrain preprocess: error: {path}: {err}", file=sys.stderr)
            return 2
        for note in notes:
            print(f"{path}: {note}", flush=True)
    elif command == "serve":
        try:
            argv, notes, shape = server_argv(argv)
            if "--help" not in argv:
                notes.insert(1, check_architecture(argv, shape))
        except ValueError as err:
            print(f"gptrain serve: error: {path}: {err}", file=sys.stderr)
            return 2
        if os.environ.get("RANK", "0") == "0":
            for note in filter(None, notes):
                print(f"{path}: {note}", flush=True)
    return main([command, *argv])


def _drop_launcher_local_rank(argv: list[str]) -> list[str]:
    """``python -m torch.distributed.launch`` appends ``--local-rank=N`` to the script's flags (as
    Megatron-DeepSpeed's scripts launch); the same number is in the environment as LOCAL_RANK, which
    gptrain reads, so the flag is dropped when it says the same (any other value is left for gptrain
    to refuse)."""
    local = os.environ.get("LOCAL_RANK")
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in ("--local-rank", "--local_rank") and local is not None:
            if not eq and i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            if value == local:
                i += 1
                continue
            out.extend([name, value])
            i += 1
            continue
        out.append(arg)
        i += 1
    return out


# --- tools/preprocess_data.py: the flags Megatron has and gptrain preprocess has not, where they change nothing

def preprocess_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Megatron's ``--partitions N`` splits the input and merges the parts' outputs in order: with
    ``--keep-sequential-samples`` (contiguous parts) the documents are those of one pass in input order,
    which gptrain writes (its threads keep the order), so both are dropped, with a line saying so;
    without it Megatron deals the lines round-robin (another order) and the run is refused. ``--keep-newlines``
    and ``--lang`` only act with ``--split-sentences`` (not implemented: gptrain preprocess refuses it)."""
    out: list[str] = []
    notes: list[str] = []
    partitions, sequential = 1, "--keep-sequential-samples" in argv
    splitting = "--split-sentences" in argv
    i = 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        if name == "--partitions":
            if not eq:
                i += 1
            raw = inline if eq else (argv[i] if i < len(argv) else "")
            try:
                partitions = int(raw)
            except ValueError:
                raise ValueError(f"--partitions {raw!r}: not a number") from None
        elif name == "--keep-sequential-samples":
            pass
        elif name in ("--keep-newlines", "--lang") and not splitting:
            if name == "--lang" and not eq:
                i += 1
            notes.append(f"{name} changes nothing without --split-sentences (as in Megatron)")
        else:
            out.append(argv[i])
        i += 1
    if partitions > 1 and not sequential:
        raise ValueError(f"--partitions {partitions} without --keep-sequential-samples deals the input lines "
                         "round-robin over the partitions (another document order): add --keep-sequential-samples "
                         "for the input's order, which gptrain writes in one pass, or leave out --partitions")
    if partitions > 1:
        notes.append(f"--partitions {partitions} --keep-sequential-samples: the same documents in the same order, "
                     "written in one pass (no partition files)")
    return out, notes


# --- tools/run_text_generation_server.py: Megatron's flags onto `gptrain serve` ---------------------

# the same name and meaning in `gptrain serve` (Megatron's first; then gptrain serve's own, so they may be added)
_SERVE_VALUE = {"--load", "--vocab-file", "--merge-file", "--tensor-model-parallel-size", "--port",
                "--host", "--device", "--dtype", "--max-batch", "--max-queue", "--max-body-bytes", "--model-name", "--tokenizer-model"}
_SERVE_SWITCH = {"--no-cuda-graph", "--no-warmup"}
# the architecture: gptrain serve reads it from the checkpoint; these are checked against it, as Megatron's
# load fails on a different shape (unless --use-checkpoint-args, which takes the checkpoint's)
_ARCHITECTURE = {"--num-layers": "num_layers", "--hidden-size": "hidden_size",
                 "--num-attention-heads": "num_attention_heads", "--ffn-hidden-size": "ffn_hidden_size",
                 "--max-position-embeddings": "max_position_embeddings"}
# the length of a request and the vocabulary's padding: the checkpoint's own
_FROM_CHECKPOINT = {"--seq-length", "--make-vocab-size-divisible-by", "--kv-channels",
                    # the Llama family's: the checkpoint's saved config (or config.json) holds them
                    "--normalization", "--norm-epsilon", "--position-embedding-type", "--rotary-base",
                    "--rotary-percent", "--num-query-groups"}
_FROM_CHECKPOINT_SWITCH = {"--swiglu", "--group-query-attention", "--untie-embeddings-and-output-weights",
                           "--disable-bias-linear", "--add-qkv-bias", "--use-rotary-position-embeddings"}
# accepted, changing nothing when serving (why, printed); then the no-op Megatron flags of `gptrain train`
# (flag_tables.COMPATIBILITY, with their reasons), and its refused ones refused
_NO_OP_VALUE = {
    "--micro-batch-size": "a request's prompts are batched by the server",
    "--seed": "sampling is seeded per request (the request's random_seed)",
}
_NO_OP_SWITCH = {
    "--no-load-rng": "serving loads no RNG state", "--no-load-optim": "serving loads no optimizer",
    "--no-bias-gelu-fusion": "the server's MLP is chosen by gptrain serve",
    "--bias-gelu-fusion": "the server's MLP is chosen by gptrain serve",
}


def _training_compat() -> dict:
    from gptrain.flag_tables import COMPATIBILITY

    return {c.name: c for c in COMPATIBILITY}


def server_argv(argv: list[str]) -> tuple[list[str], list[str], dict[str, str]]:
    """Megatron's ``run_text_generation_server.py`` flags -> ``gptrain serve`` flags, the lines saying
    what was translated or taken from the checkpoint, and the architecture flags to check against the
    checkpoint (``check_architecture``). A flag with no meaning here is a ValueError naming it (never
    ignored)."""
    out: list[str] = []
    from_ckpt: list[str] = []
    shape: dict[str, str] = {}
    use_checkpoint_args = False
    no_ops: list[str] = []
    unknown: list[str] = []
    dtype = None
    i = 0

    def value(name: str) -> str:
        nonlocal i
        if i + 1 >= len(argv):
            raise ValueError(f"{name} needs a value")
        i += 1
        return argv[i]

    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        take = (lambda: inline) if eq else (lambda: value(name))
        if name in ("-h", "--help"):
            out.append("--help")
        elif name in _SERVE_VALUE:
            out += [name, take()]
        elif name in _SERVE_SWITCH:
            out.append(name)
        elif name in ("--fp16", "--bf16"):
            dtype = name[2:]
        elif name == "--pipeline-model-parallel-size":
            if take() != "1":
                raise ValueError("--pipeline-model-parallel-size: gptrain serves with tensor parallelism only "
                                 "(--tensor-model-parallel-size); pipeline-parallel serving is not implemented")
        elif name == "--tokenizer-type":
            kind = take()
            if kind not in ("GPT2BPETokenizer", "HuggingFaceTokenizer"):
                raise ValueError(f"--tokenizer-type {kind}: only GPT2BPETokenizer and HuggingFaceTokenizer "
                                 "(--tokenizer-model) are supported")
            if kind != "GPT2BPETokenizer":
                out += [name, kind]
        elif name in _ARCHITECTURE:
            shape[name] = take()
        elif name in _FROM_CHECKPOINT:
            from_ckpt.append(f"{name} {take()}")
        elif name in _FROM_CHECKPOINT_SWITCH:
            from_ckpt.append(name)
        elif name == "--use-checkpoint-args":
            use_checkpoint_args = True
        elif name in _NO_OP_VALUE:
            no_ops.append(f"{name} {take()} ({_NO_OP_VALUE[name]})")
        elif name in _NO_OP_SWITCH:
            no_ops.append(f"{name} ({_NO_OP_SWITCH[name]})")
        elif name in (compat := _training_compat()):
            c = compat[name]
            if c.kind == "refused":
                raise ValueError(f"{name}: {c.reason}")
            given = take() if c.kind == "value" else None
            if c.values is not None and given not in c.values:
                raise ValueError(f"{name} {given}: only {', '.join(c.values)} ({c.reason})")
            no_ops.append(f"{name}{'' if given is None else ' ' + given} ({c.reason})")
        else:
            unknown.append(name)
            while not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                i += 1  # its values
        i += 1
    if unknown:
        raise ValueError(f"flag(s) {' '.join(unknown)} not implemented by gptrain serve (see `gptrain serve --help`)")
    if dtype and "--dtype" not in out:
        out += ["--dtype", dtype]
    notes = [f"runs gptrain serve {' '.join(out)}"]
    if use_checkpoint_args:
        from_ckpt[:0] = [f"{k} {v}" for k, v in shape.items()]
        shape = {}
    if from_ckpt:
        notes.append(f"the checkpoint's own values are used for {', '.join(from_ckpt)}")
    if no_ops:
        notes.append(f"accepted, changing nothing: {'; '.join(no_ops)}")
    if "--host" not in out:
        notes.append("listening on 127.0.0.1 only (Megatron binds 0.0.0.0): add --host 0.0.0.0 to serve other hosts")
    return out, notes, shape


def check_architecture(serve_argv: list[str], shape: dict[str, str]) -> str | None:
    """The architecture flags (``shape``: flag -> value) against the checkpoint of ``--load``: a ValueError
    naming each difference, else the line saying they match. A checkpoint whose architecture cannot be read
    here is left to ``gptrain serve`` to load and report."""
    if not shape:
        return None
    load = serve_argv[serve_argv.index("--load") + 1] if "--load" in serve_argv else None
    cfg = _checkpoint_architecture(load) if load else None
    flags = ", ".join(f"{k} {v}" for k, v in shape.items())
    if cfg is None:
        return f"the architecture is the checkpoint's ({flags} not checked)"
    differ = [f"{k} {v} (the checkpoint: {cfg[_ARCHITECTURE[k]]})" for k, v in shape.items()
              if str(cfg[_ARCHITECTURE[k]]) != v]
    if differ:
        raise ValueError(f"{load} is another model: {', '.join(differ)} (--use-checkpoint-args takes the "
                         "checkpoint's)")
    return f"the architecture flags match the checkpoint ({flags})"


def _checkpoint_architecture(path: str) -> dict | None:
    """num_layers, hidden_size, ... of the checkpoint at ``path``, or None where it does not read here."""
    try:
        from gptrain.checkpoint_kind import checkpoint_kind

        kind = checkpoint_kind(path)
        if kind == "gptrain":
            from gptrain.inference.load import _gptrain_config

            cfg = vars(_gptrain_config(Path(path))[0])
        elif kind == "megatron":
            from gptrain.interop.megatron import read_megatron_checkpoint

            cfg = vars(read_megatron_checkpoint(path).gpt_config())
        elif kind == "huggingface":
            from gptrain.interop.hf import read_hf_config

            cfg = vars(read_hf_config(path))
        else:
            return None
        return {field: cfg[field] for field in _ARCHITECTURE.values()}
    except Exception:  # noqa: BLE001 - gptrain serve's own load reports what is wrong with the checkpoint
        return None


# --- the `gptrain megatron-scripts DIR` command --------------------------------------------------------

def write_scripts(folder: str | os.PathLike, force: bool = False) -> list[tuple[Path, str]]:
    """Write the scripts into ``folder``: [(path, 'wrote' | 'unchanged' | 'overwrote')]. An existing
    different file is a FileExistsError before anything is written, unless ``force``."""
    root = Path(folder)
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"{root}: not a folder")
    plan = []
    clashes = []
    for rel in SCRIPTS:
        path, text = root / rel, script_text(rel)
        if path.is_dir():
            raise IsADirectoryError(f"{path}: a folder is in the way")
        if not path.exists():
            plan.append((path, text, "wrote"))
        elif path.read_bytes() == text.encode():
            plan.append((path, text, "unchanged"))
        else:
            clashes.append(path)
            plan.append((path, text, "overwrote"))
    if clashes and not force:
        raise FileExistsError(f"{', '.join(map(str, clashes))}: already there and different "
                              "(pass --force to overwrite); nothing written")
    for path, text, action in plan:
        if action == "unchanged":
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        tmp.chmod(0o755 & ~_umask())
        os.replace(tmp, path)
    return [(path, action) for path, _, action in plan]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def megatron_scripts_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="gptrain megatron-scripts",
        description="write Megatron-LM's pretrain_gpt.py and tools/ scripts into DIR, each calling gptrain, so "
                    "`cd DIR && bash my_megatron_script.sh` runs unchanged")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--force", action="store_true", help="overwrite existing files that differ")
    args = p.parse_args(argv)
    try:
        done = write_scripts(args.dir, force=args.force)
    except OSError as err:
        print(f"gptrain: error: {err}", file=sys.stderr)
        return 2
    for path, action in done:
        print(f"{action} {path} -> gptrain {SCRIPTS[path.relative_to(args.dir).as_posix()]}")
    return 0
