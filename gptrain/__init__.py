"""gptrain: GPT pretraining that runs Megatron-LM users' scripts, faster and friendlier."""
import time as _time

__version__ = "0.1.0"
STARTED = _time.perf_counter()  # when the package was first imported: a command's start-up clock (start_clock.py)
