"""Blending several datasets by weight (``--data-path 0.35 A 0.65 B``), as megatron-core does.

megatron-core (``BlendedMegatronDatasetBuilder``, ``BlendedDataset``, ``helpers.cpp``):
  - weights are normalised with numpy (float64);
  - each dataset's split is built for ceil(ceil(target x weight) x 1.005) samples (the surplus);
  - the blend holds sum(ceil(target x weight)) samples;
  - sample i comes from the dataset with the largest shortfall ``weight x max(i, 1) - count``
    (doubles; the first such dataset on ties), and is that dataset's next sample.
The greedy rule depends on every earlier pick, so it has no sort key. Two datasets, the common
case, have a closed form (dataset 0 is picked exactly when floor(w0 x i) steps up), which is
checked against the rule in double arithmetic chunk by chunk with numpy; any step where rounding
makes them differ, and any other number of datasets, runs the rule itself step by step.
"""
from __future__ import annotations

import math

import numpy as np

SURPLUS = 0.005  # megatron-core's mid_level_dataset_surplus
CHUNK = 1 << 20


def parse_data_path(items: list[str]) -> tuple[list[float], list[str]]:
    """``[PREFIX]`` or ``[W1, PREFIX1, W2, PREFIX2, ...]`` -> (normalised weights, prefixes)."""
    if len(items) == 1:
        return [1.0], list(items)
    if len(items) % 2:
        raise ValueError(f"--data-path: expected one prefix or weight/prefix pairs, got {len(items)} items")
    weights, prefixes = [], []
    for w, p in zip(items[0::2], items[1::2]):
        try:
            weights.append(float(w))
        except ValueError:
            raise ValueError(f"--data-path: {w!r} is not a weight (pairs are WEIGHT PREFIX)") from None
        prefixes.append(p)
    for w, p in zip(weights, prefixes):
        if not w > 0 or not math.isfinite(w):
            raise ValueError(f"--data-path: weight {w:g} for {p}: weights must be positive (leave a dataset out "
                             "rather than weighting it 0)")
    return normalize(weights), prefixes


def normalize(weights: list[float]) -> list[float]:
    """megatron-core's ``normalize`` (numpy's sum, float64 division)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def samples_per_dataset(weights: list[float], num_samples: int) -> list[int]:
    """Samples each dataset's split is built for: megatron-core's target with its surplus."""
    return [int(math.ceil(math.ceil(num_samples * w) * (1 + SURPLUS))) for w in weights]


def blend_size(weights: list[float], num_samples: int) -> int:
    """Samples in the blend: megatron-core's sum of the per-dataset targets (without surplus)."""
    return sum(int(math.ceil(num_samples * w)) for w in weights)


def _greedy(w: list[float], counts: list[int], start: int, stop: int, dataset: np.ndarray, within: np.ndarray) -> None:
    """megatron-core's ``build_blending_indices`` loop for steps [start, stop), from ``counts``."""
    rest = range(1, len(w))
    out_d, out_s = [], []
    for i in range(start, stop):
        x = float(i) if i > 1 else 1.0
        best, best_error = 0, w[0] * x - counts[0]
        for d in rest:
            error = w[d] * x - counts[d]
            if error > best_error:
                best, best_error = d, error
        out_d.append(best)
        out_s.append(counts[best])
        counts[best] += 1
    dataset[start:stop] = out_d
    within[start:stop] = out_s


def _two_datasets(w: list[float], counts: list[int], start: int, stop: int, dataset: np.ndarray,
                  within: np.ndarray) -> int:
    """Steps [start, stop) (start >= 2) by the closed form while the rule agrees; returns where it
    first does not (``stop`` if nowhere)."""
    steps = np.arange(start, stop, dtype=np.int64)
    x = steps.astype(np.float64)
    proposal = (np.floor(w[0] * x) <= np.floor(w[0] * (x - 1.0))).astype(np.int16)  # 0: floor stepped up
    is0 = proposal == 0
    c0 = counts[0] + np.cumsum(is0, dtype=np.int64) - is0
    c1 = counts[1] + (steps - start) - (c0 - counts[0])
    rule = ((w[1] * x - c1) > (w[0] * x - c0)).astype(np.int16)  # ties to dataset 0
    wrong = np.flatnonzero(rule != proposal)
    good = int(wrong[0]) if len(wrong) else stop - start
    dataset[start:start + good] = proposal[:good]
    within[start:start + good] = np.where(is0, c0, c1)[:good]
    if good:
        counts[0] = int(c0[good - 1] + is0[good - 1])
        counts[1] = int(c1[good - 1] + (not is0[good - 1]))
    return start + good


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index int16, sample index within that dataset int64) for each of ``size`` samples,
    equal to megatron-core's ``helpers.build_blending_indices``."""
    w = [float(x) for x in weights]
    dataset = np.zeros(size, dtype=np.int16)
    within = np.zeros(size, dtype=np.int64)
    counts = [0] * len(w)
    if len(w) != 2:
        for lo in range(0, size, CHUNK):
            _greedy(w, counts, lo, min(size, lo + CHUNK), dataset, within)
        return dataset, within
    i = min(size, 2)
    _greedy(w, counts, 0, i, dataset, within)
    chunk = 1 << 12
    while i < size:
        stop = min(size, i + chunk)
        reached = _two_datasets(w, counts, i, stop, dataset, within)
        if reached == stop:
            chunk = min(CHUNK, chunk * 2)
        else:  # rounding made the closed form and the rule differ: a few steps by the rule
            chunk = 1 << 12
            stop = min(size, reached + 16)
            _greedy(w, counts, reached, stop, dataset, within)
        i = stop
    return dataset, within


class BlendedDataset:
    """megatron-core's ``BlendedDataset``: ``blend_size(weights, target)`` samples from ``datasets``
    (each built for ``samples_per_dataset``) in the greedy order."""

    def __init__(self, datasets: list, weights: list[float], num_samples: int):
        self.datasets, self.weights = datasets, weights
        self.dataset_index, self.sample_index = blending_indices(weights, blend_size(weights, num_samples))
        for d, n in enumerate(np.bincount(self.dataset_index, minlength=len(datasets))):
            if n > len(datasets[d]):
                raise ValueError(f"the blend asks {n} samples of dataset {d}, which has {len(datasets[d])}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[idx])][int(self.sample_index[idx])]
