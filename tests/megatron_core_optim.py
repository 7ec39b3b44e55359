"""A Megatron-LM torch_dist checkpoint with optimizer state, written by megatron-core itself (CPU, one
gloo process): the reference the optimizer import is tested against.

    python tests/megatron_core_optim.py OUT_ROOT SAMPLES.npy CONFIG.json

CONFIG.json: the model (gptrain GPTConfig fields) and the run (lr, min_lr, warmup/decay iterations,
decay style, weight decay, clip_grad, global batch, iterations to save after; optional "tp", "pp": the
tensor- and pipeline-parallel sizes (tp x pp gloo processes, spawned; default 1; pp > 1 trains through
megatron-core's 1F1B schedule as Megatron-LM's train_step does); optional "precision": fp32,
bf16 or fp16 (then "loss_scale": {initial_loss_scale, loss_scale_window, hysteresis} for its
DynamicGradScaler), "distributed": the distributed optimizer's sharding type, as Megatron-LM's
_build_sharded_state_dict_metadata passes it, default none: no distributed optimizer; "format": torch_dist
(default) or torch, Megatron-LM's legacy --ckpt-format). SAMPLES.npy: the
[iterations + 1 x global batch, seq + 1] token ids training reads (gptrain's `data samples`).

As Megatron-LM's pretrain_gpt.py runs a one-process job: megatron-core's GPTModel (local spec; bf16: inside
Float16Module, gradients accumulated in fp32 as Megatron-LM's --bf16 forces; fp16: the same module,
gradients in fp16 as Megatron-LM's default) inside its
DistributedDataParallel, `get_megatron_optimizer` (a ChainedOptimizer holding one FP32Optimizer, or
Float16OptimizerWithFloat16Params for bf16/fp16, or DistributedOptimizer, over torch's AdamW: no apex/TE
here), its OptimizerParamScheduler in samples; each
iteration is one micro-batch of the global batch, loss = the mean of the per-token losses. After
`iterations` it saves as megatron/training/checkpointing.py does (generate_state_dict's keys,
dist_checkpointing.save, iter_XXXXXXX and the tracker; the torch format: the model's
state_dict_for_save_checkpoint and the optimizer's state_dict in mp_rank_00/model_optim_rng.pt). Then it
runs one more iteration and writes OUT_ROOT/reference.pt: the optimizer state at the save (per parameter
name), the lr that iteration used, the main (fp32) weights after it and an fp16 run's grad scaler's state
at the save and after the next iteration. At TP/PP > 1 each rank's per-parameter state is joined as
megatron-core shards it (concatenated on the parameter's partition_dim, replicated ones from TP rank 0,
stage-local layers numbered globally, the last stage's tied-embedding copy left out).
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
    torch.cuda.default_stream = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing waits for device copies
    GlobalMemoryBuffer.get_tensor = lambda self, shape, dtype, name, mem_alloc_context=None: torch.empty(
        shape, dtype=dtype)
    CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    tensor_type = torch.Tensor.type  # clip_grads asserts its gradients are 'torch.cuda.FloatTensor'
    torch.Tensor.type = lambda self, *a, **k: tensor_type(self, *a, **k) if a or k else \
        tensor_type(self).replace("torch.", "torch.cuda.", 1)
    torch.cuda.Stream = lambda *a, **k: None  # DDP's communication stream (unused without overlap)
    for name in ("tensor", "zeros", "ones", "empty", "full"):  # optimizers' scale, clip_grads', DDP's buffers
        factory = getattr(torch, name)

        def on_cpu(*a, _factory=factory, **k):
            if str(k.get("device", "")).startswith("cuda") or isinstance(k.get("device"), int):
                k["device"] = "cpu"
            return _factory(*a, **k)
        setattr(torch, name, on_cpu)


def _main_state(optimizer, param) -> dict:
    """The optimizer's state of one model parameter at its shape: fp32_param (the main weights), the
    moments, step (megatron-core's FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer)."""
    import torch

    if hasattr(optimizer, "_get_main_param_and_optimizer_states"):  # the distributed optimizer: flat shards
        state = dict(optimizer._get_main_param_and_optimizer_states(param))
        main = state.pop("param")
    else:
        main = getattr(param, "main_param", param)
        state = dict(optimizer.optimizer.state[main])
    out = {k: v.detach().clone().view(param.shape if v.numel() == param.numel() else v.shape)
           if torch.is_tensor(v) else v for k, v in state.items()}
    out["fp32_param"] = main.detach().clone().view(param.shape)
    return out


def _global_name(name: str, offset: int) -> str:
    parts = name.split(".")
    if name.startswith("decoder.layers."):
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def _joined(dist, world: int, model, state: dict, offset: int) -> dict:
    """Per parameter (global layer numbers), every rank's tensors joined as megatron-core shards the
    parameter (its own tensor_model_parallel / partition_dim attributes), on rank 0; the rest of ``state``
    is the first holder's. The last stage's tied-embedding copy (output_layer.weight) is left out."""
    import torch

    params = dict(model.named_parameters())
    mine = {_global_name(n, offset): (params[n].partition_dim if getattr(params[n], "tensor_model_parallel", False)
                                      else None, v) for n, v in state.items() if n != "output_layer.weight"}
    if world == 1:
        return {n: v for n, (_, v) in mine.items()}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    out = {}
    for name in dict.fromkeys(n for r in ranks for n in r):
        dim, first = next(r[name] for r in ranks if name in r)
        parts = [r[name][1] for r in ranks if name in r]

        def join(pieces):
            return torch.cat(pieces, dim=dim) if dim is not None else pieces[0]
        out[name] = {k: join([p[k] for p in parts]) if torch.is_tensor(v) and v.dim() else v
                     for k, v in first.items()} if isinstance(first, dict) else join(parts)
    return out


def _pipeline_step(model, optimizer, batch, positions, mask, seq: int) -> None:
    """Megatron-LM's train_step at PP > 1: one micro-batch through megatron-core's 1F1B schedule (the
    model's grads finalized there: DP sync and the tied embeddings' all-reduce between the end stages)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = model.config
    config.grad_scale_func, config.no_sync_func = optimizer.scale_loss, model.no_sync
    config.finalize_model_grads_func = finalize_model_grads

    def forward_step(data_iterator, m):
        tokens = next(data_iterator)
        losses = m(tokens[:, :-1], positions, mask, labels=tokens[:, 1:])
        return losses, lambda out: (out.float().mean(), {"lm loss": out.float().mean().detach()})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]), model=[model],
                                num_microbatches=1, seq_length=seq, micro_batch_size=batch.shape[0])


def main(out_root: str, samples_path: str, config_path: str) -> None:
    warnings.simplefilter("ignore")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    run = json.loads(Path(config_path).read_text())
    tp, pp = int(run.get("tp", 1)), int(run.get("pp", 1))
    if tp * pp == 1:
        _rank(0, 1, 1, out_root, samples_path, config_path)
    else:
        import torch.multiprocessing as mp

        mp.spawn(_rank, args=(tp, pp, out_root, samples_path, config_path), nprocs=tp * pp)


def _rank(rank: int, tp: int, pp: int, out_root: str, samples_path: str, config_path: str) -> None:
    warnings.simplefilter("ignore")
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(1234)
    dist.init_process_group("gloo", rank=rank, world_size=tp * pp)
    _cpu_only(torch)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gptrain.interop.megatron_write import megatron_args
    from gptrain.model.gpt import GPTConfig

    run = json.loads(Path(config_path).read_text())
    gcfg = GPTConfig(**run["model"])
    gbs, iterations = run["global_batch"], run["iterations"]
    bf16, fp16, sharding = run.get("precision") == "bf16", run.get("precision") == "fp16", run.get("distributed")
    half = torch.bfloat16 if bf16 else torch.float16 if fp16 else None
    legacy = run.get("format", "torch_dist") == "torch"
    samples = torch.from_numpy(np.load(samples_path))
    parallel_state.initialize_model_parallel(tp, pp)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    cfg = TransformerConfig(
        num_layers=gcfg.num_layers, hidden_size=gcfg.hidden_size, num_attention_heads=gcfg.num_attention_heads,
        ffn_hidden_size=gcfg.ffn_hidden_size, layernorm_epsilon=gcfg.layernorm_epsilon, init_method_std=0.02,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16, fp16=fp16,
        params_dtype=half or torch.float32, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=half or torch.float32,
        bias_activation_fusion=True)  # Megatron-LM's default --bias-gelu-fusion: the tanh GELU
    args = megatron_args(gcfg, tp, pp, iterations, "torch" if legacy else "torch_dist")
    args.bf16, args.fp16, args.params_dtype = bf16, fp16, cfg.params_dtype
    args.use_distributed_optimizer = sharding is not None
    model = GPTModel(cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                     max_sequence_length=gcfg.max_position_embeddings, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=True, parallel_output=True,
                     pre_process=first, post_process=last)
    megatron_model = model
    if half is not None:
        model = Float16Module(cfg, model)
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=bf16, use_distributed_optimizer=sharding is not None), model)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=run["lr"], min_lr=run["min_lr"], weight_decay=run["weight_decay"],
                              adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=run["clip_grad"],
                              bf16=bf16, fp16=fp16, params_dtype=cfg.params_dtype,
                              use_distributed_optimizer=sharding is not None, **run.get("loss_scale", {}))
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
        if pp > 1:
            _pipeline_step(model, optimizer, batch, positions, mask, seq)
        else:
            losses = model(batch[:, :-1], positions, mask, labels=batch[:, 1:])  # [batch, seq] per-token losses
            optimizer.scale_loss(losses.float().mean()).backward()  # fp16: times the loss scale (schedules.py)
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
    if sharding is not None:
        metadata["distrib_optim_sharding_type"] = sharding
    model_sd = megatron_model.sharded_state_dict(metadata=metadata)  # save_checkpoint unwraps the model
    if legacy:  # generate_state_dict without dist ckpt
        state_dict["model"] = megatron_model.state_dict_for_save_checkpoint()
        state_dict["optimizer"] = optimizer.state_dict()
    else:
        state_dict["model"] = model_sd
        state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata=metadata)
    state_dict["opt_param_scheduler"] = scheduler.state_dict()
    state_dict["num_floating_point_operations_so_far"] = 0
    root = Path(out_root)
    folder = root / f"iter_{iterations:07d}"
    if rank == 0:
        folder.mkdir(parents=True)
    dist.barrier()
    if legacy:
        assert tp == 1, "the legacy format is written at TP1 only"
        (folder / "mp_rank_00").mkdir()
        torch.save(state_dict, folder / "mp_rank_00" / "model_optim_rng.pt")
    else:
        dist_checkpointing.save(state_dict, str(folder), content_metadata={"singleton_local_shards": False,
                                                                           "chained_optim_avoid_prefix": True})
    if rank == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(iterations))

    inner = optimizer.chained_optimizers[0]
    offset = parallel_state.get_pipeline_model_parallel_rank() * gcfg.num_layers // pp  # its first layer
    saved = _joined(dist, tp * pp, megatron_model,
                    {n: _main_state(inner, p) for n, p in megatron_model.named_parameters()}, offset)
    scaler = getattr(inner, "grad_scaler", None)
    scales = [dict(scaler.state_dict())] if scaler is not None else []
    lr = train_step(iterations)
    weights = _joined(dist, tp * pp, megatron_model,
                      {n: _main_state(inner, p)["fp32_param"] for n, p in megatron_model.named_parameters()}, offset)
    scales += [dict(scaler.state_dict())] if scaler is not None else []
    if rank == 0:
        torch.save({"optimizer_state": saved, "next_lr": lr, "weights_after_next": weights,
                    "grad_scaler": scales}, root / "reference.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
