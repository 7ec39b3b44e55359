"""Megatron-LM's --apply-layernorm-1p (zero-centred norm weights): each LayerNorm / RMSNorm scales by 1 + its weight,
which starts at 0, so a 1p model is the plain model with every norm weight less 1; trained, it follows the plain
model's losses (norm weights take no weight decay, so Adam moves both alike); Megatron checkpoints carry the setting
both ways; Hugging Face conversion, which has no zero-centred norms, is refused in one line."""
from __future__ import annotations

import pytest
import torch

from distributed import TINY
from gptrain.interop import hf_llama, megatron_llama
from gptrain.model.gpt import GPT
from gptrain.train.run import train_main
from tiny import tiny_config

LLAMA = dict(swiglu=True, normalization="RMSNorm", position_embedding_type="rope", untie_embeddings_and_output_weights=True,
             add_bias_linear=False)


@pytest.mark.parametrize("family", [{}, LLAMA], ids=["layernorm", "rmsnorm"])
def test_a_1p_model_is_the_plain_model_with_each_norm_weight_less_one(family):
    torch.manual_seed(0)
    plain = GPT(tiny_config(**family))
    plain.init_weights(seed=3)
    with torch.no_grad():  # norm weights away from their init, so the +1 is exercised
        for name, p in plain.named_parameters():
            if p.ndim == 1 and ("ln" in name or "layernorm" in name) and name.endswith("weight"):
                p.add_(0.1 * torch.randn_like(p))
    zero_centred = GPT(tiny_config(**family, apply_layernorm_1p=True))
    state = {k: (v - 1 if v.ndim == 1 and ("ln" in k or "layernorm" in k) and k.endswith("weight") else v)
             for k, v in plain.state_dict().items()}
    zero_centred.load_state_dict(state)
    tokens = torch.randint(0, plain.cfg.vocab_size, (2, 16))
    torch.testing.assert_close(zero_centred(tokens), plain(tokens), rtol=1e-5, atol=1e-5)
    fresh = GPT(tiny_config(**family, apply_layernorm_1p=True))
    fresh.init_weights(seed=3)
    norms = [p for n, p in fresh.named_parameters() if ("ln" in n or "layernorm" in n) and n.endswith("weight")]
    assert norms and all(torch.count_nonzero(p) == 0 for p in norms)  # zero-centred: a scale of 1


def test_the_scale_is_taken_in_fp32_under_bf16():
    norm = GPT(tiny_config(**LLAMA, apply_layernorm_1p=True)).final_layernorm.to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.fill_(0.003)  # 1.003 rounds to 1.0 in bf16
    x = torch.randn(4, norm.weight.shape[0]).to(torch.bfloat16)
    want = (torch.nn.functional.rms_norm(x.float(), norm.normalized_shape, eps=norm.eps) * 1.003).to(torch.bfloat16)
    assert norm(x).dtype == torch.bfloat16 and torch.equal(norm(x), want)


@pytest.mark.parametrize("family", [[], ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear"]],
                         ids=["layernorm", "rmsnorm"])
def test_training_follows_the_plain_models_losses(family):
    run = TINY + ["--train-iters", "4"] + family
    plain = train_main(run, log=lambda s: None)
    zero_centred = train_main(run + ["--apply-layernorm-1p"], log=lambda s: None)
    assert plain.exit_code == zero_centred.exit_code == 0 and len(plain.train_losses) == 4
    for (it, a), (_, b) in zip(plain.train_losses, zero_centred.train_losses):
        assert b == pytest.approx(a, rel=1e-5), it


def test_megatron_checkpoints_carry_it_and_hugging_face_conversion_refuses_it():
    assert megatron_llama.family({"apply_layernorm_1p": True})["apply_layernorm_1p"] is True
    # Megatron-LM's args since the flag became TransformerConfig's field
    assert megatron_llama.family({"layernorm_zero_centered_gamma": True})["apply_layernorm_1p"] is True
    assert megatron_llama.family({})["apply_layernorm_1p"] is False
    cfg = tiny_config(**LLAMA, apply_layernorm_1p=True)
    written = megatron_llama.writer_args(cfg)
    assert written["apply_layernorm_1p"] is written["layernorm_zero_centered_gamma"] is True
    assert not cfg.gpt2_layout  # the fused GPT-2 decode kernels read plain LayerNorm weights
    assert any("--apply-layernorm-1p" in p for p in hf_llama.llama_problems(cfg))


def test_loading_a_checkpoint_of_the_other_kind_is_refused():
    from gptrain.config import parse_megatron_args
    from gptrain.train.megatron_load import check_family

    cfg, _ = parse_megatron_args(TINY + ["--train-iters", "1"], world_size=1)
    with pytest.raises(ValueError, match="--apply-layernorm-1p: the run has apply_layernorm_1p False, ckpt implies True"):
        check_family(tiny_config(apply_layernorm_1p=True), cfg, "ckpt")
