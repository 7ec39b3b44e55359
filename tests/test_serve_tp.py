"""Tensor-parallel serving on 2 gloo processes under torchrun (as Megatron serves): the TP2 server
answers PUT /api and /v1/completions with the 1-process server's text and log-probabilities, seeded
sampling and concurrent requests included; it stops cleanly on SIGTERM/SIGINT; bad layouts are
one-line errors. ``gptrain generate`` under TP2 equals transformers' greedy ``generate``."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gptrain.tokenizer import GPT2Tokenizer
from serve_util import call, free_port, get_json, running_server, save_hf_folder, tiny_gpt

pytest.importorskip("fastapi")

TOK = GPT2Tokenizer()


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _torchrun(nproc: int, *argv: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "gptrain", *argv]


class TPServer:
    """``torchrun --nproc-per-node 2 -m gptrain serve ... --tensor-model-parallel-size 2`` on a free
    loopback port; its output collected by a thread."""

    def __init__(self, load: Path, *extra: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(_torchrun(2, "serve", "--load", str(load), "--port", str(self.port),
                                               "--device", "cpu", "--tensor-model-parallel-size", "2", *extra),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(),
                                     start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, b"")),
                                        daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return b"".join(self.lines).decode(errors="replace")

    def wait_ready(self, wait_s: float = 120) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"TP server exited {self.proc.returncode}: {self.output[-3000:]}")
            try:
                get_json(self.base + "/health", timeout=2)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"TP server did not answer within {wait_s} s: {self.output[-3000:]}") from None
                time.sleep(0.2)

    def rank_pid(self, rank: int) -> int:
        """The pid of a worker (torchrun's child whose RANK is ``rank``)."""
        children = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            children += (task / "children").read_text().split()
        for pid in children:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env:
                return int(pid)
        raise LookupError(f"no worker of rank {rank} among {children}")

    def wait(self, timeout: float = 60) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
                for rank in (0, 1):  # the workers run in sessions of their own
                    with contextlib.suppress(LookupError, OSError):
                        os.kill(self.rank_pid(rank), signal.SIGKILL)
            self.proc.wait(timeout=30)


@contextlib.contextmanager
def tp_server(load: Path, *extra: str):
    server = TPServer(load, *extra)
    try:
        server.wait_ready()
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A gptrain (DCP) checkpoint of a tiny GPT-2 with 4 heads: read sharded at TP2."""
    from gptrain.train.checkpoint import save_checkpoint

    model = tiny_gpt()
    params = dict(model.named_parameters())
    state = {"config": {"model": dataclasses.asdict(model.cfg), "data": {"vocab_file": None}}}
    root = tmp_path_factory.mktemp("tp") / "tiny-ckpt"
    save_checkpoint(root, 3, params, None, state, model.cfg.vocab_size)
    return root


@pytest.fixture(scope="module")
def servers(checkpoint):
    """(1-process server, TP2 server) on the same checkpoint, started together."""
    tp = TPServer(checkpoint)
    try:
        with running_server(checkpoint) as one:
            tp.wait_ready()
            assert "tensor-parallel over 2 ranks" in tp.output
            yield one, tp.base
    finally:
        if tp.proc.poll() is None:
            tp.proc.send_signal(signal.SIGTERM)
            try:
                tp.wait(timeout=60)
            except subprocess.TimeoutExpired:
                tp.kill()


def _both(servers, method: str, path: str, body: dict):
    one, tp = servers
    a, b = call(method, one + path, body), call(method, tp + path, body)
    assert a[0] == b[0] == 200, (a, b)
    return a[1], b[1]


def _close(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is y
        else:
            assert abs(x - y) <= 1e-5, (a, b)


def test_megatron_api_equals_one_process(servers):
    body = {"prompts": ["The list", "Hello there, world", "A: b\nC:"], "tokens_to_generate": 12, "top_k": 1,
            "logprobs": True}
    one, tp = _both(servers, "PUT", "/api", body)
    assert tp["text"] == one["text"] and tp["tokens"] == one["tokens"] and tp["segments"] == one["segments"]
    for a, b in zip(one["logprobs"], tp["logprobs"]):
        _close(a, b)
    # every per-row rule crosses to the other rank: the stop token, eol stops, no newline after a colon
    stop = one["tokens"][0][len(TOK.encode("The list")) + 2]
    for extra in ({"stop_token": stop}, {"stop_on_eol": True, "prevent_newline_after_colon": True},
                  {"stop_on_double_eol": True, "add_BOS": True}, {"tokens_to_generate": 0}):
        one, tp = _both(servers, "PUT", "/api", {**body, **extra})
        assert tp["tokens"] == one["tokens"], extra
        for a, b in zip(one["logprobs"], tp["logprobs"]):
            _close(a, b)


def test_completions_equal_one_process(servers):
    ids = TOK.encode("The quick brown fox")
    for body in ({"prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0, "logprobs": 3},
                 {"prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0},  # lm-eval's
                 {"prompt": ["Once upon", "Two"], "max_tokens": 9, "n": 2, "seed": 11, "temperature": 0.9,
                  "top_p": 0.8, "logprobs": 2}):
        one, tp = _both(servers, "POST", "/v1/completions", body)
        assert [c["text"] for c in tp["choices"]] == [c["text"] for c in one["choices"]], body
        assert [c["finish_reason"] for c in tp["choices"]] == [c["finish_reason"] for c in one["choices"]]
        assert tp["usage"] == one["usage"]
        for a, b in zip(one["choices"], tp["choices"]):
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
            _close(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"])
            for ta, tb in zip(a["logprobs"]["top_logprobs"], b["logprobs"]["top_logprobs"]):
                assert (ta is None) == (tb is None)
                if ta is not None:
                    assert set(ta) == set(tb)
                    _close([ta[k] for k in sorted(ta)], [tb[k] for k in sorted(ta)])
    # a stop string ends the row on rank 0 only (its stream hook): the ranks must stop together,
    # and the next request still comes out right
    free = _both(servers, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 12, "temperature": 0})[0]
    text = free["choices"][0]["text"]
    cut = _both(servers, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 12, "temperature": 0,
                                                     "stop": [text[4:7]], "stream": False})
    assert cut[0] == {**cut[1], "id": cut[0]["id"], "created": cut[0]["created"]}
    one, tp = _both(servers, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 12, "temperature": 0})
    assert tp["choices"][0]["text"] == text


def test_sampling_with_a_seed_equals_one_process(servers):
    body = {"prompts": ["Once upon a time", "x"], "tokens_to_generate": 16, "random_seed": 1234,
            "temperature": 0.9, "top_p": 0.9}
    one, tp = _both(servers, "PUT", "/api", body)
    assert tp["text"] == one["text"]
    other = call("PUT", servers[1] + "/api", {**body, "random_seed": 1235})[1]
    assert other["text"] != tp["text"]  # the seed matters
    for extra in ({"top_p": 0.0, "top_k": 40, "temperature": 1.3}, {"top_p_decay": 0.5, "top_p_bound": 0.3}):
        one, tp = _both(servers, "PUT", "/api", {**body, **extra})
        assert tp["text"] == one["text"], extra


def test_concurrent_requests(servers):
    from concurrent.futures import ThreadPoolExecutor

    one, tp = servers
    bodies = [{"prompts": [f"Request {i} says"], "tokens_to_generate": 8 + 3 * i, "random_seed": i, "top_p": 0.9}
              for i in range(4)]
    alone = [call("PUT", one + "/api", b)[1]["tokens"] for b in bodies]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda b: call("PUT", tp + "/api", b)[1]["tokens"], bodies))
    assert together == alone


@pytest.mark.slow
def test_stops_cleanly_on_signals(checkpoint):
    """SIGTERM to rank 0: every rank exits 0, so torchrun does. SIGINT to torchrun (Ctrl-C): torchrun
    signals the workers; both say they stopped and nothing is left running."""
    with tp_server(checkpoint) as server:
        assert call("PUT", server.base + "/api", {"prompts": ["a"], "tokens_to_generate": 2})[0] == 200
        os.kill(server.rank_pid(0), signal.SIGTERM)
        assert server.wait(timeout=60) == 0, server.output[-3000:]
        assert "gptrain serve: stopped" in server.output
        assert "gptrain serve: rank 1: stopped after 1 batches" in server.output
    with tp_server(checkpoint) as server:
        workers = [server.rank_pid(0), server.rank_pid(1)]
        server.proc.send_signal(signal.SIGINT)
        server.wait(timeout=60)
        out = server.output
        assert "gptrain serve: stopped" in out and "gptrain serve: rank 1: stopped after 0 batches" in out, out[-3000:]
        # the one traceback is torchrun's own (it re-raises the signal it got); no worker's
        assert out.count("Traceback (most recent call last)") == 1 and "SignalException" in out, out[-3000:]
        assert "KeyboardInterrupt" not in out
        for pid in workers:
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _generate(nproc: int, load: Path, *extra: str):
    argv = ["generate", "--load", str(load), "--device", "cpu", *extra]
    cmd = _torchrun(nproc, *argv) if nproc else [sys.executable, "-m", "gptrain", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())


@pytest.mark.slow
def test_generate_tp2_equals_transformers(tmp_path):
    """The HF-folder path (read whole, then cut): TP2 greedy text is transformers' greedy text."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = save_hf_folder(tiny_gpt(), tmp_path / "hf")
    prompt = "The meaning of life is"
    done = _generate(2, folder, "--prompt", prompt, "--greedy", "--tokens-to-generate", "12",
                     "--tensor-model-parallel-size", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    ids = torch.tensor([TOK.encode(prompt)])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=TOK.eod, eos_token_id=None)
    assert done.stdout == TOK.decode(out[0].tolist()) + "\n"  # rank 0 writes, once


@pytest.mark.slow
def test_bad_layouts_are_one_line_errors(tmp_path, checkpoint):
    # heads that do not divide: a 3-head model at TP2, the ranks say so and the run fails
    from gptrain.model.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(num_layers=1, hidden_size=24, num_attention_heads=3, seq_length=16, vocab_size=50257,
                          hidden_dropout=0.0, attention_dropout=0.0))
    model.init_weights(1)
    folder = save_hf_folder(model, tmp_path / "three")
    done = _generate(2, folder, "--prompt", "x", "--tensor-model-parallel-size", "2")
    assert done.returncode != 0
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.startswith("gptrain generate: error:")]
    # torchrun stops the other rank once one fails, so the second rank's line may or may not come
    assert 1 <= len(lines) <= 2, done.stderr[-3000:]
    assert set(lines) == {"gptrain generate: error: --tensor-model-parallel-size 2: the model's 3 attention heads "
                          "are not divisible by it"}, done.stderr[-3000:]
    assert done.stderr.count("Traceback (most recent call last)") == 1  # torchrun's ChildFailedError; no rank's
    # tensor parallelism without torchrun's processes
    done = subprocess.run([sys.executable, "-m", "gptrain", "serve", "--load", str(checkpoint), "--device", "cpu",
                           "--tensor-model-parallel-size", "2"], capture_output=True, text=True, timeout=60, env=_env())
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "--tensor-model-parallel-size 2 needs 2 processes (torchrun --nproc-per-node 2); this run has 1" in done.stderr



def test_a_batch_that_cannot_be_packed_fails_before_anything_is_sent():
    """Rank 0 builds the whole message before its first broadcast: a bad value is the request's own
    error, and the other ranks, never told of the batch, stay in step (no exit)."""
    import torch

    from gptrain.inference.generate import EolIds, SamplingParams
    from gptrain.serve.tensor_parallel import LeaderGenerate, Work, WorkChannel

    sent: list = []
    channel = object.__new__(WorkChannel)
    channel.send = sent.append
    leader = object.__new__(LeaderGenerate)
    leader.channel, leader.sync, leader.device = channel, None, torch.device("cpu")
    good = SamplingParams(max_new_tokens=2, stop_ids=(7,))
    bad = dataclasses.replace(good, top_p="high")
    with pytest.raises(ValueError, match="could not convert"):
        leader(tiny_gpt(), [[1, 2], [3]], [good, bad])
    assert sent == []
    header, ints, floats = WorkChannel.pack(Work([[1, 2], [3]], [good, good], False, 0, EolIds(), [False, True]))
    # kind WORK, 2 rows, 3 prompt tokens, 2 stop ids; lengths, 6 settings per row, stop counts, ids
    assert header.tolist()[:4] == [1, 2, 3, 2]
    assert len(ints) == 2 + 2 * 6 + 2 + 3 + 2 and len(floats) == 2 * 4
