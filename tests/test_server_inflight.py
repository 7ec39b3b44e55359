"""In-flight batching (serve/inflight.py, inference/slots.py) on CPU: seeded requests sent while a
long one decodes join its batch, end before it and give the text they give alone (also across the
step counter's fold at the window, and with prompts prefilled in pieces); a stream whose client goes
away frees its slot; --request-timeout is 504 and counted in /metrics; a full queue is 503 with
Retry-After."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

import pytest
import torch

from gptrain.inference.generate import SamplingParams, generate
from gptrain.serve.engine import Job
from gptrain.tokenizer import GPT2Tokenizer
from serve_util import call, send, tiny_gpt
from test_server_edges import in_process, until

pytest.importorskip("fastapi")
parser = pytest.importorskip("prometheus_client.parser")

TOK = GPT2Tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_gpt()


def engine_for(model, **kw):
    from gptrain.serve.inflight import InflightEngine

    return InflightEngine(model, TOK, **{"max_batch": 4, "max_queue": 16, **kw})


def slowed(engine, seconds: float):
    """Each decode step of ``engine`` takes at least ``seconds`` (a long request stays running)."""
    step = engine.decoder.step

    def slow(*args, **kw):
        time.sleep(seconds)
        return step(*args, **kw)

    engine.decoder.step = slow
    return engine


def seeded(prompt: str, n: int, seed: int, on_token=None) -> Job:
    return Job(prompts=[TOK.encode(prompt)], params=[SamplingParams(max_new_tokens=n, seed=seed, top_p=0.9)],
               on_token=on_token)


@pytest.mark.slow  # about 3 s on CPU
def test_requests_join_the_running_batch_and_keep_their_text(model):
    engine = engine_for(model, chunk=4)  # prompts of more than 4 tokens go in as pieces
    prompts = [f"Request number {i} says that" for i in range(3)]
    try:
        alone = [engine.submit(seeded(p, 8, i)).result(60)[0].tokens for i, p in enumerate(prompts)]
        long_alone = engine.submit(seeded("Long one", 60, 7)).result(60)[0].tokens  # steps 24 .. 84
        started = threading.Event()

        def paced(row, token):
            started.set()
            time.sleep(0.004)

        long = engine.submit(seeded("Long one", 60, 7, on_token=paced))  # across the fold at step 128
        assert started.wait(60)
        short = [engine.submit(seeded(p, 8, i)) for i, p in enumerate(prompts)]
        joined = [f.result(60)[0].tokens for f in short]
        assert not long.done()  # they joined its batch and ended before it
        assert long.result(60)[0].tokens == long_alone
    finally:
        engine.close()
    assert joined == alone
    assert engine.decoder.base > 0  # the step counter was folded while the long request ran
    reference = [generate(model, [TOK.encode(p)], SamplingParams(max_new_tokens=8, seed=i, top_p=0.9))[0].tokens
                 for i, p in enumerate(prompts)]
    assert alone == reference


def test_a_stream_that_goes_away_frees_its_slot(model):
    engine = slowed(engine_for(model, max_batch=1), 0.02)
    with in_process(engine) as base:
        port = urlparse(base).port
        req = urllib.request.Request(base + "/v1/completions", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": "Going away", "max_tokens": 100, "stream": True,
                                                      "seed": 1, "stop": []}).encode())
        stream = urllib.request.urlopen(req, timeout=30)
        until(lambda: engine._slot_rows[0] is not None, "the stream to take the slot")
        stream.read(1)
        stream.close()  # the client goes away mid-stream
        until(lambda: engine._slot_rows[0] is None and not engine._tasks, "the slot to be freed", 30)
        begin = time.monotonic()
        status, answer = call("PUT", base + "/api", {"prompts": ["Next"], "tokens_to_generate": 2}, 60)
        assert status == 200 and len(answer["tokens"][0]) == len(TOK.encode("Next")) + 2
        assert time.monotonic() - begin < 2 and port


def scrape(base: str) -> dict:
    status, _, body = send(base, "GET", "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(body.decode()) for s in family.samples}


def test_timeout_is_504_counted_and_frees_the_slot(model):
    engine = slowed(engine_for(model, max_batch=1, request_timeout=0.5), 0.02)
    with in_process(engine) as base:
        status, answer = call("PUT", base + "/api", {"prompts": ["Too long"], "tokens_to_generate": 100}, 60)
        assert status == 504 and "--request-timeout" in answer["error"], answer
        status, _ = call("PUT", base + "/api", {"prompts": ["Short"], "tokens_to_generate": 3}, 60)
        assert status == 200
        samples = scrape(base)
    count = lambda outcome: samples.get(("gptrain_requests_total", (("endpoint", "/api"), ("outcome", outcome))), 0)
    assert count("timeout") == 1 and count("ok") == 1
    assert samples[("gptrain_generated_tokens_total", ())] >= 3
    # two prompts joined; every step ran the one live row; the host waited on the device (time > 0)
    assert samples[("gptrain_prompt_joins_total", ())] == 2
    steps = samples[("gptrain_decode_steps_total", ())]
    assert steps >= samples[("gptrain_generated_tokens_total", ())] and samples[("gptrain_decode_rows_total", ())] == steps
    assert samples[("gptrain_device_wait_seconds_total", ())] >= 0
    phases = {dict(labels)["phase"]: v for (name, labels), v in samples.items() if name == "gptrain_loop_seconds_total"}
    assert set(phases) == {"idle", "take", "admit", "issue", "wait", "tokens"} and phases["tokens"] > 0, phases


def test_a_full_queue_is_503_with_retry_after(model):
    engine = slowed(engine_for(model, max_batch=1, max_queue=1), 0.02)
    body = json.dumps({"prompts": ["Wait"], "tokens_to_generate": 12}).encode()
    with in_process(engine) as base:
        results = []

        def put():
            results.append(call("PUT", base + "/api", json.loads(body), 60)[0])

        threads = [threading.Thread(target=put) for _ in range(2)]
        threads[0].start()
        until(lambda: engine._slot_rows[0] is not None, "the first request to take the slot")
        threads[1].start()
        until(lambda: engine._waiting == 1, "the second request to queue")
        req = urllib.request.Request(base + "/api", method="PUT", data=body,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"
        assert "queue" in json.loads(refused.value.read())["error"]
        for t in threads:
            t.join(60)
    assert results == [200, 200]


def test_the_background_warm_up_runs_between_requests(model):
    """Captures run one at a time on the worker thread, never while a request runs; a request sent
    during the warm-up is answered (with its own text) before the warm-up ends; one line at the end."""
    engine = engine_for(model)
    seen, lines = [], []

    def capture(i):
        seen.append((i, threading.current_thread().name, len(engine._tasks)))
        time.sleep(0.05)

    engine.decoder.warm_up_steps = lambda: [lambda i=i: capture(i) for i in range(30)]
    try:
        alone = engine.submit(seeded("Sent before", 6, 3)).result(60)[0].tokens
        assert engine.warm_up_in_background(lines.append) == 30
        assert engine.warming > 0
        during = engine.submit(seeded("Sent before", 6, 3)).result(60)[0].tokens
        assert engine.warming > 0  # answered while captures were still to come
        until(lambda: not engine.warming, "the warm-up", 30)
        until(lambda: lines, "its line", 5)
    finally:
        engine.close()
    assert during == alone
    assert [i for i, _, _ in seen] == list(range(30))
    assert {name for _, name, _ in seen} == {"gptrain-generate"} and not any(tasks for _, _, tasks in seen)
    assert len(lines) == 1 and "captured in the background" in lines[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU lane)")
def test_the_background_warm_up_captures_every_graph_on_cuda(model):
    import copy

    cuda = copy.deepcopy(model).to("cuda")
    ahead = engine_for(cuda)
    try:
        ahead.warm_up()
        graphs = ahead.decoder.rows.stats["graphs"]
        alone = ahead.submit(seeded("Sent first", 12, 5)).result(120)[0].tokens
    finally:
        ahead.close()
    engine, lines = engine_for(cuda), []
    try:
        assert engine.warm_up_in_background(lines.append) > 0
        during = engine.submit(seeded("Sent first", 12, 5)).result(120)[0].tokens
        until(lambda: not engine.warming, "the warm-up", 120)
        until(lambda: lines, "its line", 5)
        assert engine.decoder.rows.stats["graphs"] == graphs
        after = engine.submit(seeded("Sent first", 12, 5)).result(120)[0].tokens
    finally:
        engine.close()
    assert during == alone and after == alone
    assert "captured in the background" in lines[0]


def test_a_failed_background_warm_up_is_reported_and_serving_goes_on(model):
    """A capture that fails ends the warm-up with one report carrying the error (the graphs left are
    captured on first use); requests are answered as before."""
    engine = engine_for(model)
    lines = []

    def broken():
        raise RuntimeError("capture failed here")

    engine.decoder.warm_up_steps = lambda: [lambda: None, broken, lambda: None]
    try:
        alone = engine.submit(seeded("After a failure", 6, 9)).result(60)[0].tokens
        engine.warm_up_in_background(lines.append)
        until(lambda: lines, "the warm-up's line", 30)
        assert engine.warming == 0
        again = engine.submit(seeded("After a failure", 6, 9)).result(60)[0].tokens
    finally:
        engine.close()
    assert again == alone
    assert len(lines) == 1 and "stopped with 2 left" in lines[0] and "capture failed here" in lines[0]
