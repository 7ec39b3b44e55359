"""Does a side-stream L2 prefetch make the next product read from L2? FC1 (4096 x 1024 bf16, one row)
timed alone (CUDA events around one kernel, mean of 24 distinct weights): cold; right after
``stream_to_l2`` of its weight and a device sync; right after the same weight was read by FC1 (hot).
Then a CUDA graph of 24 FC1 products on distinct weights in a chain, with and without a side
stream prefetching the next product's weight while one runs (with the prefetch in 1, 4 or 24 launches).

    python3 benchmarks/decode_l2_check.py
"""
from __future__ import annotations

import torch

from gptrain.kernels import decode


def one_kernel_us(fn, before) -> float:
    total = 0.0
    for i in range(24):
        before(i)
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn(i)
        end.record()
        torch.cuda.synchronize()
        total += begin.elapsed_time(end) * 1e3
    return total / 24


def main() -> None:
    dev = "cuda"
    torch.manual_seed(0)
    ws = [torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16) * 0.03 for _ in range(24)]
    flush = torch.empty(256 << 20, device=dev, dtype=torch.uint8)
    b = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16)
    out = torch.empty(1, 4096, device=dev, dtype=torch.bfloat16)
    sink = torch.zeros(1024, device=dev, dtype=torch.int32)
    fc1 = lambda i: decode.ln_linear(x, ws[i], b, out=out)  # noqa: E731
    fc1(0)
    stream_to_l2 = lambda i: decode.stream_to_l2(ws[i], sink)  # noqa: E731
    stream_to_l2(0)
    torch.cuda.synchronize()
    cold = one_kernel_us(fc1, lambda i: flush.zero_())
    prefetched = one_kernel_us(fc1, lambda i: (flush.zero_(), stream_to_l2(i)))
    hot = one_kernel_us(fc1, lambda i: (flush.zero_(), fc1(i)))
    alone = {p: None for p in (8, 32, 132)}
    for p in alone:
        decode.STREAM_PROGRAMS = p
        alone[p] = one_kernel_us(stream_to_l2, lambda i: flush.zero_())
    print(f"fc1 one kernel: cold {cold:.2f} us, after a side prefetch {prefetched:.2f} us, after a read {hot:.2f} us; "
          f"the prefetch of 8 MB alone: " + ", ".join(f"{v:.2f} us on {p} programs" for p, v in alone.items()),
          flush=True)
    side = torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in range(24)]

    def chain(mode: str) -> None:
        main_stream = torch.cuda.current_stream()
        for i in range(24):
            if mode != "none" and i + 1 < 24:
                events[i].record(main_stream)
                with torch.cuda.stream(side):
                    side.wait_event(events[i])
                    stream_to_l2(i + 1)
            fc1(i)
        if mode != "none":
            main_stream.wait_stream(side)

    for mode in ("none", "side"):
        for programs in ((32,) if mode == "none" else (8, 32, 64)):
            decode.STREAM_PROGRAMS = programs
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                chain(mode)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(mode)
            for _ in range(3):
                graph.replay()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(20):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            print(f"chain of 24 fc1, prefetch {mode} ({programs} programs): "
                  f"{begin.elapsed_time(end) * 1e3 / 20 / 24:.2f} us a product", flush=True)


if __name__ == "__main__":
    main()
