"""Helpers for the server tests: a tiny GPT-2 saved as a HF folder, and `gptrain serve` on a free
loopback port (bounded waits; the process is always ended)."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from gptrain.model.gpt import GPT
from tiny import tiny_config


def tiny_gpt(positions: int = 128, seed: int = 11, std: float = 0.2) -> GPT:
    cfg = tiny_config(ffn_hidden_size=128, seq_length=positions, vocab_size=50257, init_method_std=std)
    model = GPT(cfg)
    model.init_weights(seed)
    return model.eval()


def save_hf_folder(model: GPT, folder: Path) -> Path:
    import transformers

    from gptrain.interop.hf import hf_config_kwargs, to_hf_state_dict

    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_config_kwargs(model.cfg))).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=False)
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def call(method: str, url: str, body=None, timeout: float = 60, raw: bytes | None = None):
    """(status, parsed JSON) of one request; HTTP errors are returned, not raised."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def send(base: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
         timeout: float = 60) -> tuple[int, str, bytes]:
    """(status, Content-Type, body) of one request with exactly these headers (http.client)."""
    import http.client
    from urllib.parse import urlparse

    where = urlparse(base)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_host="Host" in (headers or {}))
        for k, v in {**({} if body is None else {"Content-Length": str(len(body))}), **(headers or {})}.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


@contextlib.contextmanager
def running_server(load: Path, *extra: str, wait_s: float = 120, output: Path | None = None):
    """``output``: a file that receives the server's stdout and stderr (else they go to a pipe)."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    sink = open(output, "wb") if output is not None else subprocess.PIPE
    proc = subprocess.Popen([sys.executable, "-m", "gptrain", "serve", "--load", str(load), "--port", str(port),
                             "--device", "cpu", *extra], stdout=sink, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + wait_s
        while True:
            if proc.poll() is not None:
                said = proc.stdout.read().decode() if output is None else Path(output).read_text()
                raise RuntimeError(f"gptrain serve exited {proc.returncode}: {said[-2000:]}")
            try:
                get_json(base + "/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gptrain serve did not answer within {wait_s} s") from None
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        if output is not None:
            sink.close()
