"""`gptrain serve` at its edges (issue 33, defect 13), over real HTTP on loopback: JSON nested 100k
deep is one 400 and no traceback; a request that can never fit is 413/400, not 503; a request of more
rows than --max-batch runs in parts with other requests between them; a client that goes away stops
its generation; a foreign Host (DNS rebinding) is 403 and a CORS-simple body type is 415."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest

from gptrain.inference.generate import SamplingParams, generate
from gptrain.tokenizer import GPT2Tokenizer
from serve_util import call, free_port, running_server, save_hf_folder, send, tiny_gpt

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

TOK = GPT2Tokenizer()
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def model():
    return tiny_gpt()


@pytest.fixture(scope="module")
def edge_server(tmp_path_factory, model):
    where = tmp_path_factory.mktemp("edges")
    folder = save_hf_folder(model, where / "tiny-gpt2")
    log = where / "server.log"
    with running_server(folder, "--max-batch", "16", "--max-queue", "32", output=log) as base:
        yield base, log


def until(condition, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@contextlib.contextmanager
def in_process(engine, **app_kw):
    """A real uvicorn server on loopback around ``engine`` (whose generate_fn the test controls)."""
    import uvicorn

    from gptrain.serve.app import build_app

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, "edges", log=lambda s: None, **app_kw), host="127.0.0.1",
                                        port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        until(lambda: srv.started, "the server to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        engine.close()


def test_deeply_nested_json_is_one_400_and_no_traceback(edge_server):
    base, log = edge_server
    time.sleep(0.2)
    before = log.read_text()
    deep = b"[" * 100_000 + b"]" * 100_000
    for method, path in (("PUT", "/api"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
        for _ in range(3):
            status, kind, body = send(base, method, path, deep, JSON)
            assert status == 400 and kind.startswith("application/json"), (path, status, body[:200])
            assert "nested too deeply" in json.loads(body)["error"]
    # nested just under Python's limit inside a field: still a 400
    field = b'{"prompts": ["a"], "temperature": ' + b"[" * 990 + b"]" * 990 + b"}"
    status, kind, body = send(base, "PUT", "/api", field, JSON)
    assert status == 400 and kind.startswith("application/json")
    assert call("PUT", base + "/api", {"prompts": ["still serving"], "tokens_to_generate": 2, "no_log": True})[0] == 200
    time.sleep(0.3)
    added = log.read_text()[len(before):]
    assert "Traceback" not in added and added.count("\n") <= 1, added[-3000:]


def test_a_request_that_can_never_fit_is_not_503(edge_server):
    base, _ = edge_server
    status, answer = call("PUT", base + "/api", {"prompts": ["a"] * 40, "tokens_to_generate": 1})
    assert status == 413 and "40 rows" in answer["error"] and "--max-queue" in answer["error"], answer
    status, answer = call("POST", base + "/v1/completions", {"prompt": ["a"] * 9, "n": 4, "max_tokens": 1})
    assert status == 413 and "36 rows" in answer["error"] and "32" in answer["error"], answer
    # beyond the model's positions: 400 naming the context
    status, answer = call("POST", base + "/v1/completions", {"prompt": [[5] * 100] * 2, "max_tokens": 29})
    assert status == 400 and "129" in answer["error"] and "128" in answer["error"], answer
    status, answer = call("PUT", base + "/api", {"prompts": ["a"] * 32, "tokens_to_generate": 1})
    assert status == 200 and len(answer["text"]) == 32  # the whole capacity is fine


def local_greedy(model, prompt: str, n: int) -> list[int]:
    return generate(model, [TOK.encode(prompt)], SamplingParams(max_new_tokens=n, temperature=0.0,
                                                                stop_ids=(TOK.eod,)))[0].tokens


def test_a_large_request_runs_in_parts_of_max_batch(model):
    from gptrain.serve.engine import Engine

    batches: list[list[list[int]]] = []
    release = threading.Event()

    def recorded(m, prompts, params, **kw):
        batches.append([list(p) for p in prompts])
        if len(batches) == 1:
            release.wait(120)
        return generate(m, prompts, params, **kw)

    engine = Engine(model, TOK, max_batch=2, max_queue=16, generate_fn=recorded)
    prompts = [f"Prompt number {i} is" for i in range(5)]
    with in_process(engine) as base, ThreadPoolExecutor(3) as pool:
        hold = pool.submit(call, "PUT", base + "/api", {"prompts": ["Hold"], "tokens_to_generate": 2}, 120)
        until(lambda: engine.busy, "the first request to run")
        big = pool.submit(call, "PUT", base + "/api", {"prompts": prompts, "tokens_to_generate": 6, "top_k": 1}, 120)
        until(lambda: engine._waiting == 5, "the large request to queue")
        small = pool.submit(call, "PUT", base + "/api", {"prompts": ["Small one"], "tokens_to_generate": 3,
                                                         "top_k": 1}, 120)
        until(lambda: engine._waiting == 6, "the small request to queue")
        release.set()
        assert hold.result(120)[0] == 200
        status, answer = big.result(120)
        assert small.result(120)[0] == 200
    assert status == 200
    assert [len(b) for b in batches] and max(len(b) for b in batches) <= 2, [len(b) for b in batches]
    assert answer["tokens"] == [local_greedy(model, p, 6) for p in prompts]
    small_at = next(i for i, b in enumerate(batches) if TOK.encode("Small one") in b)
    big_last = max(i for i, b in enumerate(batches) if TOK.encode(prompts[-1]) in b)
    assert small_at < big_last  # the small request did not wait for the whole large one


def _hang_up_later(base: str, body: dict) -> socket.socket:
    """A client that sends its request and (when the test closes the socket) goes away unanswered."""
    port = urlparse(base).port
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"PUT /api HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_a_client_that_goes_away_frees_its_slot(model):
    from gptrain.serve.engine import Engine

    made: list[list] = []  # per batch: its first prompt, tokens made

    def slow(m, prompts, params, on_token=None, **kw):  # 0.1 s a token, no stop token
        made.append([list(prompts[0]), 0])
        params = [dataclasses.replace(p, stop_ids=()) for p in params]

        def hook(row, token):
            time.sleep(0.1)
            made[-1][1] += 1
            return on_token(row, token) if on_token is not None else None

        return generate(m, prompts, params, on_token=hook, **kw)

    engine = Engine(model, TOK, max_batch=1, max_queue=8, generate_fn=slow)
    with in_process(engine) as base:
        running = _hang_up_later(base, {"prompts": ["Going away"], "tokens_to_generate": 100})
        until(lambda: engine.busy, "the first request to run")
        queued = _hang_up_later(base, {"prompts": ["Queued then gone"], "tokens_to_generate": 100})
        until(lambda: engine._waiting == 1, "the second request to queue")
        time.sleep(0.3)
        running.close()
        queued.close()
        time.sleep(1.0)  # both noticed (each waiting request checks every 0.2 s)
        start = time.monotonic()
        status, answer = call("PUT", base + "/api", {"prompts": ["Next"], "tokens_to_generate": 2}, 60)
        elapsed = time.monotonic() - start
    assert status == 200 and len(answer["tokens"][0]) == len(TOK.encode("Next")) + 2
    assert elapsed < 4, f"the next request waited {elapsed:.1f} s (the abandoned one needs 10 s)"
    assert made[0][0] == TOK.encode("Going away") and made[0][1] < 100
    assert TOK.encode("Queued then gone") not in [m[0] for m in made]  # dropped before it ran


def test_foreign_host_and_cors_simple_bodies_are_refused(edge_server):
    base, _ = edge_server
    port = urlparse(base).port
    body = json.dumps({"prompts": ["a"], "tokens_to_generate": 1}).encode()
    for host in (f"evil.example:{port}", "attacker.test", f"localhost.evil.example:{port}"):
        for method, path, data in (("PUT", "/api", body), ("GET", "/", None), ("GET", "/health", None)):
            status, kind, answer = send(base, method, path, data, {**JSON, "Host": host})
            assert status == 403 and kind.startswith("application/json"), (host, path, status)
            assert "Host" in json.loads(answer)["error"] and "--allowed-hosts" in json.loads(answer)["error"]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", f"LocalHost.:{port}",
                 f"app.localhost:{port}", f"10.1.2.3:{port}"):
        status, _, answer = send(base, "PUT", "/api", body, {**JSON, "Host": host})
        assert status == 200, (host, answer)
    for kind in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", None):
        headers = {} if kind is None else {"Content-Type": kind}
        for method, path in (("PUT", "/api"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
            status, _, answer = send(base, method, path, body, headers)
            assert status == 415 and "application/json" in json.loads(answer)["error"], (kind, path, status)
    status, _, answer = send(base, "PUT", "/api", body, {"Content-Type": "Application/JSON; charset=UTF-8"})
    assert status == 200, answer
    # the playground page is served and posts JSON to its own origin
    status, kind, page = send(base, "GET", "/", None, {"Host": f"localhost:{port}"})
    assert status == 200 and kind.startswith("text/html")
    assert b'fetch("/v1/completions"' in page and b'"Content-Type": "application/json"' in page


def test_allowed_hosts_adds_names(model):
    from gptrain.serve.engine import Engine

    engine = Engine(model, TOK, max_batch=2, max_queue=4)
    with in_process(engine, host="0.0.0.0", allowed_hosts=["gpu-box.example"]) as base:
        assert send(base, "GET", "/health", None, {"Host": "gpu-box.example:5000"})[0] == 200
        assert send(base, "GET", "/health", None, {"Host": "other.example:5000"})[0] == 403
