"""The restricted unpickler's allowance for tensors saved with Python attributes: megatron-core's fp32
main copies (``fp32_from_fp16_params`` in a legacy fp16/bf16 checkpoint) carry its tensor-parallel
attributes, so ``torch.save`` writes them as ``torch._tensor._rebuild_from_type_v2(rebuild, Tensor, args,
attributes)``. Only a plain tensor or parameter is rebuilt, by a rebuilder the unpickler already allowed;
the attributes are dropped (nothing gptrain reads, and setting them would let a pickle choose names)."""
from __future__ import annotations

import torch

_TYPES = (torch.Tensor, torch.nn.Parameter)


def rebuild_from_type_v2(func, new_type, args, state):
    from gptrain.interop.safe_unpickle import UnsafeCheckpointError

    if new_type not in _TYPES:
        raise UnsafeCheckpointError(f"refuses to rebuild a tensor as {new_type!r} (only Tensor, Parameter)")
    tensor = func(*args)  # func came through the allow-list: one of the tensor rebuilders
    if not isinstance(tensor, torch.Tensor):
        raise UnsafeCheckpointError(f"a tensor rebuilder gave {type(tensor).__name__}, not a tensor")
    return tensor


TENSOR_STATE_GLOBALS = {  # (module, name) -> what the pickle gets
    ("torch._tensor", "_rebuild_from_type_v2"): rebuild_from_type_v2,
    ("torch._tensor", "Tensor"): torch.Tensor, ("torch", "Tensor"): torch.Tensor,
}
