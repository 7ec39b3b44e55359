"""A tiny GPT run twice, plain and on custom ops, for tests that the ops change nothing."""
import pytest
import torch

from gptrain.model.gpt import GPT
from tiny import tiny_config
from gptrain.model.loss import LMLoss
from gptrain.train.build import TrainModule

TINY = tiny_config(seq_length=16, vocab_size=100)


def tiny_train_module(seed: int = 7) -> TrainModule:
    model = GPT(TINY)
    model.init_weights(seed)
    return TrainModule(model, LMLoss(TINY.vocab_size))


def assert_ops_change_nothing(switch_on) -> None:
    """Loss and every gradient of the plain eager model equal those of the model after
    ``switch_on(model, loss)``, compiled (the custom ops must trace through their fake implementations)."""
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, 1)
    losses, grads = [], []
    for ours in (False, True):
        module = tiny_train_module()
        if ours:
            switch_on(module.model, module.loss)
        loss = (torch.compile(module) if ours else module)(tokens, labels)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in module.model.named_parameters()})
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)
