"""The performance levers keep the numerics: bf16 main parameters, recompute, the fused loss, fp8,
the attention-backend flag, and ``gptrain bench`` runs and prints its table."""
import pytest
import torch

from gptrain.bench import bench_main
from gptrain.config import parse_megatron_args
from gptrain.data.gpt_dataset import MockGPTDataset
from gptrain.kernels.convert import KernelChoice
from gptrain.model import loss as loss_module
from gptrain.model.gpt import GPT
from gptrain.model.loss import LMLoss
from gptrain.parallel.parallelize import apply_recompute
from gptrain.train.build import TrainModule, build_training, parallel_dims
from gptrain.train.loop import Trainer
from gptrain.train.main_params import MainParams

from tiny import tiny_config

SMALL = dict(hidden_size=64, seq_length=32, vocab_size=1000)  # the tiny model, wider
FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --train-iters 8 --mock-data --device cpu "
         "--attention-dropout 0 --hidden-dropout 0 --seed 2").split()
# (seed 2: at lr 1e-2 memorising 4 samples, some inits (the default 1234 among them) sit where bf16
# rounding moves the 8-step trajectory by 1-2%; most stay within 0.5%)


def _model(recompute=None) -> TrainModule:
    model = GPT(tiny_config(**SMALL))
    model.init_weights(0)
    apply_recompute(model, recompute)
    return TrainModule(model, LMLoss(SMALL["vocab_size"]))


def _loss_and_grads(module, tokens):
    module.zero_grad()
    loss = module(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.model.named_parameters()}


def _trainer(cfg, data) -> Trainer:
    parts = build_training(cfg, torch.device("cpu"), parallel_dims(cfg, 1), None, log=lambda s: None)
    return Trainer(cfg, parts, data, None, None, torch.device("cpu"), log=lambda s: None)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_the_same_loss_and_gradients(mode):
    tokens = torch.randint(0, 1000, (2, 33))
    ref_loss, ref_grads = _loss_and_grads(_model(), tokens)
    loss, grads = _loss_and_grads(_model(mode), tokens)
    assert torch.equal(loss, ref_loss)
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-7), name


def test_recompute_flags_follow_megatron():
    base = FLAGS
    assert parse_megatron_args(base)[0].kernels.recompute is None
    assert parse_megatron_args(base + ["--recompute-activations"])[0].kernels.recompute == "selective"
    assert parse_megatron_args(base + ["--checkpoint-activations"])[0].kernels.recompute == "full"
    assert parse_megatron_args(base + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                       "--recompute-num-layers", "1"])[0].kernels.recompute == "full"
    with pytest.raises(ValueError, match="recompute-method"):
        parse_megatron_args(base + ["--recompute-granularity", "full", "--recompute-method", "block"])
    assert parse_megatron_args(base + ["--attention-backend", "fused"])[0].kernels.attention_backend == "fused"


def test_compiled_fused_loss_matches_plain(monkeypatch):
    """The chunk kernel under torch.compile gives the plain loss and gradients (3 chunks, a ragged last one)."""
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 1024 * 20)  # 16 tokens per chunk at padded width 1024
    h = torch.randn(40, 64, requires_grad=True)
    w = (torch.randn(1024, 64) * 0.1).requires_grad_()
    y = torch.randint(0, 1000, (40,))
    results = []
    for fused, compiled in ((False, False), (True, False), (True, True)):
        h.grad = w.grad = None
        loss = loss_module.lm_cross_entropy(h, w, y, 1000, fused=fused, compiled=compiled)
        loss.backward()
        results.append((loss.detach(), h.grad.clone(), w.grad.clone()))
    for loss, gh, gw in results[1:]:
        assert torch.allclose(loss, results[0][0], atol=1e-5)
        assert torch.allclose(gh, results[0][1], atol=1e-6) and torch.allclose(gw, results[0][2], atol=1e-6)
        assert gw[1000:].abs().max() == 0


def test_main_params_accumulate_in_fp32_and_copy_back():
    module = _model()
    model = module.model
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    main = MainParams(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(main.named()[n], v) for n, v in fp32.items())  # exact fp32 init kept
    expected = {}
    for step in range(2):
        tokens = torch.randint(0, 1000, (2, 33))
        module(tokens[:, :-1], tokens[:, 1:]).backward()
        for n, p in model.named_parameters():
            expected[n] = expected.get(n, 0) + p.grad.float()
        main.accumulate_grads()
        assert all(p.grad is None for p in model.parameters())
    for n, m in main.named().items():
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, expected[n]), n
    with torch.no_grad():
        for m in main.main:
            m.add_(1e-3)
    main.copy_to_model()
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(model.parameters(), main.main))


def _train_losses(argv, steps=8):
    """Per-step losses on 4 fixed samples (memorised quickly, so the losses move)."""
    cfg, _ = parse_megatron_args(argv)
    data = MockGPTDataset("train", 4, cfg.model.seq_length, cfg.model.vocab_size, cfg.data.seed)
    trainer = _trainer(cfg, data)
    loader = trainer.loader(data, 0)
    losses = []
    try:
        for _ in range(steps):
            before = trainer._loss_sum.item()
            trainer.train_step(loader)
            losses.append((trainer._loss_sum.item() - before))
    finally:
        loader.close()
    return trainer, losses


@pytest.mark.slow  # the fast loop (-m "not slow") stays under 3 minutes; CI runs it
def test_bf16_main_params_track_autocast_and_fp32():
    _, fp32 = _train_losses(FLAGS)
    trainer, main = _train_losses(FLAGS + ["--bf16"])
    _, autocast = _train_losses(FLAGS + ["--bf16", "--bf16-autocast"])
    assert trainer.main is not None and trainer.model.word_embeddings.weight.dtype == torch.bfloat16
    assert trainer.optimizer.param_groups[0]["params"][0].dtype == torch.float32
    # tiny micro-batches stay on torch's matmuls
    assert trainer.linear_impl.impl == "torch" and trainer.linear_impl.reason.startswith("auto: ")
    assert fp32[-1] < fp32[0] - 2
    # bf16 carries 8 bits of mantissa (0.4% per value): each step within 1% of fp32, on average within 0.25%
    for a, b, c in zip(fp32, main, autocast):
        assert abs(a - b) < 0.01 * a and abs(a - c) < 0.01 * a
    for other in (main, autocast):
        assert sum(abs(a - b) / a for a, b in zip(fp32, other)) / len(fp32) < 0.0025


@pytest.mark.slow  # the fast loop (-m "not slow") stays under 3 minutes; CI runs it
def test_fp8_converts_the_block_linears_and_trains():
    pytest.importorskip("torchao")
    trainer, losses = _train_losses(FLAGS + ["--bf16", "--fp8"])
    from torchao.float8.float8_linear import Float8Linear

    fp8 = [n for n, m in trainer.model.named_modules() if isinstance(m, Float8Linear)]
    assert trainer.fp8_layers == 8 and len(fp8) == 8 and all(n.startswith("layers.") for n in fp8)
    assert trainer.linear_impl == KernelChoice("torch", "fp8 layers do their own matmuls")
    _, bf16 = _train_losses(FLAGS + ["--bf16"])
    assert all(abs(a - b) < 0.02 * b for a, b in zip(losses, bf16)) and losses[-1] < losses[0] - 2
    with pytest.raises(ValueError, match="needs --bf16"):
        parse_megatron_args(FLAGS + ["--fp8"])


def test_bench_runs_and_prints_the_table(capsys):
    assert bench_main(FLAGS + ["--bf16", "--warmup", "1", "--iters", "2", "--baseline-no-compile"]) == 0
    out = capsys.readouterr().out
    assert "| gptrain (train step) |" in out and "| baseline (plain PyTorch, GPT-2 style) |" in out
    assert "gptrain / baseline tokens/s:" in out and "host ms/iter" in out


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16-main-params"])
def test_clipping_folded_into_adamw_matches_clip_grad_norm(precision):
    """The step divides gradients by grad_scale inside fused AdamW; the result equals Megatron's
    clip (scale by max_norm / (norm + 1e-6)) then AdamW, computed here the plain way in fp32."""
    argv = FLAGS + ["--clip-grad", "0.05", "--weight-decay", "0.1"] + precision
    cfg, _ = parse_megatron_args(argv)
    model = GPT(cfg.model)
    model.init_weights(cfg.data.seed)
    reference = TrainModule(model, LMLoss(cfg.model.vocab_size))
    data = MockGPTDataset("train", 4, cfg.model.seq_length, cfg.model.vocab_size, cfg.data.seed)
    trainer = _trainer(cfg, data)
    loader = trainer.loader(data, 0)
    try:
        trainer.train_step(loader)
    finally:
        loader.close()
    # the same step by hand, fp32
    lr = trainer.schedule.__class__.from_config(cfg.optim, cfg.train).lr()
    batch = torch.from_numpy(__import__("numpy").stack([data[i] for i in range(4)]))
    for half in (batch[:2], batch[2:]):
        (reference(half[:, :-1], half[:, 1:]) / 2).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    assert norm > 0.05  # clipping really happened
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.999), eps=1e-8)
    opt.step()
    got = trainer.opt_params
    if not precision:
        for name, p in model.named_parameters():
            assert torch.allclose(got[name], p, atol=1e-6, rtol=0), name
    else:
        # Adam's first step moves each weight by about +-lr whatever the gradient's size, so a gradient
        # near zero (the key bias's is zero in exact arithmetic) can flip with bf16 rounding: nearly
        # all weights must agree
        diff = torch.cat([(got[n] - p).abs().flatten() for n, p in model.named_parameters()])
        assert (diff < 1e-3).float().mean() > 0.97


def test_bf16_and_autocast_checkpoints_load_each_other(tmp_path):
    """Both modes save fp32 weights and optimizer moments by parameter name."""
    import torch.distributed.checkpoint as dcp

    from gptrain.train.run import train_main

    base = FLAGS[: FLAGS.index("--train-iters")] + ["--mock-data", "--device", "cpu", "--log-interval", "1",
                                                     "--eval-iters", "0"]
    lines = []
    assert train_main(base + ["--bf16", "--train-iters", "2", "--save", str(tmp_path / "a")],
                      log=lines.append).exit_code == 0
    saved = dcp.FileSystemReader(tmp_path / "a" / "iter_0000002").read_metadata().state_dict_metadata
    weights = {k: v for k, v in saved.items() if k.startswith("model/")}
    assert weights and all(v.properties.dtype == torch.float32 for v in weights.values())
    lines = []
    assert train_main(base + ["--bf16", "--bf16-autocast", "--train-iters", "3", "--load", str(tmp_path / "a"),
                              "--save", str(tmp_path / "b")], log=lines.append).exit_code == 0
    assert any("successfully loaded checkpoint" in line and "iteration 2" in line for line in lines)
    assert [line.split("/")[0].split()[-1] for line in lines if line.startswith(" iteration")] == ["3"]
    lines = []
    assert train_main(base + ["--bf16", "--train-iters", "4", "--load", str(tmp_path / "b")],
                      log=lines.append).exit_code == 0
    assert any("successfully loaded checkpoint" in line and "iteration 3" in line for line in lines)
