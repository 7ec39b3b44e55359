"""``gptrain serve --load CKPT [--host 127.0.0.1] [--port 5000]``: the text generation server."""
from __future__ import annotations

import argparse
import sys


def serve_main(argv: list[str]) -> int:
    from gptrain.inference.generate_cli import add_model_flags, load_from_flags

    p = argparse.ArgumentParser(prog="gptrain serve", description=__doc__.splitlines()[0])
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--max-batch", type=int, default=64, help="rows generated together")
    p.add_argument("--max-queue", type=int, default=512, help="prompts waiting before 503")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger requests get 413")
    p.add_argument("--model-name", default=None, help="the id /v1/models reports (default: the folder's name)")
    p.add_argument("--no-cuda-graph", action="store_true", help="eager decode steps on a GPU")
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536:
        return _fail(f"--port {args.port}: not a port")
    if args.max_batch < 1 or args.max_queue < 1:
        return _fail("--max-batch and --max-queue must be >= 1")
    try:
        import uvicorn

        from gptrain.serve.app import build_app
        from gptrain.serve.engine import Engine
    except ImportError as err:
        return _fail(f"{err.name} is not installed: pip install fastapi uvicorn")
    try:
        loaded = load_from_flags(args)
    except (OSError, ValueError) as err:
        return _fail(str(err))
    generate_fn = None
    if loaded.model.word_embeddings.weight.is_cuda and not args.no_cuda_graph:
        from gptrain.inference.fast import graph_generate

        generate_fn = graph_generate
    engine = Engine(loaded.model, loaded.tokenizer, max_batch=args.max_batch, max_queue=args.max_queue,
                    **({"generate_fn": generate_fn} if generate_fn else {}))
    app = build_app(engine, args.model_name or loaded.name, max_body_bytes=args.max_body_bytes)
    print(f"gptrain serve: {loaded.kind} model {loaded.name} ({loaded.model.cfg.num_layers} layers, "
          f"{loaded.model.cfg.max_position_embeddings} positions) on "
          f"{loaded.model.word_embeddings.weight.device}, http://{args.host}:{args.port}/", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.close()
    return 0


def _fail(message: str) -> int:
    print(f"gptrain serve: error: {message}", file=sys.stderr)
    return 2
