"""A Megatron-LM torch_dist checkpoint with optimizer state, written by megatron-core itself (CPU, one
gloo process, fp32): the reference the optimizer import is tested against.

    python tests/megatron_core_optim.py OUT_ROOT SAMPLES.npy CONFIG.json

CONFIG.json: the model (gptrain GPTConfig fields) and the run (lr, min_lr, warmup/decay iterations,
decay style, weight decay, clip_grad, global batch, iterations to save after). SAMPLES.npy: the
[iterations + 1 x global batch, seq + 1] token ids training reads (gptrain's `data samples`).

As Megatron-LM's pretrain_gpt.py runs a non-distributed fp32 job: megatron-core's GPTModel (local
spec) inside its DistributedDataParallel, `get_megatron_optimizer` (a ChainedOptimizer holding one
FP32Optimizer over torch's AdamW: no apex/TE here), its OptimizerParamScheduler in samples; each
iteration is one micro-batch of the global batch, loss = the mean of the per-token losses. After
`iterations` it saves as megatron/training/checkpointing.py does (generate_state_dict's keys,
dist_checkpointing.save, iter_XXXXXXX and the tracker). Then it runs one more iteration and writes
OUT_ROOT/reference.pt: the optimizer state at the save (per parameter name), the lr that iteration
used and the weights after it.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import warnings
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_only(torch) -> None:
    """megatron-core's CUDA calls on this path, on the CPU (a reference run, not gptrain's code)."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.utils import GlobalMemoryBuffer

    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing waits for device copies
    GlobalMemoryBuffer.get_tensor = lambda self, shape, dtype, name, mem_alloc_context=None: torch.empty(
        shape, dtype=dtype)
    CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    tensor_type = torch.Tensor.type  # clip_grads asserts its gradients are 'torch.cuda.FloatTensor'
    torch.Tensor.type = lambda self, *a, **k: tensor_type(self, *a, **k) if a or k else \
        tensor_type(self).replace("torch.", "torch.cuda.", 1)
    for name in ("tensor", "zeros", "ones", "empty", "full"):  # FP32Optimizer's scale, clip_grads' buffers
        factory = getattr(torch, name)

        def on_cpu(*a, _factory=factory, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return _factory(*a, **k)
        setattr(torch, name, on_cpu)


def main(out_root: str, samples_path: str, config_path: str) -> None:
    warnings.simplefilter("ignore")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(1234)
    dist.init_process_group("gloo", rank=0, world_size=1)
    _cpu_only(torch)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gptrain.interop.megatron_write import megatron_args
    from gptrain.model.gpt import GPTConfig

    run = json.loads(Path(config_path).read_text())
    gcfg = GPTConfig(**run["model"])
    gbs, iterations = run["global_batch"], run["iterations"]
    samples = torch.from_numpy(np.load(samples_path))
    parallel_state.initialize_model_parallel(1, 1)
    cfg = TransformerConfig(
        num_layers=gcfg.num_layers, hidden_size=gcfg.hidden_size, num_attention_heads=gcfg.num_attention_heads,
        ffn_hidden_size=gcfg.ffn_hidden_size, layernorm_epsilon=gcfg.layernorm_epsilon, init_method_std=0.02,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        bias_activation_fusion=True)  # Megatron-LM's default --bias-gelu-fusion: the tanh GELU
    args = megatron_args(gcfg, 1, 1, iterations, "torch_dist")
    model = GPTModel(cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                     max_sequence_length=gcfg.max_position_embeddings, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=True, parallel_output=True)
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), model)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=run["lr"], min_lr=run["min_lr"], weight_decay=run["weight_decay"],
                              adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=run["clip_grad"],
                              use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(opt_cfg, [model])
    # Megatron-LM's get_optimizer_param_scheduler for iteration-based runs: steps are samples
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=run["lr"], min_lr=run["min_lr"], lr_warmup_steps=run["warmup_iters"] * gbs,
        lr_decay_steps=run["decay_iters"] * gbs, lr_decay_style=run["decay_style"], start_wd=run["weight_decay"],
        end_wd=run["weight_decay"], wd_incr_steps=run["decay_iters"] * gbs, wd_incr_style="constant")
    seq = samples.shape[1] - 1
    positions = torch.arange(seq).expand(gbs, seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)

    def train_step(i: int) -> float:
        batch = samples[i * gbs:(i + 1) * gbs]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = model(batch[:, :-1], positions, mask, labels=batch[:, 1:])  # [batch, seq] per-token losses
        losses.float().mean().backward()
        model.finish_grad_sync()
        lr = optimizer.param_groups[0]["lr"]
        ok, _, _ = optimizer.step()
        assert ok
        scheduler.step(increment=gbs)
        return lr

    for i in range(iterations):
        train_step(i)
    args.consumed_train_samples = iterations * gbs
    state_dict = {"args": args, "checkpoint_version": 3.0, "iteration": iterations}
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    model_sd = model.module.sharded_state_dict(metadata=metadata)  # save_checkpoint unwraps the DDP model
    state_dict["model"] = model_sd
    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata=metadata)
    state_dict["opt_param_scheduler"] = scheduler.state_dict()
    state_dict["num_floating_point_operations_so_far"] = 0
    root = Path(out_root)
    folder = root / f"iter_{iterations:07d}"
    folder.mkdir(parents=True)
    dist_checkpointing.save(state_dict, str(folder), content_metadata={"singleton_local_shards": False,
                                                                       "chained_optim_avoid_prefix": True})
    (root / "latest_checkpointed_iteration.txt").write_text(str(iterations))

    names = {p: n for n, p in model.module.named_parameters()}
    saved = {names[p]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for p, s in optimizer.chained_optimizers[0].optimizer.state.items()}
    lr = train_step(iterations)
    weights = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "names": [names[p] for p in g["params"]]}
              for g in optimizer.param_groups]
    torch.save({"optimizer_state": saved, "next_lr": lr, "weights_after_next": weights, "param_groups": groups},
               root / "reference.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
