"""The server's share of its engine, from two logs of the same call: serve_load.py's 32-client line and
decode_speed.py's batch-32 line for rows sampled as the load's requests (issue 35's measure).

    python3 benchmarks/serve_share.py LOAD32_LOG ENGINE_LOG
"""
from __future__ import annotations

import re
import sys

SERVED = re.compile(r"^32 clients,.*? ([\d.]+) generated tokens/s", re.M)
SAMPLED = re.compile(r"^batch +32: gptrain \(fused, sampled[^)]*\) +([\d.]+) tokens/s", re.M)


def share(load_log: str, engine_log: str) -> str:
    served, sampled = SERVED.search(load_log), SAMPLED.search(engine_log)
    if not (served and sampled):
        return "serve: the server's share of the engine not computed (a figure is missing from the logs)"
    a, b = float(served.group(1)), float(sampled.group(1))
    return (f"serve: 32 clients {a:,.0f} tokens/s = {a / b:.1%} of the engine's batch-32 rate for rows sampled "
            f"as the load's ({b:,.0f} tokens/s, same call)")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as load, open(sys.argv[2]) as engine:
        print(share(load.read(), engine.read()))
