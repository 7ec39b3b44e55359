"""Where a loaded server's host threads spend their time: `gptrain serve`'s in-flight engine and HTTP app
in this process (as the server builds them), `serve_load.py`'s clients in others, and a sampling thread
that reads every thread's Python stack (``sys._current_frames``) a few hundred times a second. Prints,
for the decode loop's thread and the HTTP thread, the share of samples at each innermost gptrain /
torch / library line, and serve_load's own figures.

A thread blocked in a C call that released the interpreter lock (a CUDA event wait, a graph replay)
shows that call's line; so does one waiting to take the lock back, which is what a decode loop starved
by the HTTP thread looks like: many samples at lines right after C calls while the device is idle.

    python3 benchmarks/serve_host_profile.py --load CHECKPOINT [--clients 32] [--seconds 20] [--procs 2]
    python3 benchmarks/serve_host_profile.py --tiny --seconds 5          # a tiny CPU model, no GPU
"""
from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def innermost(frame, depth: int = 3) -> str:
    """The innermost ``depth`` frames as ``file:line function`` (paths from site-packages or the repo)."""
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        name = code.co_filename
        for marker in ("site-packages/", "gptrain/", "lib/python3"):
            if marker in name:
                name = name[name.index(marker) + (len("site-packages/") if marker == "site-packages/" else 0):]
                break
        parts.append(f"{name}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " <- ".join(parts)


class StackSampler(threading.Thread):
    """Counts each watched thread's innermost frames every ``interval`` seconds."""

    def __init__(self, interval: float = 0.003):
        super().__init__(name="stack-sampler", daemon=True)
        self.interval = interval
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.samples: collections.Counter = collections.Counter()
        self.stop = threading.Event()

    def run(self) -> None:
        names = {}
        while not self.stop.wait(self.interval):
            if len(names) != threading.active_count():
                names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                name = names.get(ident, "?")
                if name == self.name:
                    continue
                self.samples[name] += 1
                self.counts[name][innermost(frame)] += 1

    def report(self, thread: str, top: int = 15) -> str:
        total = self.samples.get(thread, 0)
        if not total:
            return f"{thread}: no samples"
        lines = [f"{thread}: {total} samples"]
        for where, n in self.counts[thread].most_common(top):
            lines.append(f"  {100 * n / total:5.1f}%  {where}")
        return "\n".join(lines)


def direct_load(engine, tokenizer, clients: int, seconds: float, tokens: int) -> int:
    """serve_load.py's closed-loop clients without the HTTP front end: threads submitting its requests
    (seeded, temperature 0.8, top-p 0.9) straight to the engine; what the decode loop gives alone."""
    from gptrain.inference.generate import SamplingParams
    from gptrain.serve.engine import Job

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_load import body_for

    made, stop = [0] * clients, time.perf_counter() + seconds
    clock = engine.metrics.loop

    def client(i: int) -> None:
        seed = i
        while time.perf_counter() < stop:
            body = body_for(seed, tokens)
            job = Job(prompts=[tokenizer.encode(body["prompts"][0])],
                      params=[SamplingParams(max_new_tokens=tokens, seed=seed, top_p=body["top_p"],
                                             temperature=body["temperature"])])
            made[i] += len(engine.submit(job).result(120)[0].tokens) - len(job.prompts[0])
            seed += clients

    sampler = StackSampler()
    sampler.start()
    before, steps0 = dict(clock.seconds), engine.metrics.decode_steps._value.get()
    begin = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - begin
    sampler.stop.set()
    steps = engine.metrics.decode_steps._value.get() - steps0
    engine.close()
    print(f"{clients} direct clients (no HTTP), {elapsed:.1f} s: {sum(made) / elapsed:.1f} generated tokens/s, "
          f"{steps / elapsed:.0f} steps/s")
    if steps:
        print("per step (us): " + ", ".join(f"{k} {1e6 * (clock.seconds[k] - before[k]) / steps:.0f}"
                                             for k in clock.PHASES if k != "idle"))
    print(sampler.report("gptrain-generate"))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", help="a checkpoint folder (as gptrain serve --load)")
    p.add_argument("--tiny", action="store_true", help="a tiny random GPT-2 on the CPU instead")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--direct", action="store_true",
                   help="no HTTP: client threads of this process submit serve_load.py's requests to the engine")
    args = p.parse_args()
    if not args.load and not args.tiny:
        p.error("give --load or --tiny")
    import tempfile

    import uvicorn

    from gptrain.inference.generate_cli import load_from_flags
    from gptrain.serve.app import build_app
    from gptrain.serve.inflight import InflightEngine

    tmp = tempfile.TemporaryDirectory()
    load = args.load
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from serve_util import save_hf_folder, tiny_gpt

        load = str(save_hf_folder(tiny_gpt(), Path(tmp.name) / "tiny-gpt2"))
    flags = argparse.Namespace(load=load, device=None if not args.tiny else "cpu", dtype=None, vocab_file=None,
                               merge_file=None, tokenizer_type=None, tokenizer_model=None, tensor_parallel=1)
    loaded = load_from_flags(flags)
    engine = InflightEngine(loaded.model, loaded.tokenizer, max_batch=args.max_batch, max_queue=512)
    if engine.decoder.use_graph:
        engine.warm_up()
    if args.direct:
        return direct_load(engine, loaded.tokenizer, args.clients, args.seconds, args.tokens)
    app = build_app(engine, loaded.name, log=lambda line: None)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    http = threading.Thread(target=server.run, name="http", daemon=True)
    http.start()
    while not server.started:
        time.sleep(0.05)
    sampler = StackSampler()
    sampler.start()
    try:
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--url",
                              f"http://127.0.0.1:{port}", "--clients", str(args.clients), "--seconds",
                              str(args.seconds), "--tokens", str(args.tokens), "--procs", str(args.procs)],
                             capture_output=True, text=True, timeout=args.seconds + 300)
    finally:
        sampler.stop.set()
        server.should_exit = True
        http.join(timeout=10)
        engine.close()
        tmp.cleanup()
    print("\n".join(line for line in out.stdout.splitlines() if not line.startswith("PUT")))
    print(sampler.report("gptrain-generate"))
    print(sampler.report("http"))
    return out.returncode


if __name__ == "__main__":
    raise SystemExit(main())
