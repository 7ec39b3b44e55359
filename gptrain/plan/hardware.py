"""What the planner knows of a GPU: datasheet peaks and measured efficiencies (calibration.json,
shipped; or the table ``gptrain plan --calibrate`` wrote to the cache dir), and the links between GPUs."""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path

GPUS = ("h100", "h200", "a100", "a800")
SHIPPED = Path(__file__).with_name("calibration.json")


def cache_path(gpu: str) -> Path:
    """Where ``--calibrate`` writes the table of this GPU (read before the shipped one)."""
    from gptrain.user_cache import cache_dir

    return cache_dir() / f"calibration-{gpu}.json"


def _interpolate(table: list[list[float]], x: float) -> float:
    """Piecewise linear in log2(x), clamped at the ends."""
    keys = [k for k, _ in table]
    i = bisect.bisect_left(keys, x)
    if i == 0:
        return table[0][1]
    if i == len(table):
        return table[-1][1]
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    w = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
    return y0 + w * (y1 - y0)


@dataclass(frozen=True)
class Gpu:
    name: str
    source: str
    peak_tflops: float
    hbm_gbps: float
    memory_gib: float
    intra_node_gbps: float  # all-reduce bus bandwidth inside a node
    inter_node_gbps: float  # per GPU, across nodes
    matmul_efficiency_by_min_dim: list
    attention_efficiency_by_head_dim: list
    memory_bound_efficiency: float
    optimizer_efficiency: float
    host_ms_per_layer: dict

    def matmul_s(self, m: int, k: int, n: int) -> float:
        """Seconds for (m x k) @ (k x n): its FLOPs at the efficiency of its smallest dimension."""
        eff = _interpolate(self.matmul_efficiency_by_min_dim, min(m, k, n))
        return 2.0 * m * k * n / (self.peak_tflops * 1e12 * eff)

    def attention_s(self, flops: float, head_dim: int) -> float:
        return flops / (self.peak_tflops * 1e12 * _interpolate(self.attention_efficiency_by_head_dim, head_dim))

    def memory_s(self, nbytes: float, efficiency: float | None = None) -> float:
        return nbytes / (self.hbm_gbps * 1e9 * (efficiency or self.memory_bound_efficiency))


def load_gpu(name: str, intra_gbps: float | None = None, inter_gbps: float | None = None,
             measured: bool = True) -> Gpu:
    """The calibration of ``name``: the user's measured table if ``--calibrate`` wrote one (and
    ``measured``), else the shipped one; link bandwidths overridden where given (math.inf: no
    communication cost, as in the rank simulator)."""
    if name not in GPUS:
        raise ValueError(f"--gpu {name}: use one of {', '.join(GPUS)}")
    table = json.loads(SHIPPED.read_text())[name]
    cached = cache_path(name)
    if measured and cached.exists():
        table = {**table, **json.loads(cached.read_text())}
    fields = {k: table[k] for k in Gpu.__dataclass_fields__ if k in table}
    fields.update(name=name)
    if intra_gbps:
        fields["intra_node_gbps"] = intra_gbps
    if inter_gbps:
        fields["inter_node_gbps"] = inter_gbps
    return Gpu(**fields)
