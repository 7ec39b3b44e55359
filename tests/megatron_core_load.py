"""megatron-core's own GPTModel (local layer spec, CPU, fp32) loading checkpoints at tensor parallel TP
x pipeline parallel PP (TP x PP gloo processes), and its logits for some tokens: the reference a test
compares gptrain's against.

    python tests/megatron_core_load.py TP PP TOKENS.pt OUT.pt ITER_FOLDER [ITER_FOLDER ...]

Each ITER_FOLDER is a checkpoint's ``iter_XXXXXXX`` folder: torch_dist, loaded through
``dist_checkpointing.load(model.sharded_state_dict(), folder)``, or the legacy format, each rank's
``mp_rank_TT[_PPP]/model_optim_rng.pt`` through ``torch.load`` (weights only, with the safe globals
megatron-core registers) and ``load_state_dict(strict=True)``, as Megatron-LM loads them. With PP > 1
each stage builds its part (``pre_process``/``post_process``) and the hidden states go from stage to
stage. TOKENS.pt is a saved [batch, seq] long tensor; OUT.pt receives, per folder, the gathered
logits [batch, seq, padded vocab] (fp32) and the keys. The architecture comes from the first folder's
``common.pt`` args, as Megatron-LM's --use-checkpoint-args takes it.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import warnings
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, tp: int, pp: int, port: int, folders: list[str], tokens_path: str, out_path: str) -> None:
    warnings.simplefilter("ignore")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp * pp)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import GlobalMemoryBuffer

    # the CUDA calls on this path, on the CPU: rope's inv_freq, the attention's scratch buffer (baddbmm with beta 0), the
    # CUDA RNG fork around its dropout (probability 0, and the model is in eval mode) and, with PP > 1,
    # the all-reduce that makes the last stage's copy of the embeddings the first's at construction
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: "cpu"  # rope's inv_freq moves to "the GPU" at the first forward
    GlobalMemoryBuffer.get_tensor = lambda self, shape, dtype, name, mem_alloc_context=None: torch.empty(
        shape, dtype=dtype)
    CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    common = Path(folders[0]) / "common.pt"  # torch_dist; a legacy folder's args are in its first rank's file
    common = common if common.is_file() else next(Path(folders[0]).glob("mp_rank_00*/model_optim_rng.pt"))
    args = torch.load(common, map_location="cpu")["args"]  # megatron-core's safe globals
    parallel_state.initialize_model_parallel(tp, pp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    first, last = pp_rank == 0, pp_rank == pp - 1
    swiglu = getattr(args, "swiglu", False)
    llama = dict(  # the Llama-family args as Megatron-LM's core_transformer_config_from_args maps them
        normalization=getattr(args, "normalization", "LayerNorm"), add_bias_linear=getattr(args, "add_bias_linear", True),
        add_qkv_bias=getattr(args, "add_qkv_bias", False), kv_channels=getattr(args, "kv_channels", None),
        num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else None)
    if swiglu:  # SwiGLU has no GELU fusion; F.silu gated, as --swiglu sets it
        llama.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False)
    else:
        llama.update(bias_activation_fusion=True)  # Megatron-LM's default --bias-gelu-fusion: the tanh GELU
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, layernorm_epsilon=args.norm_epsilon, init_method_std=0.02,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, **llama)
    position = getattr(args, "position_embedding_type", "learned_absolute")
    rope = dict(rotary_base=args.rotary_base, rotary_percent=args.rotary_percent) if position == "rope" else {}
    spec = get_gpt_layer_local_spec(normalization=cfg.normalization)
    model = GPTModel(cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, position_embedding_type=position,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     parallel_output=True, pre_process=first, post_process=last, **rope)
    tokens = torch.load(tokens_path)
    batch, seq = tokens.shape
    positions = torch.arange(seq).expand_as(tokens)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)  # True: masked
    results = []
    for folder in folders:
        name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
        legacy = Path(folder) / name / "model_optim_rng.pt"
        if legacy.is_file():  # --ckpt-format torch: Megatron-LM's load_state_dict(strict=True) of its rank's file
            saved = torch.load(legacy, map_location="cpu")
            model.load_state_dict(saved["model"], strict=True)
            keys, missing, unexpected = sorted(saved["model"]), [], []
        else:
            sharded = model.sharded_state_dict()
            keys = sorted({v.unique_key if type(v).__name__ == "ShardedObject" else v.key for v in sharded.values()})
            loaded = dist_checkpointing.load(sharded, Path(folder))
            missing, unexpected = model.load_state_dict(loaded, strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
        with torch.no_grad():
            if not first:  # the previous stage's hidden states [seq, batch, hidden]
                hidden = torch.empty(seq, batch, args.hidden_size)
                dist.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(hidden)
            out = model.eval()(tokens, positions, mask)
            if not last:
                dist.send(out.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
        if last and tp > 1:  # the vocabulary-parallel shards of the logits, in rank order
            shards = [torch.empty_like(out) for _ in range(tp)]
            dist.all_gather(shards, out.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
            out = torch.cat(shards, dim=-1)
        results.append({"logits": out.float() if last else None, "keys": keys, "missing": missing,
                        "unexpected": list(unexpected)})
        for p in model.parameters():  # the next folder must load every value itself
            p.data.fill_(float("nan"))
    if last and tp_rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    tp, pp, tokens_path, out_path, folders = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4:]
    if tp * pp == 1:
        _worker(0, 1, 1, _free_port(), folders, tokens_path, out_path)
        return
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(tp, pp, _free_port(), folders, tokens_path, out_path), nprocs=tp * pp, join=True)


if __name__ == "__main__":
    main(sys.argv[1:])
