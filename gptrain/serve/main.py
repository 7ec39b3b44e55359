"""``gptrain serve --load CKPT [--host 127.0.0.1] [--port 5000]``: the text generation server."""
from __future__ import annotations

import argparse
import signal
import sys


def serve_main(argv: list[str]) -> int:
    from gptrain.inference.generate_cli import add_model_flags, close_distributed, load_from_flags

    p = argparse.ArgumentParser(prog="gptrain serve", description=__doc__.splitlines()[0])
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--allowed-hosts", default="", metavar="NAME[,NAME...]",
                   help="Host names served besides loopback names, IP addresses, --host and this machine's name "
                        "(a guard against DNS rebinding; '*': any)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="rows generated together (a larger request runs as parts of this many rows)")
    p.add_argument("--max-queue", type=int, default=512,
                   help="rows waiting before 503 (a request of more rows gets 413)")
    p.add_argument("--request-timeout", type=float, default=600, metavar="SECONDS",
                   help="a request still running this long after it arrived ends with 504 (0: no limit)")
    p.add_argument("--static-batching", action="store_true",
                   help="run whatever has gathered as one batch, the next batch after it (default: in-flight "
                        "batching, requests join and leave the running batch at every step)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger requests get 413")
    p.add_argument("--model-name", default=None, help="the id /v1/models reports (default: the folder's name)")
    p.add_argument("--no-cuda-graph", action="store_true", help="eager decode steps on a GPU")
    p.add_argument("--no-warmup", action="store_true",
                   help="capture no decode graphs ahead (they are captured in the background after start-up by "
                        "default); first requests capture what they need")
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536:
        return _fail(f"--port {args.port}: not a port")
    if args.max_batch < 1 or args.max_queue < 1:
        return _fail("--max-batch and --max-queue must be >= 1")
    if args.request_timeout < 0:
        return _fail("--request-timeout must be >= 0 (0: no limit)")
    try:
        import uvicorn

        from gptrain.serve.app import build_app
    except ImportError as err:
        return _fail(_missing(err))
    from gptrain.start_clock import StartClock

    clock = StartClock()
    clock.mark("imports")
    loaded = None
    try:
        try:
            loaded = load_from_flags(args)
        except (OSError, ValueError) as err:
            return _fail(str(err))
        clock.mark("load")
        if loaded.group is None:
            return _serve(args, loaded, uvicorn, build_app, clock=clock)
        # tensor parallelism: rank 0 serves, the others follow it (serve/tensor_parallel.py)
        from gptrain.serve.tensor_parallel import WorkChannel, follow

        channel = WorkChannel()
        if channel.rank == 0:
            return _serve(args, loaded, uvicorn, build_app, channel, clock=clock)
        _hold_signals()  # rank 0 decides when to stop (torchrun signals every rank)
        batches = follow(loaded.model, channel, loaded.group, use_graph=not args.no_cuda_graph)
        print(f"gptrain serve: rank {channel.rank}: stopped after {batches} batches", flush=True)
        return 0
    finally:
        close_distributed(loaded.model if loaded is not None else None)  # its captured graphs first


def _serve(args, loaded, uvicorn, build_app, channel=None, clock=None) -> int:
    from gptrain.inference.steps import fused_decodable, plain_model
    from gptrain.serve.engine import Engine

    model = loaded.model
    cuda = model.word_embeddings.weight.is_cuda
    generate_fn, how = None, "eager decode"
    generic = cuda and not plain_model(model)  # the fused decode steps are GPT-2's, on the model's own modules
    if generic:
        how, cuda = "eager decode (the fused decode steps need GPT-2's layers)", False
    if channel is not None:
        from gptrain.serve.tensor_parallel import LeaderGenerate

        generate_fn = LeaderGenerate(channel, loaded.group, model.word_embeddings.weight.device,
                                     use_graph=not args.no_cuda_graph)
        world = channel.group.size()
        graphs = model.word_embeddings.weight.is_cuda and not args.no_cuda_graph
        step = "fused decode step" if fused_decodable(model) else "decode step of the model's own layers"
        how = f"tensor-parallel over {world} ranks, {'CUDA-graph ' if graphs else 'eager '}{step} (static batches)"
    elif generic and not args.no_cuda_graph:
        from gptrain.inference.graph_step import graph_step_generate

        generate_fn, how = graph_step_generate, "CUDA-graph decode step of the model's own layers (static batches)"
    elif cuda and not args.no_cuda_graph:
        from gptrain.inference.rows import fused_generate

        # one graph per batch bucket; a request's text does not depend on its batch
        generate_fn, how = fused_generate, "fused CUDA-graph decode (batch invariant)"
        if not args.no_warmup and args.static_batching:
            _warm_up(model, args.max_batch)
    engine_kw = {"max_batch": args.max_batch, "max_queue": args.max_queue, "request_timeout": args.request_timeout,
                 **({"generate_fn": generate_fn} if generate_fn else {})}
    if channel is None and plain_model(model) and not args.static_batching:
        from gptrain.serve.inflight import InflightEngine

        engine = InflightEngine(model, loaded.tokenizer, use_graph=not args.no_cuda_graph, **engine_kw)
        how = ("fused CUDA-graph" if engine.decoder.use_graph else "fused eager") + " decode, in-flight batching " \
            "(batch invariant; log-probability requests in static batches)"
        if engine.decoder.use_graph and not args.no_warmup:
            count = engine.warm_up_in_background(lambda line: print(f"gptrain serve: {line}", flush=True))
            print(f"gptrain serve: capturing {count} decode graphs in the background (requests are served "
                  "meanwhile; GET /health says how many are left)", flush=True)
    else:
        engine = Engine(model, loaded.tokenizer, **engine_kw)
    app = build_app(engine, args.model_name or loaded.name, max_body_bytes=args.max_body_bytes, host=args.host,
                    allowed_hosts=[h for h in args.allowed_hosts.split(",") if h.strip()])
    print(f"gptrain serve: {loaded.kind} model {loaded.name} ({model.cfg.num_layers} layers, "
          f"{model.cfg.max_position_embeddings} positions) on {model.word_embeddings.weight.device}, {how}, "
          f"http://{args.host}:{args.port}/", flush=True)
    if clock is not None:
        clock.mark("warm-up")
        print(f"gptrain serve: ready in {clock.line()}", flush=True)
    _hold_signals()  # uvicorn shuts down on SIGINT/SIGTERM, then re-raises it: end normally instead
    # the decode loop gives the interpreter lock up in every CUDA call; a thread asking for it back waits
    # up to the switch interval (5 ms by default) while the HTTP thread runs Python (RESULTS.md, Serving)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.close(timeout=None if channel is not None else 10)  # the ranks stop after the running batch
        if channel is not None:
            channel.stop()
    print("gptrain serve: stopped", flush=True)
    return 0


def _warm_up(model, max_batch: int) -> None:
    import time

    from gptrain.inference.rows import warm_up

    print(f"gptrain serve: compiling and capturing the decode graphs (prompt lengths, batches up to {max_batch}) ...",
          flush=True)
    begin = time.perf_counter()
    warmed = warm_up(model, max_batch)
    note = "" if warmed >= max_batch else f"; batches above {warmed} did not fit in GPU memory: lower --max-batch"
    print(f"gptrain serve: warm-up done in {time.perf_counter() - begin:.1f} s{note}", flush=True)


def _hold_signals() -> None:
    """SIGINT and SIGTERM end nothing by themselves: uvicorn (rank 0) or rank 0's stop message
    (the other ranks) ends the process, with exit status 0."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)


SWITCH_INTERVAL_S = 5e-5

# the pip package of a module `gptrain serve` imports, where the names differ
PACKAGES = {"prometheus_client": "prometheus-client", "starlette": "fastapi", "pydantic": "fastapi",
            "multipart": "python-multipart", "opentelemetry": "opentelemetry-api", "yaml": "pyyaml"}


def _missing(err: ImportError) -> str:
    """The module that is missing and the command that installs it (the server's packages are
    gptrain dependencies, so reinstalling gptrain installs them too)."""
    module = (err.name or str(err)).split(".", 1)[0]
    package = PACKAGES.get(module, module.replace("_", "-"))
    return f"{module} is not installed (`gptrain serve` needs it): pip install {package}"


def _fail(message: str) -> int:
    print(f"gptrain serve: error: {message}", file=sys.stderr)
    return 2
