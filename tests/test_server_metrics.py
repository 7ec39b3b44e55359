"""`gptrain serve`'s GET /metrics over HTTP: Prometheus text that prometheus_client's parser reads,
requests counted by endpoint and outcome, generated tokens equal to the tokens the responses
returned, the latency histograms filled, an idle queue at 0; and the missing-package message."""
from __future__ import annotations

import json
import urllib.request

import pytest

from gptrain.tokenizer import GPT2Tokenizer
from serve_util import call, running_server, save_hf_folder, send, tiny_gpt

pytest.importorskip("fastapi")
pytest.importorskip("transformers")
parser = pytest.importorskip("prometheus_client.parser")

TOK = GPT2Tokenizer()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = save_hf_folder(tiny_gpt(), tmp_path_factory.mktemp("metrics") / "tiny-gpt2")
    with running_server(folder, "--max-batch", "4") as base:
        yield base


def scrape(base: str) -> dict[str, dict]:
    """{sample name: {labels as a sorted tuple: value}} of one GET /metrics."""
    status, kind, body = send(base, "GET", "/metrics")
    assert status == 200 and kind.startswith("text/plain"), (status, kind)
    out: dict[str, dict] = {}
    for family in parser.text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def requests(samples, endpoint: str, outcome: str) -> float:
    return samples.get("gptrain_requests_total", {}).get((("endpoint", endpoint), ("outcome", outcome)), 0.0)


def test_metrics_count_requests_tokens_and_latency(server):
    before = scrape(server)
    assert {"gptrain_queue_depth", "gptrain_batch_occupancy", "gptrain_generated_tokens_total",
            "gptrain_time_to_first_token_seconds_count", "gptrain_inter_token_latency_seconds_count"} <= set(before)
    tokens = 0
    prompts = ["The quick brown fox", "Hello"]
    for i, prompt in enumerate(prompts):  # Megatron's API: the response's tokens are the prompt's and then the new ones
        status, out = call("PUT", server + "/api", {"prompts": [prompt], "tokens_to_generate": 6 + i,
                                                    "random_seed": i})
        assert status == 200, out
        tokens += len(out["tokens"][0]) - len(TOK.encode(prompt))
    for seed in (1, 2):  # OpenAI's: usage excludes an <|endoftext|> that ended a choice ("stop")
        status, out = call("POST", server + "/v1/completions", {"prompt": "Once upon", "max_tokens": 5, "n": 2,
                                                               "seed": seed})
        assert status == 200, out
        tokens += out["usage"]["completion_tokens"] + sum(c["finish_reason"] == "stop" for c in out["choices"])
    req = urllib.request.Request(server + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": "Hi", "max_tokens": 4, "seed": 3, "stream": True,
                                                  "stream_options": {"include_usage": True}}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: {")]
    ended = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
    tokens += events[-1]["usage"]["completion_tokens"] + (ended == "stop")
    status, out = call("PUT", server + "/api", {"prompts": ["x"], "tokens_to_generate": -1})
    assert status == 400, out
    status, _, _ = send(server, "POST", "/tokenize", body=b'{"prompt": "a"}', headers={"Content-Type": "text/plain"})
    assert status == 415

    after = scrape(server)
    assert requests(after, "/api", "ok") - requests(before, "/api", "ok") == 2
    assert requests(after, "/api", "bad_request") - requests(before, "/api", "bad_request") == 1
    assert requests(after, "/v1/completions", "ok") - requests(before, "/v1/completions", "ok") == 3
    assert requests(after, "/tokenize", "unsupported_media_type") == 1
    assert requests(after, "/api", "error") == 0 and requests(after, "/v1/completions", "busy") == 0
    generated = after["gptrain_generated_tokens_total"][()] - before["gptrain_generated_tokens_total"][()]
    assert generated == tokens
    rows = 2 + 2 * 2 + 1
    first = after["gptrain_time_to_first_token_seconds_count"][()] - \
        before["gptrain_time_to_first_token_seconds_count"][()]
    between = after["gptrain_inter_token_latency_seconds_count"][()] - \
        before["gptrain_inter_token_latency_seconds_count"][()]
    assert first == rows  # one first token per row (every row generated at least one)
    assert between == tokens - rows
    assert after["gptrain_time_to_first_token_seconds_sum"][()] > 0
    assert after["gptrain_queue_depth"][()] == 0
    assert after["gptrain_batch_occupancy"][()] == 0


def test_metrics_host_guard(server):
    status, _, _ = send(server, "GET", "/metrics", headers={"Host": "evil.example"})
    assert status == 403
    status, _, _ = send(server, "GET", "/metrics", headers={"Host": "localhost"})  # no Content-Type needed
    assert status == 200


def test_missing_package_message():
    from gptrain.serve.main import _missing

    message = _missing(ModuleNotFoundError("No module named 'prometheus_client'", name="prometheus_client"))
    assert message.startswith("prometheus_client is not installed") and "pip install prometheus-client" in message
    message = _missing(ModuleNotFoundError("No module named 'uvicorn.config'", name="uvicorn.config"))
    assert "uvicorn is not installed" in message and message.endswith("pip install uvicorn")
