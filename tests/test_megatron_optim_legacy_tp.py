"""--load of a legacy ``--ckpt-format torch`` checkpoint of a TP2 x PP2 fp16 run with its optimizer state:
each ``mp_rank_TT_PPP`` file holds its own optimizer entry, indexed in its own model's parameter order.

The TP2 x PP2 files are cut here from megatron-core's TP1 x PP1 fp16 run (tests/megatron_core_optim.py,
as test_megatron_optim_legacy.py): the weights, moments and fp32 main weights each go through gptrain's
legacy writer (its per-rank files: Megatron's shards, stage-local layers, the last stage's copy of the tied
embeddings), and each rank's Float16OptimizerWithFloat16Params entry indexes its own file's parameters,
weight-decay group first as megatron-core groups them. The import joins them back to megatron-core's state.
(The grouping rule itself is checked against megatron-core at TP1; this checks the joining.)"""
from __future__ import annotations

import pytest
import torch

from test_megatron_optim import SAVED_AT, VOCAB, _gptrain_name, _megatron_core_run
from test_megatron_optim_bf16 import _load
from test_megatron_optim_legacy import LOSS_SCALE

TP, PP = 2, 2


def _model(cfg, tensors: dict, dtype) -> torch.nn.Module:
    from gptrain.model.gpt import GPT

    model = GPT(cfg).to(dtype)
    model.load_state_dict({**tensors, "output_layer.weight": tensors["word_embeddings.weight"]}, strict=False)
    return model


def _cut(megatron: torch.Tensor, out) -> None:
    """megatron-core's TP1 x PP1 fp16 checkpoint (its optimizer as gptrain imports it) as TP2 x PP2 files."""
    from gptrain.interop.megatron import read_megatron_checkpoint
    from gptrain.interop.megatron_optim import read_optimizer_state
    from gptrain.interop.megatron_write import megatron_args, write_legacy

    ckpt = read_megatron_checkpoint(megatron)
    saved = read_optimizer_state(megatron / f"iter_{SAVED_AT:07d}")
    cfg = ckpt.gpt_config(vocab_size=VOCAB)
    args = megatron_args(cfg, TP, PP, SAVED_AT, "torch", consumed_train=int(ckpt.args["consumed_train_samples"]))
    args.fp16, args.params_dtype = True, torch.float16
    kinds = {"weight": (ckpt.state, torch.float16), "main": (saved.main, torch.float32),
             **{m: ({n: s[m] for n, s in saved.moments.items()}, torch.float32) for m in ("exp_avg", "exp_avg_sq")}}
    files = {kind: write_legacy(out / kind, _model(cfg, tensors, dtype), args, SAVED_AT)
             for kind, (tensors, dtype) in kinds.items()}
    scheduler = torch.load(next(megatron.rglob("model_optim_rng.pt")), weights_only=False)["opt_param_scheduler"]
    for i, path in enumerate(files["weight"]):
        trees = {kind: torch.load(paths[i], weights_only=False)["model"] for kind, paths in files.items()}
        keys = [k for k, v in trees["weight"].items() if torch.is_tensor(v)]
        decayed = [k for k in keys if trees["weight"][k].dim() > 1 and not k.endswith(".bias")]
        groups = [decayed, [k for k in keys if k not in decayed]]
        index = {k: i for i, k in enumerate(groups[0] + groups[1])}
        state = {index[k]: {"step": torch.tensor(float(SAVED_AT)), "exp_avg": trees["exp_avg"][k],
                            "exp_avg_sq": trees["exp_avg_sq"][k]} for k in keys}
        optimizer = {"optimizer": {"state": state, "param_groups": [
                         {"wd_mult": 1.0 - g, "params": [index[k] for k in group]} for g, group in enumerate(groups)]},
                     "grad_scaler": {"scale": torch.tensor([4096.0]), "growth_tracker": 2, "hysteresis_tracker": 2},
                     "fp32_from_fp16_params": [[trees["main"][k] for k in group] for group in groups]}
        sd = torch.load(path, weights_only=False)
        target = out / "megatron" / f"iter_{SAVED_AT:07d}" / path.relative_to(out / "weight")
        target.parent.mkdir(parents=True)
        torch.save({**sd, "optimizer": optimizer, "opt_param_scheduler": scheduler}, target)
    (out / "megatron" / "latest_checkpointed_iteration.txt").write_text(str(SAVED_AT))


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("legacy_tp2_pp2")
    megatron = _megatron_core_run(root, format="torch", precision="fp16", loss_scale=LOSS_SCALE)
    _cut(megatron, root / "cut")
    return root / "cut" / "megatron", megatron


def test_each_ranks_optimizer_entry_joins_to_megatron_cores_state(tp2_pp2):
    folder, megatron = tp2_pp2
    assert sorted(p.name for p in (folder / f"iter_{SAVED_AT:07d}").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    params, optimizer, state = _load(folder, "--fp16")
    reference = torch.load(megatron / "reference.pt")["optimizer_state"]
    for megatron_name, theirs in reference.items():
        rows = VOCAB if "word_embeddings" in megatron_name else None  # the cut keeps the real rows only
        ours = params[_gptrain_name(megatron_name)]
        assert torch.equal(ours[:rows], theirs["fp32_param"][:rows]), megatron_name
        assert int(optimizer.state[ours]["step"]) == SAVED_AT
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[ours][moment][:rows], theirs[moment][:rows]), (megatron_name, moment)
    assert state["optimizer"].startswith("optimizer state imported (Float16OptimizerWithFloat16Params, --ckpt-format "
                                         "torch, TP2 x PP2: fp32 main weights, Adam's moments, step 2); loss scale 4096")
    assert state["loss_scale"]["growth_tracker"] == 2 and state["layout"].startswith("TP2 x PP2")
