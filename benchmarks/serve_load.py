"""Load test of a gptrain text generation server: N concurrent clients send seeded ``PUT /api``
requests for T seconds; prints requests/s, tokens/s, p50/p99 latency and errors, then checks that
each seed gives the same text under load as alone. Exits non-zero on any error or difference.

    python3 benchmarks/serve_load.py --url http://127.0.0.1:5000 --clients 32 --seconds 60 [--procs 4]
    python3 benchmarks/serve_load.py --tiny --clients 8 --seconds 10     # starts a tiny CPU model itself
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def put(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url + "/api", data=json.dumps(body).encode(), method="PUT",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def body_for(seed: int, tokens: int) -> dict:
    return {"prompts": [f"Request {seed % 97} of the load test:"], "tokens_to_generate": tokens,
            "random_seed": seed, "top_p": 0.9, "temperature": 0.8}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def server_counters(url: str) -> dict[str, float] | None:
    """The server's counters from ``/metrics`` (unlabelled ones, and the loop's phases as
    ``phase:NAME``; None when it has none or no parser is here)."""
    try:
        from prometheus_client import parser

        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except (ImportError, OSError):
        return None
    found = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gptrain_loop_seconds_total":
                found[f"phase:{sample.labels['phase']}"] = sample.value
            elif sample.name.endswith("_total") and not sample.labels:
                found[sample.name] = sample.value
    return found


def _clients(url: str, first: int, count: int, start: float, stop: float, tokens: int) -> dict:
    """Clients ``first .. first + count - 1`` as threads of this process from ``start`` to ``stop``
    (wall-clock times, the same in every process)."""
    latencies, errors, texts = [], [], {}
    lock = threading.Lock()
    generated = [0]
    from gptrain.tokenizer import GPT2Tokenizer

    tok = GPT2Tokenizer()
    lengths: dict[int, int] = {}

    def prompt_length(seed: int) -> int:
        key = seed % 97
        if key not in lengths:
            lengths[key] = len(tok.encode(body_for(seed, tokens)["prompts"][0]))
        return lengths[key]

    def client(c: int) -> None:
        i = 0
        while time.time() < stop:
            seed = c * 100000 + i
            i += 1
            start = time.perf_counter()
            try:
                answer = put(url, body_for(seed, tokens))
            except (OSError, ValueError) as err:
                with lock:
                    errors.append(f"{type(err).__name__}: {getattr(err, 'reason', err)}")
                continue
            elapsed = time.perf_counter() - start
            made = len(answer["tokens"][0]) - prompt_length(seed)
            with lock:
                latencies.append(elapsed)
                texts[seed] = answer["text"][0]
                generated[0] += made

    threads = [threading.Thread(target=client, args=(c,)) for c in range(first, first + count)]
    time.sleep(max(0.0, start - time.time()))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"latencies": latencies, "errors": errors, "texts": texts, "generated": generated[0]}


def _clients_star(args) -> dict:
    return _clients(*args)


def wait_warm(url: str, limit_s: float = 600) -> float:
    """Seconds spent waiting for the server's background warm-up (``/health``'s ``warming``: decode graphs
    left to capture) to end: the load measures the warm server."""
    begin = time.perf_counter()
    while time.perf_counter() - begin < limit_s:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            if not json.loads(r.read()).get("warming"):
                break
        time.sleep(0.1)
    return time.perf_counter() - begin


def run_load(url: str, clients: int, seconds: float, tokens: int, check: int = 8, procs: int = 1) -> dict:
    """``clients`` closed-loop clients (threads, spread over ``procs`` processes so that the load
    generator's own interpreter is not the limit), once the server is warm."""
    waited = wait_warm(url)
    if waited > 0.5:
        print(f"waited {waited:.1f} s for the server's warm-up", flush=True)
    before = server_counters(url)
    procs = max(1, min(procs, clients))
    # every process starts its clients at the same moment, once all are up (spawning takes a while)
    start = time.time() + (0.0 if procs == 1 else 5.0)
    stop = start + seconds
    if procs == 1:
        parts = [_clients(url, 0, clients, start, stop, tokens)]
    else:
        import multiprocessing

        shares = [clients // procs + (i < clients % procs) for i in range(procs)]
        firsts = [sum(shares[:i]) for i in range(procs)]
        with multiprocessing.get_context("spawn").Pool(procs) as pool:
            parts = pool.map(_clients_star, [(url, f, n, start, stop, tokens) for f, n in zip(firsts, shares)])
    elapsed = time.time() - start  # to the last answer (clients finish the request they are in)
    after = server_counters(url)
    latencies = [x for part in parts for x in part["latencies"]]
    errors = [x for part in parts for x in part["errors"]]
    texts = {k: v for part in parts for k, v in part["texts"].items()}
    generated = sum(part["generated"] for part in parts)
    # the same seeds again, one at a time: the text must not depend on what ran beside it
    seeds = sorted(texts)[:: max(1, len(texts) // check)][:check]
    mismatches = [s for s in seeds if put(url, body_for(s, tokens))["text"][0] != texts[s]]
    server = None
    if before and after:
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        steps = delta.get("gptrain_decode_steps_total", 0.0)
        if steps:
            server = {"steps_per_s": steps / elapsed, "rows_per_step": delta["gptrain_decode_rows_total"] / steps,
                      "joins_per_s": delta["gptrain_prompt_joins_total"] / elapsed,
                      "device_wait": delta["gptrain_device_wait_seconds_total"] / elapsed,
                      "phases_us": {k[6:]: 1e6 * v / steps for k, v in delta.items()
                                    if k.startswith("phase:") and k != "phase:idle"}}
    return {"requests": len(latencies), "seconds": elapsed, "requests_per_s": len(latencies) / elapsed,
            "tokens_per_s": generated / elapsed, "p50_s": percentile(latencies, 50),
            "p99_s": percentile(latencies, 99), "errors": errors, "checked": len(seeds), "mismatches": mismatches,
            "server": server}


def tiny_server(folder: Path, port: int):
    """A tiny random GPT-2 (no download) served on the CPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from serve_util import save_hf_folder, tiny_gpt

    save_hf_folder(tiny_gpt(), folder)
    proc = subprocess.Popen([sys.executable, "-m", "gptrain", "serve", "--load", str(folder), "--port", str(port),
                             "--device", "cpu"])
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("the server exited") from None
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the server did not start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server (else --tiny starts one)")
    p.add_argument("--tiny", action="store_true", help="serve a tiny random model on the CPU for the run")
    p.add_argument("--port", type=int, default=5077)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--tokens", type=int, default=32, help="tokens_to_generate per request")
    p.add_argument("--procs", type=int, default=1, help="processes the clients are spread over")
    args = p.parse_args()
    if not args.url and not args.tiny:
        p.error("give --url or --tiny")
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            url = args.url.rstrip("/") if args.url else None
            if url is None:
                proc, url = tiny_server(Path(tmp) / "tiny-gpt2", args.port)
            r = run_load(url, args.clients, args.seconds, args.tokens, procs=args.procs)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    print(f"{args.clients} clients, {r['seconds']:.1f} s: {r['requests']} requests, {r['requests_per_s']:.2f} requests/s, "
          f"{r['tokens_per_s']:.1f} generated tokens/s, latency p50 {r['p50_s'] * 1000:.0f} ms, "
          f"p99 {r['p99_s'] * 1000:.0f} ms, errors {len(r['errors'])}, "
          f"same text alone as under load: {r['checked'] - len(r['mismatches'])}/{r['checked']}")
    if r["server"]:
        v = r["server"]
        print(f"  server: {v['steps_per_s']:.0f} decode steps/s, {v['rows_per_step']:.1f} rows a step, "
              f"{v['joins_per_s']:.0f} joins/s, host waiting on the device {v['device_wait'] * 100:.0f}% of the time")
        if v["phases_us"]:
            print("  decode loop per step (us): " + ", ".join(f"{k} {x:.0f}" for k, x in v["phases_us"].items()))
    for e in sorted(set(r["errors"]))[:5]:
        print(f"  error: {e}")
    return 1 if r["errors"] or r["mismatches"] or not r["requests"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
