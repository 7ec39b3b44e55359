"""``gptrain client HOST:PORT``: Megatron's tools/text_generation_cli.py loop (``Enter prompt:``,
``Enter number of tokens to generate:``, the text printed), or one request with ``--prompt``."""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request


def put_api(url: str, body: dict, timeout: float) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT",
                                 headers={"Content-Type": "application/json; charset=UTF-8"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.loads(err.read())
        except ValueError:
            return err.code, {"error": err.reason}


def client_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gptrain client", description=__doc__.splitlines()[0])
    p.add_argument("address", help="HOST:PORT of a gptrain (or Megatron) text generation server")
    p.add_argument("--prompt", default=None, help="one request, then exit")
    p.add_argument("--tokens-to-generate", type=int, default=64)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    address = args.address if "://" in args.address else "http://" + args.address
    url = address.rstrip("/") + "/api"
    if args.prompt is not None:
        return _one(url, args.prompt, args.tokens_to_generate, args.timeout)
    while True:
        try:
            prompt = input("Enter prompt: ")
            count = input("Enter number of tokens to generate: ")
        except EOFError:
            print()
            return 0
        try:
            tokens = int(count)
        except ValueError:
            print(f"Error: {count!r} is not a number of tokens")
            continue
        _one(url, prompt, tokens, args.timeout)


def _one(url: str, prompt: str, tokens: int, timeout: float) -> int:
    try:
        status, answer = put_api(url, {"prompts": [prompt], "tokens_to_generate": tokens}, timeout)
    except (OSError, ValueError) as err:
        print(f"gptrain client: error: {url}: {getattr(err, 'reason', err)}", file=sys.stderr)
        return 2
    if status != 200:
        print(f"Error {status}: {answer.get('error', answer)}")
        return 1
    print("Megatron Response: ")
    print(answer["text"][0])
    return 0
