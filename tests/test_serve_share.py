"""benchmarks/serve_share.py reads the two logs run.sh serve writes (lines as serve_load.py and
decode_speed.py printed them on an H100 in s22)."""
from __future__ import annotations

from bench_script import load

LOAD = ("waited 1.8 s for the server's warm-up\n"
        "32 clients, 30.1 s: 5961 requests, 197.96 requests/s, 12657.4 generated tokens/s, latency p50 154 ms, "
        "p99 314 ms, errors 0, same text alone as under load: 8/8\n")
ENGINE = ("batch  32: gptrain (fused)    24047.5 tokens/s (1.331 ms/step, prefill included)\n"
          "batch  32: gptrain (fused, sampled: temperature 0.8, top-p 0.9)    16346.2 tokens/s (1.958 ms/step, "
          "prefill included)\n")


def _module():
    return load("serve_share")


def test_the_share_of_the_sampled_engine():
    line = _module().share(LOAD, ENGINE)
    assert "12,657 tokens/s = 77.4% of the engine's batch-32 rate" in line and "16,346" in line


def test_a_missing_figure_is_said():
    assert "not computed" in _module().share(LOAD, "batch  32: gptrain (fused)    24047.5 tokens/s\n")
