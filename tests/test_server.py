"""`gptrain serve` over HTTP on loopback: Megatron's PUT /api contract (every bad field is a 400
naming it), OpenAI's /v1/completions (text and token-id prompts, n, seed, stop, echo + logprobs,
SSE streaming), the tokenizer endpoints, concurrent requests, and the limits (413, 503)."""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gptrain.inference.generate import SamplingParams, generate
from gptrain.tokenizer import GPT2Tokenizer
from serve_util import call, get_json, running_server, save_hf_folder, tiny_gpt

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

TOK = GPT2Tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_gpt()


@pytest.fixture(scope="module")
def server(tmp_path_factory, model):
    folder = save_hf_folder(model, tmp_path_factory.mktemp("srv") / "tiny-gpt2")
    with running_server(folder, "--max-batch", "16") as base:
        yield base


def local(model, prompt: str, n: int, **kw):
    return generate(model, [TOK.encode(prompt)], SamplingParams(max_new_tokens=n, stop_ids=(TOK.eod,), **kw))[0]


BAD = [
    ({}, "prompts"),
    ({"prompts": "hi"}, "prompts"),
    ({"prompts": []}, "prompts"),
    ({"prompts": ["a"] * 129}, "prompts"),
    ({"prompts": [""]}, "add_BOS"),
    ({"prompts": ["a"], "tokens_to_generate": -1}, "tokens_to_generate"),
    ({"prompts": ["a"], "tokens_to_generate": 2.5}, "tokens_to_generate"),
    ({"prompts": ["a"], "logprobs": "yes"}, "logprobs"),
    ({"prompts": ["a"], "temperature": 0}, "temperature"),
    ({"prompts": ["a"], "temperature": 100.5}, "temperature"),
    ({"prompts": ["a"], "top_k": 1001}, "top_k"),
    ({"prompts": ["a"], "top_k": -1}, "top_k"),
    ({"prompts": ["a"], "top_p": 1.5}, "top_p"),
    ({"prompts": ["a"], "top_p": 0.5, "top_k": 5}, "top_p"),
    ({"prompts": ["a"], "top_p_decay": 0.5}, "top_p_decay"),
    ({"prompts": ["a"], "top_p": 0.5, "top_p_bound": 0.9}, "top_p_bound"),
    ({"prompts": ["a"], "add_BOS": 1}, "add_BOS"),
    ({"prompts": ["a"], "stop_on_eol": "true"}, "stop_on_eol"),
    ({"prompts": ["a"], "stop_on_double_eol": 0}, "stop_on_double_eol"),
    ({"prompts": ["a"], "prevent_newline_after_colon": None}, "prevent_newline_after_colon"),
    ({"prompts": ["a"], "random_seed": -5}, "random_seed"),
    ({"prompts": ["a"], "random_seed": "1"}, "random_seed"),
    ({"prompts": ["a"], "stop_token": 60000}, "stop_token"),
    ({"prompts": ["a"], "beam_width": 2}, "beam_width"),
    ({"prompts": ["a"], "no_log": "no"}, "no_log"),
    ({"prompts": ["a"], "max_len": 5}, "max_len"),
    ({"prompts": ["a"], "sentences": ["a"]}, "sentences"),
    ({"prompts": ["a"], "bogus": 1}, "bogus"),
    ({"prompts": ["a"], "tokens_to_generate": 200}, "128"),
]


def test_megatron_api_rejects_each_bad_field(server):
    for body, field in BAD:
        status, answer = call("PUT", server + "/api", body)
        assert status == 400, (body, answer)
        assert set(answer) == {"error"} and field in answer["error"], (body, answer)
    status, answer = call("PUT", server + "/api", raw=b"{not json")
    assert status == 400 and "JSON" in answer["error"]
    # a body over the limit is refused from its Content-Length, before it is read
    import http.client
    from urllib.parse import urlparse

    conn = http.client.HTTPConnection(urlparse(server).hostname, urlparse(server).port, timeout=30)
    conn.putrequest("PUT", "/api")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(2 << 20))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413 and "exceeds the limit" in json.loads(resp.read())["error"]
    conn.close()
    status, _ = call("POST", server + "/api", {"prompts": ["a"]})
    assert status == 405
    status, answer = call("PUT", server + "/api", {"prompts": ["a b c"], "tokens_to_generate": 126})
    assert status == 400 and "3 tokens" in answer["error"] and "126" in answer["error"] and "128" in answer["error"]


def test_megatron_api_generates(server, model):
    status, answer = call("PUT", server + "/api", {"prompts": ["The list", "Hello there, world"],
                                                   "tokens_to_generate": 12, "top_k": 1, "logprobs": True})
    assert status == 200 and set(answer) == {"text", "segments", "logprobs", "tokens"}
    for i, prompt in enumerate(["The list", "Hello there, world"]):
        ref = local(model, prompt, 12, temperature=0.0)
        assert answer["tokens"][i] == ref.tokens
        assert answer["text"][i] == TOK.decode(ref.tokens) and answer["text"][i].startswith(prompt)
        assert answer["segments"][i] == [TOK.decode([t]) for t in ref.tokens]
        assert len(answer["logprobs"][i]) == len(ref.tokens) - 1
        with torch.no_grad():
            lp = torch.log_softmax(model.logits(torch.tensor([ref.tokens])), dim=-1)[0]
        expected = [lp[j - 1, ref.tokens[j]].item() for j in range(1, len(ref.tokens))]
        assert answer["logprobs"][i] == pytest.approx(expected, abs=1e-4)
    # random_seed: reproducible, and it matters
    body = {"prompts": ["Once upon a time"], "tokens_to_generate": 10, "random_seed": 7, "top_p": 0.9}
    first, second = call("PUT", server + "/api", body)[1], call("PUT", server + "/api", body)[1]
    other = call("PUT", server + "/api", {**body, "random_seed": 8})[1]
    assert first["tokens"] == second["tokens"] != other["tokens"]
    assert first["logprobs"] is None
    # add_BOS puts <|endoftext|> first; an empty prompt then works
    bos = call("PUT", server + "/api", {"prompts": ["", "x"], "add_BOS": True, "tokens_to_generate": 3, "top_k": 1})[1]
    assert [t[0] for t in bos["tokens"]] == [TOK.eod, TOK.eod]
    # stop_token takes effect (the token the greedy continuation reaches third)
    free = local(model, "The list", 12, temperature=0.0).generated
    stopped = call("PUT", server + "/api", {"prompts": ["The list"], "tokens_to_generate": 12, "top_k": 1,
                                            "stop_token": free[2]})[1]
    assert stopped["tokens"][0][len(TOK.encode("The list")):] == free[: free.index(free[2]) + 1]
    # tokens_to_generate 0 scores the prompt
    scored = call("PUT", server + "/api", {"prompts": ["a b c d"], "tokens_to_generate": 0, "logprobs": True})[1]
    assert scored["tokens"][0] == TOK.encode("a b c d") and len(scored["logprobs"][0]) == 3


def test_openai_completions(server, model):
    prompt = "The quick brown fox"
    status, answer = call("POST", server + "/v1/completions",
                          {"model": "x", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert status == 200 and answer["object"] == "text_completion"
    ref = local(model, prompt, 8, temperature=0.0)
    eod_cut = ref.generated[:-1] if ref.finish_reason == "stop" else ref.generated
    assert answer["choices"][0]["text"] == TOK.decode(eod_cut)
    assert answer["choices"][0]["finish_reason"] == ref.finish_reason
    assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": len(eod_cut), "total_tokens": 4 + len(eod_cut)}
    # token-id prompts, several prompts, n, seed
    ids = TOK.encode(prompt)
    body = {"prompt": [ids, "Hello"], "max_tokens": 6, "n": 2, "seed": 3, "temperature": 1.0}
    a, b = call("POST", server + "/v1/completions", body)[1], call("POST", server + "/v1/completions", body)[1]
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2, 3]
    assert a["usage"]["prompt_tokens"] == len(ids) + 1
    # echo + logprobs on token ids: what lm-evaluation-harness asks for a loglikelihood
    status, scored = call("POST", server + "/v1/completions", {"prompt": [ids], "max_tokens": 1, "logprobs": 1,
                                                             "echo": True, "temperature": 0, "seed": 1234})
    lp = scored["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids) + 1
    assert lp["tokens"][: len(ids)] == [TOK.decode([t]) for t in ids]
    full = ids + [TOK.encode(lp["tokens"][-1])[0]]
    with torch.no_grad():
        ref_lp = torch.log_softmax(model.logits(torch.tensor([full])), dim=-1)[0]
    assert lp["token_logprobs"][1:] == pytest.approx([ref_lp[j - 1, full[j]].item() for j in range(1, len(full))],
                                                     abs=1e-4)
    assert all(max(top.values()) >= v - 1e-9 for top, v in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:]))
    assert scored["choices"][0]["text"].startswith(prompt)
    # stop strings cut the text
    free = call("POST", server + "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})[1]
    text = free["choices"][0]["text"]
    stop = text[3:5]
    cut = call("POST", server + "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                    "stop": [stop]})[1]["choices"][0]
    assert cut["text"] == text[: text.find(stop)] and cut["finish_reason"] == "stop"
    for body, field in [({"prompt": 5}, "prompt"), ({"prompt": "a", "max_tokens": -2}, "max_tokens"),
                        ({"prompt": "a", "temperature": -1}, "temperature"), ({"prompt": "a", "top_p": 0}, "top_p"),
                        ({"prompt": "a", "n": 0}, "n"), ({"prompt": "a", "logprobs": 9}, "logprobs"),
                        ({"prompt": "a", "stop": [1]}, "stop"), ({"prompt": "a", "echo": "y"}, "echo"),
                        ({"prompt": "a", "seed": -1}, "seed"), ({"prompt": [[70000]]}, "prompt"),
                        ({"prompt": "a", "presence_penalty": 1}, "presence_penalty"),
                        ({"prompt": "a", "frobnicate": 1}, "frobnicate"),
                        ({"prompt": "a", "max_tokens": 500}, "128")]:
        status, answer = call("POST", server + "/v1/completions", body)
        assert status == 400 and field in answer["error"], (body, answer)


def _sse(url: str, body: dict) -> list:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:])
    return events


def test_streaming_equals_the_whole_answer(server):
    body = {"prompt": ["Streaming is", "Two"], "max_tokens": 20, "seed": 5, "temperature": 0.9}
    whole = call("POST", server + "/v1/completions", body)[1]
    events = _sse(server + "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = ["", ""]
    for c in chunks[:-1]:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["text"]
    assert texts == [c["text"] for c in whole["choices"]]
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["text"]]) >= 4  # it arrived in pieces
    assert chunks[-1]["usage"] == whole["usage"]
    finals = {ch["index"]: ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]}
    assert finals == {0: whole["choices"][0]["finish_reason"], 1: whole["choices"][1]["finish_reason"]}


def test_endpoints(server):
    assert get_json(server + "/health")["status"] == "ok"
    models = get_json(server + "/v1/models")
    assert models["data"][0]["id"] == "tiny-gpt2" and models["data"][0]["max_model_len"] == 128
    spec = get_json(server + "/openapi.json")
    assert {"/api", "/v1/completions", "/v1/models", "/health", "/tokenize", "/tokenizer_info"} <= set(spec["paths"])
    info = get_json(server + "/tokenizer_info")
    assert info["eos_token"] == "<|endoftext|>"
    status, toks = call("POST", server + "/tokenize", {"prompt": "Hello world<|endoftext|>", "add_special_tokens": False})
    assert status == 200 and toks["tokens"] == TOK.encode("Hello world") + [TOK.eod]
    assert call("POST", server + "/detokenize", {"tokens": toks["tokens"]})[1]["prompt"] == "Hello world<|endoftext|>"
    assert call("POST", server + "/tokenize", {"prompt": 3})[0] == 400


def test_concurrent_requests_do_not_mix(server):
    bodies = [{"prompts": [f"Request number {i} says"], "tokens_to_generate": 10 + i, "random_seed": i, "top_p": 0.9}
              for i in range(12)]
    alone = [call("PUT", server + "/api", b)[1]["tokens"] for b in bodies]
    with ThreadPoolExecutor(12) as pool:
        together = list(pool.map(lambda b: call("PUT", server + "/api", b)[1]["tokens"], bodies))
    assert together == alone


def test_queue_limit_is_503(model):
    """A queue that is full answers 503 (the engine's generation held on an event)."""
    import uvicorn

    from gptrain.serve.app import build_app
    from gptrain.serve.engine import Engine
    from serve_util import free_port

    release = threading.Event()

    def held(*args, **kw):
        release.wait(300)
        return generate(*args, **kw)

    def until(condition, what: str, seconds: float = 120) -> None:
        deadline = time.monotonic() + seconds
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    engine = Engine(model, TOK, max_batch=1, max_queue=2, generate_fn=held)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, "held", log=lambda s: None), host="127.0.0.1", port=port,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        until(lambda: srv.started, "the server to start")
        body = {"prompts": ["a"], "tokens_to_generate": 1}
        with ThreadPoolExecutor(4) as pool:
            # in stages, so that the engine has taken the first (busy) before the queue fills
            first = [pool.submit(call, "PUT", base + "/api", body, 300)]
            until(lambda: engine.busy, "the first request to run")
            first += [pool.submit(call, "PUT", base + "/api", body, 300) for _ in range(2)]
            until(lambda: engine._waiting == 2, "two requests in the queue")
            status, answer = call("PUT", base + "/api", body)
            assert status == 503 and "queue" in answer["error"]
            release.set()
            assert [f.result(timeout=300)[0] for f in first] == [200, 200, 200]
    finally:
        release.set()
        srv.should_exit = True
        thread.join(timeout=10)
        engine.close()


def test_client_loop_and_one_shot(server):
    import subprocess
    import sys

    address = server.removeprefix("http://")
    run = subprocess.run([sys.executable, "-m", "gptrain", "client", address], input="The list\n5\nx\n-1\n",
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("Enter prompt: ") == 3 and run.stdout.count("Enter number of tokens to generate: ") == 2
    response = run.stdout.split("Megatron Response: \n", 1)[1]
    assert response.startswith("The list")
    assert "Error 400: tokens_to_generate" in run.stdout
    one = subprocess.run([sys.executable, "-m", "gptrain", "client", address, "--prompt", "Hello",
                          "--tokens-to-generate", "4"], capture_output=True, text=True, timeout=120)
    assert one.returncode == 0 and one.stdout.startswith("Megatron Response: \nHello")
    down = subprocess.run([sys.executable, "-m", "gptrain", "client", "127.0.0.1:1", "--prompt", "x"],
                          capture_output=True, text=True, timeout=120)
    assert down.returncode == 2 and down.stderr.count("\n") == 1 and "error" in down.stderr


@pytest.mark.slow
def test_lm_evaluation_harness_against_the_server(server, model, tmp_path, monkeypatch):
    """lm-eval's local-completions model with the remote tokenizer, unmodified, on a task file the
    test writes: its loglikelihoods and greedy generations equal the model's own."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    docs = [{"context": "The capital of France is", "continuation": " Paris"},
            {"context": "One, two, three,", "continuation": " four, five"},
            {"context": "Water boils at", "continuation": " 100 degrees"}]
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              "doc_to_text: '{{context}}'\ndoc_to_target: '{{continuation}}'\n")
    (tmp_path / "ll.yaml").write_text("task: gptrain_ll\noutput_type: loglikelihood\n" + common
                                      + "metric_list:\n  - metric: acc\n")
    (tmp_path / "gen.yaml").write_text("task: gptrain_gen\noutput_type: generate_until\n" + common
                                       + "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  temperature: 0\n"
                                       + "metric_list:\n  - metric: exact_match\n")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={server}/v1/completions,model=tiny-gpt2,tokenizer_backend=remote,max_length=128,"
                   "num_concurrent=2,max_retries=1,tokenized_requests=True",
        tasks=["gptrain_ll", "gptrain_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True, limit=None)
    ll = sorted(results["samples"]["gptrain_ll"], key=lambda s: s["doc_id"])
    gen = sorted(results["samples"]["gptrain_gen"], key=lambda s: s["doc_id"])
    for doc, sample_ll, sample_gen in zip(docs, ll, gen):
        ctx, cont = TOK.encode(doc["context"]), TOK.encode(doc["continuation"])
        with torch.no_grad():
            lp = torch.log_softmax(model.logits(torch.tensor([ctx + cont])), dim=-1)[0]
        expected = sum(lp[len(ctx) + j - 1, t].item() for j, t in enumerate(cont))
        greedy_ok = all(lp[len(ctx) + j - 1].argmax().item() == t for j, t in enumerate(cont))
        got, is_greedy = sample_ll["resps"][0][0]
        assert got == pytest.approx(expected, abs=1e-3) and is_greedy == greedy_ok
        ref = local(model, doc["context"], 6, temperature=0.0)
        text = TOK.decode([t for t in ref.generated if t != TOK.eod]).split("\n")[0]
        assert sample_gen["resps"][0][0] == text
    assert "acc,none" in results["results"]["gptrain_ll"]


def test_load_benchmark_small_scale(server):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from serve_load import run_load

    r = run_load(server, clients=6, seconds=3, tokens=8, check=6)
    assert r["errors"] == [] and r["requests"] >= 6
    assert r["checked"] >= 3 and r["mismatches"] == []
    assert r["p99_s"] >= r["p50_s"] > 0


def test_playground_in_headless_chromium(server, tmp_path):
    """Debian's chromium through Selenium on loopback: type a prompt, press Generate, see the
    completion stream in with its token count."""
    import shutil

    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not browser or not driver_path:
        pytest.skip("Debian's chromium and chromium-driver are not installed (the README's test command installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path), options=options)
    try:
        driver.set_page_load_timeout(60)
        driver.get(server + "/")
        assert "gptrain playground" in driver.title
        box = driver.find_element(By.ID, "prompt")
        box.clear()
        box.send_keys("Once upon a time")
        for field, value in (("max_tokens", "24"), ("temperature", "0"), ("seed", "3")):
            el = driver.find_element(By.ID, field)
            el.clear()
            el.send_keys(value)
        driver.find_element(By.ID, "generate").click()
        wait = WebDriverWait(driver, 60, poll_frequency=0.1)
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#output .completion").text != "")
        wait.until(lambda d: d.find_element(By.ID, "generate").is_enabled())
        shown = driver.execute_script("return document.querySelector('#output .completion').textContent")
        count = int(driver.find_element(By.ID, "count").text)
        rate = float(driver.find_element(By.ID, "rate").text)
        assert driver.find_element(By.ID, "error").text == ""
    finally:
        driver.quit()
    expected = call("POST", server + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24,
                                                         "temperature": 0, "top_p": 0.95, "seed": 3})[1]
    assert shown == expected["choices"][0]["text"]
    assert count == expected["usage"]["completion_tokens"] and rate > 0
