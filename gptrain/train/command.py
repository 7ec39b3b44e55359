"""``gptrain train`` as the command line enters it: ``--help`` from the flag declarations alone (no
torch, no compiler stack: gptrain/config.py and gptrain/flags.py are plain Python), anything else
through train/run.py."""
from __future__ import annotations


def train_command(argv: list[str]) -> int:
    """``gptrain train``: its exit code."""
    if "-h" in argv or "--help" in argv:
        from gptrain.config import build_parser

        build_parser().parse_args(["--help"])  # prints the help and exits 0
    from gptrain.train.run import train_main

    return train_main(argv).exit_code
