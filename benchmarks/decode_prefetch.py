"""The fused decode step (inference/rows.py) with the next weights asked into L2 ahead of their
kernels (kernels/decode.py's ``prefetch``), by plan: how far ahead, whether attention prefetches too,
how much of the output layer. The 345M in bf16 (random init), one step's CUDA graph timed per
plan at each batch size, and its logits checked bit-identical to the plan without prefetch.

    python3 benchmarks/decode_prefetch.py [--batch-sizes 1 32] [--lanes 32 128]
"""
from __future__ import annotations

import argparse

import torch

from gptrain.inference.fast import Mode
from gptrain.inference.generate import SamplingParams
from gptrain.inference.rows import RowDecoder
from gptrain.kernels import decode
from gptrain.model.gpt import GPT, GPTConfig


def plan(model: GPT, distance: int, attention: bool, head_rows: int, wrap: bool) -> list:
    """Per kernel of a step, in order (per block: qkv, attention, proj, fc1, fc2; then the output
    layer), the tensor it prefetches or None."""
    weights, kinds = [], []
    for block in model.layers.values():
        weights += [block.attn.qkv.weight, None, block.attn.proj.weight, block.mlp.fc1.weight, block.mlp.fc2.weight]
    out = model.output_layer
    weights.append(out.weight[: min(head_rows, out.vocab_size)] if head_rows else None)
    matrices = [j for j, w in enumerate(weights) if w is not None or j == len(weights) - 1]
    targets = []
    for j, w in enumerate(weights):
        if w is None and j != len(weights) - 1 and not attention:
            targets.append(None)
            continue
        later = [m for m in matrices if m > j]
        ahead = distance if w is None else distance - 1  # attention: one past what qkv asked for
        pick = later[ahead] if len(later) > ahead else None
        if pick is None and wrap:
            pick = 0  # the next step's first weight
        targets.append(weights[pick] if pick is not None else None)
    return targets


class PlannedDecoder(RowDecoder):
    targets: list = []

    def forward(self, chosen: torch.Tensor) -> None:
        model, t = self.model, iter(self.targets)
        ln_linear, attention = decode.ln_linear, decode.decode_attention
        positions = (self.start + self.step_index).clamp_(max=self.window - 1)
        x = model.word_embeddings(chosen) + model.position_embeddings(positions)
        for i, block in enumerate(model.layers.values()):
            attn, mlp = block.attn, block.mlp
            qkv = ln_linear(x, attn.qkv.weight, attn.qkv.bias, ln=block.ln1, prefetch=next(t))
            y = attention(qkv, self.kv[i], positions, prefetch=next(t))
            ln_linear(y, attn.proj.weight, attn.proj.bias, residual=x, out=x, prefetch=next(t))
            h = ln_linear(x, mlp.fc1.weight, mlp.fc1.bias, ln=block.ln2, gelu=True, prefetch=next(t))
            ln_linear(h, mlp.fc2.weight, mlp.fc2.bias, residual=x, out=x, prefetch=next(t))
        out = model.output_layer
        ln_linear(x, out.weight[: out.vocab_size], ln=model.final_layernorm, out=self.logits, prefetch=next(t))


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
    p.add_argument("--lanes", type=int, nargs="+", default=[128])
    args = p.parse_args()
    cfg = GPTConfig(hidden_dropout=0.0, attention_dropout=0.0)
    model = GPT(cfg)
    model.init_weights(1234)
    model = model.to("cuda", torch.bfloat16).eval()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    plans = {"off": None, "next": (1, False, 0, False), "next+head8k": (1, False, 8192, False),
             "next+head8k+wrap": (1, False, 8192, True), "next+attn": (1, True, 8192, False),
             "two ahead": (2, False, 8192, False), "three ahead": (3, False, 8192, False),
             "next+head16k": (1, False, 16384, False)}
    gen = torch.Generator().manual_seed(0)
    for b in args.batch_sizes:
        rows = torch.randint(0, cfg.vocab_size, (b, 32), generator=gen).tolist()
        decoder = PlannedDecoder(model, b)
        reference = None
        for lanes in args.lanes:
            decode.PREFETCH_LANES = lanes
            for name, spec in plans.items():
                if name == "off" and lanes != args.lanes[0]:
                    continue
                decoder.targets = [None] * (5 * cfg.num_layers + 1) if spec is None else plan(model, *spec)
                decoder.graphs.clear()
                decoder.run(rows, [SamplingParams(max_new_tokens=4, temperature=0.0)] * b)
                graph = decoder.graphs[Mode()]
                decoder.step_index.fill_(0)
                graph.replay()
                logits = decoder.logits.clone()
                if reference is None:
                    reference = logits
                same = torch.equal(logits, reference)
                ms = replay_ms(graph, decoder)
                print(f"batch {b:3d} lanes {lanes:3d} {name:18s}: step graph {ms:.4f} ms "
                      f"({b / ms * 1e3:9.1f} tokens/s at the step alone); logits identical to 'off': {same}", flush=True)


if __name__ == "__main__":
    main()
