"""`gptrain megatron-scripts DIR`: the seeds' Megatron scripts run from DIR with their launcher lines unchanged.

The seeds' shell scripts (seeds/000's single-GPU run, seeds/001's preprocessing, 4-process training, text
generation server and client, seeds/003's Megatron-DeepSpeed preprocessing and non-DeepSpeed training) are
extracted from the seed documents in ../shared/seeds and kept verbatim in tests/megatron_seed_scripts/ (CI's
clone has no ../shared: the copies run there, and the extraction is checked against them where the seeds are).
Each runs under bash from DIR, as a Megatron user runs it, with only its paths, ports and model-shape, batch
and iteration flags changed (``_tiny``): 2 layers, hidden 64, sequences of 64, 2 iterations, on the CPU.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import random_text, write_jsonl

REPO = Path(__file__).resolve().parent.parent
SEEDS = REPO.parent / "shared" / "seeds"
COPIES = REPO / "tests" / "megatron_seed_scripts"


# --- the seeds' scripts -------------------------------------------------------------------------------

def _blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)


def _command(lines: list[str], start: int) -> list[str]:
    """The shell command starting at ``lines[start]`` with its backslash continuations."""
    end = start
    while lines[end].rstrip().endswith("\\"):
        end += 1
    return lines[start:end + 1]


def _unprompt(line: str) -> str:
    """``root@host:/workspace/Megatron-LM# python tools/x.py`` -> ``python tools/x.py``."""
    return re.sub(r"^[^\s#]+# ", "", line)


def _block(seed: str, marker: str) -> list[str]:
    text = next(SEEDS.glob(f"{seed}_*.txt")).read_text(encoding="utf-8")
    found = [b for b in _blocks(text) if marker in b]
    assert found, f"seeds/{seed}: no code block with {marker!r}"
    return found[0].splitlines()


def _script(seed: str, marker: str, start: str) -> str:
    """From the line starting with ``start`` (a shebang) to the end of the command on ``marker``'s line."""
    lines = _block(seed, marker)
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    launch = next(i for i, line in enumerate(lines) if i > first and marker in line)
    return "\n".join(lines[first:launch] + _command(lines, launch)) + "\n"


def _one_command(seed: str, marker: str) -> str:
    lines = _block(seed, marker)
    launch = next(i for i, line in enumerate(lines) if marker in line)
    return "\n".join(_unprompt(line) for line in _command(lines, launch)) + "\n"


def extract_seed_scripts() -> dict[str, str]:
    """The seeds' scripts by file name in COPIES, cut out of the seed documents."""
    return {
        "000_pretrain_gpt.sh": _script("000", "torchrun pretrain_gpt.py", "#!"),
        "001_preprocess_data.sh": _one_command("001", "tools/preprocess_data.py"),
        "001_train_gpt2_345m_1dp1pp_distributed.sh": _script("001", "pretrain_gpt.py", "#!"),
        "001_run_text_generation_server_345M.sh": _script("001", "tools/run_text_generation_server.py", "#!"),
        "001_text_generation_cli.sh": _one_command("001", "tools/text_generation_cli.py"),
        "003_preprocess_data.sh": _one_command("003", "tools/preprocess_data.py"),
        "003_copy_data.sh": "\n".join(_block("003", "mkdir data")) + "\n",
        "003_pretrain_gpt2.sh": _script("003", "pretrain_gpt.py", "#!"),
    }


def seed_script(name: str) -> str:
    return (COPIES / name).read_text(encoding="utf-8")


@pytest.mark.skipif(not SEEDS.is_dir(), reason=f"the seed documents are not at {SEEDS} (../shared)")
def test_copies_are_the_seeds_scripts():
    extracted = extract_seed_scripts()
    assert sorted(extracted) == sorted(p.name for p in COPIES.iterdir())
    for name, text in extracted.items():
        assert seed_script(name) == text, f"tests/megatron_seed_scripts/{name} differs from the seed's script"


# --- the command ----------------------------------------------------------------------------------------

def _gptrain(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "gptrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_writes_the_scripts_then_refuses_to_overwrite_a_different_one(tmp_path):
    from gptrain.megatron_scripts import SCRIPTS, script_text, write_scripts

    out = tmp_path / "megatron"
    done = write_scripts(out)
    assert [(p.relative_to(out).as_posix(), a) for p, a in done] == [(rel, "wrote") for rel in SCRIPTS]
    for rel, command in SCRIPTS.items():
        text = (out / rel).read_text()
        assert text == script_text(rel) and f"gptrain {command}" in text and "sys.argv[1:]" in text
        assert len(text.splitlines()) <= 15 and os.access(out / rel, os.X_OK)
    assert {a for _, a in write_scripts(out)} == {"unchanged"}

    (out / "tools" / "merge_datasets.py").write_text("# the user's own\n")
    before = {p: p.read_bytes() for p in out.rglob("*.py")}
    (out / "pretrain_gpt.py").unlink()
    with pytest.raises(FileExistsError, match=r"merge_datasets\.py: already there and different .*--force"):
        write_scripts(out)
    assert not (out / "pretrain_gpt.py").exists(), "something was written although a file was refused"
    assert {p: p.read_bytes() for p in out.rglob("*.py")} == {p: b for p, b in before.items() if p.exists()}
    done = dict((p.relative_to(out).as_posix(), a) for p, a in write_scripts(out, force=True))
    assert done["tools/merge_datasets.py"] == "overwrote" and done["pretrain_gpt.py"] == "wrote"
    assert (out / "tools" / "merge_datasets.py").read_text() == script_text("tools/merge_datasets.py")


def test_command_line(tmp_path):
    result = _gptrain("megatron-scripts", str(tmp_path / "d"))
    assert result.returncode == 0, result.stderr
    assert f"wrote {tmp_path / 'd' / 'pretrain_gpt.py'} -> gptrain train" in result.stdout.splitlines()
    assert len(result.stdout.splitlines()) == 5
    (tmp_path / "d" / "tools" / "text_generation_cli.py").write_text("print('mine')\n")
    result = _gptrain("megatron-scripts", str(tmp_path / "d"))
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "pass --force" in result.stderr
    assert (tmp_path / "d" / "tools" / "text_generation_cli.py").read_text() == "print('mine')\n"


def test_each_script_runs_as_a_file(tmp_path):
    """`python DIR/X.py --help` (the interpreter's path starts at the script's folder, not the repository)
    reaches its gptrain command's parser."""
    from gptrain.megatron_scripts import SCRIPTS, write_scripts

    write_scripts(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for rel, command in SCRIPTS.items():
        result = subprocess.run([sys.executable, rel, "--help"], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, f"{rel}: {result.stderr}"
        assert f"usage: gptrain {command}" in result.stdout, f"{rel}: {result.stdout[:500]}"
    # a Python without gptrain (-I -S: no PYTHONPATH, no site-packages): one line saying so
    result = subprocess.run([sys.executable, "-I", "-S", "pretrain_gpt.py", "--num-layers", "2"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr == (
        f"pretrain_gpt.py: gptrain is not importable by {sys.executable} (No module named 'gptrain'): "
        "install gptrain there\n"), result.stderr


def test_server_flags_map_onto_gptrain_serve():
    from gptrain.megatron_scripts import server_argv

    flags = _flags(seed_script("001_run_text_generation_server_345M.sh"))
    argv, notes, shape = server_argv(flags)
    assert argv == ["--tensor-model-parallel-size", "1", "--load", "${CHECKPOINT}", "--vocab-file", "$VOCAB_FILE",
                    "--merge-file", "$MERGE_FILE", "--dtype", "fp16"]
    assert shape == {"--num-layers": "24", "--hidden-size": "1024", "--num-attention-heads": "16",
                     "--max-position-embeddings": "1024"}
    assert "--seq-length 1024" in notes[1] and "--seed 42" in notes[2] and "--micro-batch-size 1" in notes[2]
    assert server_argv(flags + ["--use-checkpoint-args"])[2] == {}
    assert server_argv(["--load", "c", "--bf16", "--port", "5001", "--host", "0.0.0.0"])[0] == [
        "--load", "c", "--port", "5001", "--host", "0.0.0.0", "--dtype", "bf16"]
    assert server_argv(["--load", "c", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "t"])[0] == [
        "--load", "c", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "t"]
    # gptrain train's no-op Megatron flags (flag_tables.COMPATIBILITY) are no-ops here too, its refused ones refused
    argv, notes, _ = server_argv(["--load", "c", "--use-flash-attn", "--distributed-backend", "nccl"])
    assert argv == ["--load", "c"] and "--use-flash-attn (" in notes[-2] and "--distributed-backend nccl (" in notes[-2]
    for bad, message in ((["--pipeline-model-parallel-size", "2"], "tensor parallelism only"),
                         (["--qk-layernorm"], "--qk-layernorm: not implemented"),
                         (["--tokenizer-type", "SentencePieceTokenizer"], "only GPT2BPETokenizer and HuggingFaceTokenizer"),
                         (["--top_p", "0.9", "--out-seq-length", "64"], "--top_p --out-seq-length not implemented")):
        with pytest.raises(ValueError, match=message):
            server_argv(["--load", "c", *bad])


def test_preprocess_flags_that_change_nothing_are_dropped():
    from gptrain.megatron_scripts import preprocess_argv

    base = ["--input", "a.jsonl", "--output-prefix", "p", "--workers", "4"]
    assert preprocess_argv(base) == (base, [])
    argv, notes = preprocess_argv(base + ["--partitions", "2", "--keep-sequential-samples", "--keep-newlines"])
    assert argv == base and len(notes) == 2 and "--partitions 2 --keep-sequential-samples" in notes[1]
    assert preprocess_argv(base + ["--partitions=1", "--lang", "english"])[0] == base
    with pytest.raises(ValueError, match="round-robin"):
        preprocess_argv(base + ["--partitions", "4"])
    argv, _ = preprocess_argv(base + ["--split-sentences", "--keep-newlines"])  # left for gptrain to refuse
    assert argv == base + ["--split-sentences", "--keep-newlines"]


def test_launcher_local_rank_is_dropped(monkeypatch):
    from gptrain.megatron_scripts import _drop_launcher_local_rank

    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _drop_launcher_local_rank(["--fp16", "--local-rank=1"]) == ["--fp16"]
    assert _drop_launcher_local_rank(["--local_rank", "1", "--fp16"]) == ["--fp16"]
    assert _drop_launcher_local_rank(["--local-rank=0"]) == ["--local-rank", "0"]  # not the launcher's: refused
    monkeypatch.delenv("LOCAL_RANK")
    assert _drop_launcher_local_rank(["--local-rank=0"]) == ["--local-rank=0"]


def _flags(script: str) -> list[str]:
    """The flags after the tools/ script on its launch line."""
    words = " ".join(script.replace("\\\n", " ").split("run_text_generation_server.py", 1)[1].split()).split()
    return words


# --- the seeds' scripts, run ------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TINY_SHAPE = [  # (pattern, replacement): the model's shape
    (r"--num-layers \d+", "--num-layers 2"), (r"--hidden-size \d+", "--hidden-size 64"),
    (r"--num-attention-heads \d+", "--num-attention-heads 4"), (r"--seq-length \d+", "--seq-length 64"),
    (r"--max-position-embeddings \d+", "--max-position-embeddings 64"),
]
TINY_RUN = [  # the run's length
    (r"--train-iters \d+", "--train-iters 2"), (r"--log-interval \d+", "--log-interval 1"),
    (r"--eval-iters \d+", "--eval-iters 1"), (r"--save-interval \d+", "--save-interval 2"),
]
# the batch of seeds/001 (32 samples) and seeds/003 (8): fp16 matmuls on a CPU run at about 30 tokens/s per
# process here (the 50304-row output layer), so their batches are made as small as their layouts allow
TINY_BATCH = [(r"--micro-batch-size \d+", "--micro-batch-size 1"),
              (r"--global-batch-size \d+", "--global-batch-size 4")]


def _tiny(script: str, paths: dict[str, str] = {}, tiny: list = TINY_SHAPE + TINY_RUN) -> str:
    """The seed's script with its paths (and ports) replaced and its model shape and run length made tiny
    (``tiny``); every replacement must find its text (the script did not change under the test)."""
    for old, new in paths.items():
        assert old in script, old
        script = script.replace(old, new)
    for pattern, new in tiny:
        script, n = re.subn(pattern, new, script)
        assert n, pattern
    return script


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """DIR with the scripts (written by the command), a /workspace of seeds/001 in a temporary folder
    with GPT-2's vocabulary files and a small JSONL corpus, and the environment the scripts run in:
    `python`, `python3` and `torchrun` of this interpreter first on PATH, the CPU only."""
    from gptrain.tokenizer import default_vocab_files

    tmp = tmp_path_factory.mktemp("megatron")
    megatron = tmp / "Megatron-LM"
    result = _gptrain("megatron-scripts", str(megatron))
    assert result.returncode == 0, result.stderr
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, body in {"python": f'exec {sys.executable} "$@"', "python3": f'exec {sys.executable} "$@"',
                       "torchrun": f'exec {sys.executable} -m torch.distributed.run "$@"'}.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "CUDA_DEVICE_MAX_CONNECTIONS")}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "PET_MASTER_PORT": str(_free_port())}  # torchrun's default port when a script names none (seeds/000)
    workspace = tmp / "workspace"
    vocab, merges = default_vocab_files()
    (workspace / "model" / "gpt2-vocab").mkdir(parents=True)
    shutil.copy(vocab, workspace / "model" / "gpt2-vocab" / "gpt2-vocab.json")
    shutil.copy(merges, workspace / "model" / "gpt2-vocab" / "gpt2-merges.txt")
    (workspace / "data").mkdir()
    import random

    rng = random.Random(0)
    write_jsonl(workspace / "data" / "oscar-1GB.jsonl", [random_text(rng, rng.randint(10, 60)) for _ in range(1500)])
    return {"tmp": tmp, "megatron": megatron, "env": env, "paths": {"/workspace": str(workspace)},
            "workspace": workspace}


def _bash(work, name: str, text: str, timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    path = work["tmp"] / name
    path.write_text(text)
    result = subprocess.run(["bash", str(path)], cwd=work["megatron"], env=work["env"], capture_output=True,
                            text=True, timeout=timeout, **kw)
    assert result.returncode == 0, (f"{name} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                                    f"{result.stderr[-3000:]}")
    assert "gptrain: error" not in result.stderr
    return result


@pytest.fixture(scope="module")
def seed001_data(work):
    """seeds/001's `python tools/preprocess_data.py ...` (the data seeds/000 trains on too)."""
    script = _tiny(seed_script("001_preprocess_data.sh"), work["paths"], tiny=[])
    result = _bash(work, "001_preprocess_data.sh", script, timeout=120)
    prefix = work["workspace"] / "data" / "my-gpt2_text_document"
    assert prefix.with_suffix(".bin").is_file() and prefix.with_suffix(".idx").is_file(), result.stdout
    return prefix


def _check_training(result: subprocess.CompletedProcess, checkpoint: Path) -> None:
    out = result.stdout
    assert re.search(r"^ iteration        2/       2 \| consumed samples: ", out, flags=re.M), out[-3000:]
    assert "validation loss at the end of training for val data" in out
    assert "validation loss at the end of training for test data" in out
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


@pytest.mark.slow
def test_seed000_single_gpu_script(work, seed001_data):
    """seeds/000: `torchrun pretrain_gpt.py $GPT_ARGS $DATA_ARGS $OUTPUT_ARGS --save --load`, --fp16."""
    script = _tiny(seed_script("000_pretrain_gpt.sh"), work["paths"])
    result = _bash(work, "000_pretrain_gpt.sh", script)
    _check_training(result, work["workspace"] / "model" / "megatron-models" / "345m")


@pytest.mark.slow
def test_seed001_train_serve_and_client(work, seed001_data):
    """seeds/001: 4-process data-parallel training (torchrun ${DISTRIBUTED_ARGS} pretrain_gpt.py), then its
    checkpoint served by `torchrun $DISTRIBUTED_ARGS tools/run_text_generation_server.py` and asked through
    `python tools/text_generation_cli.py`."""
    train = _tiny(seed_script("001_train_gpt2_345m_1dp1pp_distributed.sh"),
                  work["paths"] | {"MASTER_PORT=6000": f"MASTER_PORT={_free_port()}"},
                  TINY_SHAPE + TINY_RUN + TINY_BATCH)
    result = _bash(work, "001_train.sh", train)
    assert "using world size: 4, data-parallel-size: 4" in result.stdout
    _check_training(result, work["workspace"] / "model" / "megatron-models" / "345m-1dp-out")

    port = _free_port()  # Megatron's default 5000 may be taken on a shared machine: the flag is added
    server = _tiny(seed_script("001_run_text_generation_server_345M.sh"),
                   work["paths"] | {"--master_port 6000": f"--master_port {_free_port()}",
                                    "--seed 42": f"--seed 42 --port {port}"}, TINY_SHAPE)
    # the shape flags are taken from the checkpoint; made tiny all the same, as the training's
    path = work["tmp"] / "001_server.sh"
    path.write_text(server)
    log_path = work["tmp"] / "001_server.log"
    log = open(log_path, "a")
    proc = subprocess.Popen(["bash", str(path)], cwd=work["megatron"], env=work["env"], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None, f"the server exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"the server did not start:\n{log_path.read_text()[-3000:]}"
                time.sleep(0.5)
        client = _tiny(seed_script("001_text_generation_cli.sh"), {"127.0.0.1:5000": f"127.0.0.1:{port}"},
                       tiny=[])
        result = _bash(work, "001_client.sh", client, timeout=120, input="The list\n4\n")
        assert "Enter prompt: Enter number of tokens to generate: Megatron Response: \nThe list" in result.stdout
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group (start_new_session)
        proc.wait(timeout=60)
        log.close()
        server_log = log_path.read_text()
    assert "tools/run_text_generation_server.py: runs gptrain serve " in server_log, server_log
    assert ("the architecture flags match the checkpoint (--num-layers 2, --hidden-size 64, --num-attention-heads 4, "
            "--max-position-embeddings 64)") in server_log
    # the seed's own shape against the tiny checkpoint: refused before anything loads, as Megatron's load fails
    checkpoint = work["workspace"] / "model" / "megatron-models" / "345m-1dp-out"
    result = subprocess.run([sys.executable, "tools/run_text_generation_server.py", "--load", str(checkpoint),
                             "--num-layers", "24", "--hidden-size", "64"], cwd=work["megatron"], env=work["env"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr == (
        f"gptrain serve: error: tools/run_text_generation_server.py: {checkpoint} is another model: --num-layers 24 "
        "(the checkpoint: 2) (--use-checkpoint-args takes the checkpoint's)\n"), result.stderr


@pytest.mark.slow
def test_seed003_megatron_deepspeed_preprocess_and_train(work):
    """seeds/003 (Megatron-DeepSpeed): `python3 tools/preprocess_data.py --input oscar-1GB.jsonl
    --output-prefix meg-gpt2 --vocab gpt2-vocab.json ...` in DIR (`--vocab` is argparse's abbreviation of
    --vocab-file), its `mkdir data; cp ...`, then `python -m torch.distributed.launch $DISTRIBUTED_ARGS
    pretrain_gpt.py ...` (the launcher appends --local-rank=0), all with the seed's relative paths."""
    megatron = work["megatron"]
    shutil.copy(work["workspace"] / "data" / "oscar-1GB.jsonl", megatron / "oscar-1GB.jsonl")
    for name in ("gpt2-vocab.json", "gpt2-merges.txt"):
        shutil.copy(work["workspace"] / "model" / "gpt2-vocab" / name, megatron / name)
    _bash(work, "003_preprocess_data.sh", seed_script("003_preprocess_data.sh"), timeout=120)
    _bash(work, "003_copy_data.sh", seed_script("003_copy_data.sh"))
    assert (megatron / "data" / "meg-gpt2_text_document.idx").is_file()
    # Megatron's tools/merge_datasets.py --input DIR --output-prefix PREFIX over that folder (one dataset in it)
    merged = _bash(work, "merge.sh", "python tools/merge_datasets.py --input data --output-prefix meg-gpt2-merged\n")
    assert (megatron / "meg-gpt2-merged.bin").read_bytes() == (megatron / "data" / "meg-gpt2_text_document.bin"
                                                                    ).read_bytes(), merged.stdout
    script = _tiny(seed_script("003_pretrain_gpt2.sh"), {"MASTER_PORT=6000": f"MASTER_PORT={_free_port()}"},
                   TINY_SHAPE + TINY_RUN + TINY_BATCH)
    result = _bash(work, "003_pretrain_gpt2.sh", script)
    _check_training(result, megatron / "checkpoints" / "gpt2")
