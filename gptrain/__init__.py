"""gptrain: GPT pretraining that runs Megatron-LM users' scripts, faster and friendlier."""
__version__ = "0.1.0"
