"""Blending several datasets by weight (``--data-path 0.35 A 0.65 B``).

Weights are normalised to sampling probabilities. Each dataset is asked for
ceil(weight x N x 1.005) samples (Megatron's margin) and the blended order interleaves them so
that after any number of samples each dataset's share is as close to its weight as whole samples
allow: dataset d's k-th sample is placed at the ideal time (k + 0.5) / weight_d, and all samples
are sorted by that time. Vectorised (an argsort), so hundreds of datasets and tiny weights work.
"""
from __future__ import annotations

import math

import numpy as np


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
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError("--data-path: weights must be non-negative with a positive sum")
    total = sum(weights)
    return [w / total for w in weights], prefixes


def samples_per_dataset(weights: list[float], num_samples: int) -> list[int]:
    return [int(math.ceil(num_samples * w * 1.005)) for w in weights]


def blending_indices(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index, sample index within that dataset) for each of ``num_samples`` samples."""
    counts = samples_per_dataset(weights, num_samples)
    dataset = np.concatenate([np.full(c, d, dtype=np.int32) for d, c in enumerate(counts) if weights[d] > 0])
    within = np.concatenate([np.arange(c, dtype=np.int64) for d, c in enumerate(counts) if weights[d] > 0])
    w = np.asarray(weights, dtype=np.float64)[dataset]
    order = np.lexsort((dataset, (within + 0.5) / w))[:num_samples]
    return dataset[order], within[order]


class BlendedDataset:
    def __init__(self, datasets: list, weights: list[float], num_samples: int):
        self.datasets, self.weights = datasets, weights
        self.dataset_index, self.sample_index = blending_indices(weights, num_samples)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[idx])][int(self.sample_index[idx])]
