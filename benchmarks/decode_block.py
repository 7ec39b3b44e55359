"""The whole-block decode kernel (kernels/decode.py ``decode_block``: one launch of persistent programs
a transformer block, grid barriers between its stages) next to the five stage kernels a block, on
the 345M in bf16 (random init): agreement with the stage kernels and batch invariance, one step's
CUDA graph time, and tokens/s of the fused decode loop (inference/rows.py) with each.

    python3 benchmarks/decode_block.py [--batch-sizes 1 32] [--programs 132]
"""
from __future__ import annotations

import argparse
import time

import torch

from gptrain.inference.fast import Mode
from gptrain.inference.generate import SamplingParams
from gptrain.inference.rows import RowDecoder
from gptrain.kernels import decode
from gptrain.model.gpt import GPT, GPTConfig


class BlockDecoder(RowDecoder):
    programs: int | None = None

    def forward(self, chosen: torch.Tensor) -> None:
        model = self.model
        positions = (self.start + self.step_index).clamp_(max=self.window - 1)
        x = model.word_embeddings(chosen) + model.position_embeddings(positions)
        for i, block in enumerate(model.layers.values()):
            decode.decode_block(x, block, self.kv[i], positions, programs=self.programs)
        out = model.output_layer
        decode.ln_linear(x, out.weight[: out.vocab_size], ln=model.final_layernorm, out=self.logits)


def stages(x, block, kv, positions):
    attn, mlp = block.attn, block.mlp
    qkv = decode.ln_linear(x, attn.qkv.weight, attn.qkv.bias, ln=block.ln1)
    y = decode.decode_attention(qkv, kv, positions)
    decode.ln_linear(y, attn.proj.weight, attn.proj.bias, residual=x, out=x)
    h = decode.ln_linear(x, mlp.fc1.weight, mlp.fc1.bias, ln=block.ln2, gelu=True)
    return decode.ln_linear(h, mlp.fc2.weight, mlp.fc2.bias, residual=x, out=x)


def check(model: GPT, programs) -> None:
    """One block, both ways, fp32 and bf16, at 1, 5 and 37 rows; each row alone against in a batch."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        block = model.layers["0"].to(dtype)
        for rows in (1, 5, 37):
            x = torch.randn(rows, 1024, device="cuda", generator=gen).to(dtype)
            kv = torch.randn(2, 40, 16, 1024, 64, device="cuda", generator=gen).to(dtype)
            positions = torch.randint(0, 1000, (rows,), device="cuda", generator=gen)
            xs, kvs = x.clone(), kv.clone()
            stages(xs, block, kvs, positions)
            xb, kvb = x.clone(), kv.clone()
            t0 = time.perf_counter()
            decode.decode_block(xb, block, kvb, positions, programs=programs)
            torch.cuda.synchronize()
            err = (xb.float() - xs.float()).abs().max().item()
            scale = xs.float().abs().max().item()
            alone = x[-1:].clone()
            kv1 = kv[:, rows - 1:rows].clone().contiguous()
            decode.decode_block(alone, block, kv1, positions[-1:], programs=programs)
            torch.cuda.synchronize()
            print(f"check {str(dtype):15s} rows {rows:2d}: block vs stages max |diff| {err:.3g} (|x| max {scale:.3g}), "
                  f"kv equal {torch.equal(kvb, kvs)}; first launch {1e3 * (time.perf_counter() - t0):.0f} ms; "
                  f"last row alone bit-identical to in the batch: {torch.equal(alone, xb[-1:])}", flush=True)
    model.to(torch.bfloat16)


def replay_ms(graph, decoder, reps: int = 200) -> float:
    times = []
    for _ in range(5):
        decoder.step_index.fill_(0)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--programs", type=int, nargs="+", default=[0], help="0: one per multiprocessor")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--variants", action="store_true",
                   help="also time the step with the block kernel's variants (no prefetch; some stages left out)")
    args = p.parse_args()
    cfg = GPTConfig(hidden_dropout=0.0, attention_dropout=0.0)
    model = GPT(cfg)
    model.init_weights(1234)
    model = model.to("cuda", torch.bfloat16).eval()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_properties(0).multi_processor_count} multiprocessors", flush=True)
    with torch.no_grad():
        check(model, None)
    gen = torch.Generator().manual_seed(0)
    n = args.new_tokens
    variants = [("no prefetch", {"PREFETCH": False}), ("barriers only", {"WORK": 0}),
                ("qkv only", {"WORK": 1}), ("qkv+attention", {"WORK": 3}), ("all but fc2", {"WORK": 15}),
                ("BN 16 everywhere", {"BN_QKV": 16, "BN_FC1": 16}), ("fc2 split 4", {"SPLIT_FC2": 4}),
                ("8 warps", {"num_warps": 8})] if args.variants else []
    default = dict(decode.BLOCK_TILES)
    for b in args.batch_sizes:
        rows = torch.randint(0, cfg.vocab_size, (b, 32), generator=gen).tolist()
        params = [SamplingParams(max_new_tokens=n, temperature=0.0)] * b
        results = {}
        for name, programs in [("stages", None)] + [(f"block x{p or 'SMs'}", p or None) for p in args.programs]:
            decoder = RowDecoder(model, b) if name == "stages" else BlockDecoder(model, b)
            decoder.programs = programs
            out = decoder.run(rows, params)
            graph = decoder.graphs[Mode()]
            ms = replay_ms(graph, decoder)
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(3):
                begin = time.perf_counter()
                out = decoder.run(rows, params)
                best = min(best, time.perf_counter() - begin)
            results[name] = [g.generated for g in out]
            same = [next((i for i, (a, c) in enumerate(zip(g, s)) if a != c), n)
                    for g, s in zip(results[name], results["stages"])]
            print(f"batch {b:3d} {name:14s}: step graph {ms:.4f} ms; loop {b * n / best:9.1f} tokens/s "
                  f"(prefill included); greedy tokens equal to the stage kernels' for the first {min(same)} of {n}",
                  flush=True)
        for name, overrides in variants:
            decode.BLOCK_TILES.clear()
            decode.BLOCK_TILES.update(default, **overrides)
            decoder = BlockDecoder(model, b)
            try:
                decoder.run(rows, [SamplingParams(max_new_tokens=2, temperature=0.0)] * b)
                ms = replay_ms(decoder.graphs[Mode()], decoder)
                print(f"batch {b:3d} block variant {name:18s}: step graph {ms:.4f} ms", flush=True)
            except Exception as err:  # noqa: BLE001 - the other variants stand
                print(f"batch {b:3d} block variant {name}: {type(err).__name__}: {str(err)[:200]}", flush=True)
        decode.BLOCK_TILES.clear()
        decode.BLOCK_TILES.update(default)
    kernels = decode._kernels()
    try:
        for kernel in kernels:
            cache = next(iter(kernel.device_caches.values()))[0]
            for compiled in list(cache.values())[:3]:
                ptx = compiled.asm.get("ptx", "")
                print(f"{kernel.fn.__name__}: shared {compiled.metadata.shared} bytes, registers {compiled.n_regs}, "
                      f"spills {compiled.n_spills}, cp.async {ptx.count('cp.async')}, wgmma {ptx.count('wgmma')}, "
                      f"mma.sync {ptx.count('mma.sync')}", flush=True)
    except Exception as err:  # noqa: BLE001 - diagnostics only
        print("kernel cache not read:", type(err).__name__, err)


if __name__ == "__main__":
    main()
