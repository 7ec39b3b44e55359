"""The device a command runs on: the one named (``--device``), else CUDA where present, else the CPU."""
from __future__ import annotations

import torch


def pick_device(name: str | None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
