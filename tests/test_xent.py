"""The loss that writes its own gradient in the forward pass (kernels/xent.py, model/loss.py): its
CPU path (the reference the Triton kernel is checked against in benchmarks/check_xent.py) against
autograd through F.cross_entropy, and the tuned output layer + loss against the plain ones."""
import torch
import torch.nn.functional as F

from gptrain.kernels.xent import linear_softmax_xent, softmax_xent
from gptrain.model import loss as loss_module
from gptrain.model.loss import lm_cross_entropy


def test_per_token_loss_and_gradient_match_autograd_with_padding_masked():
    torch.manual_seed(0)
    vocab, width = 37, 48  # 11 padding columns
    logits = torch.randn(9, width, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (9,))
    loss, grad = softmax_xent(logits.detach(), labels, vocab)
    ref = F.cross_entropy(logits[:, :vocab], labels, reduction="none")
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(loss, ref.float())
    torch.testing.assert_close(grad, ref_grad)
    assert grad[:, vocab:].abs().max() == 0 and grad.dtype == logits.dtype
    torch.library.opcheck(softmax_xent, (logits.detach().float(), labels, vocab))


def test_tuned_head_loss_equals_plain_and_scales_with_incoming_gradient():
    torch.manual_seed(1)
    h = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 33, (2, 5))
    results = []
    for tuned in (False, True):
        loss = lm_cross_entropy(h, w, labels, 33, fused=False, tuned=tuned)
        results.append((loss, *torch.autograd.grad(loss * 2.5, [h, w])))  # e.g. a loss scale
    (plain, plain_h, plain_w), (ours, our_h, our_w) = results
    torch.testing.assert_close(ours, plain.float(), rtol=1e-6, atol=0, check_dtype=False)
    torch.testing.assert_close(our_h, plain_h)
    torch.testing.assert_close(our_w, plain_w)
    assert our_w[33:].abs().max() == 0  # padding rows of the output layer get no gradient
    with torch.no_grad():  # evaluation takes the plain path: no gradient to write
        torch.testing.assert_close(lm_cross_entropy(h, w, labels, 33, fused=False, tuned=True), plain)


def test_tuned_head_takes_the_forward_pass_gradient_except_in_fp16(monkeypatch):
    calls = []
    monkeypatch.setattr(loss_module._TunedHeadCrossEntropy, "apply",
                        lambda *args: calls.append(args[0].dtype) or torch.zeros((), requires_grad=True))
    labels = torch.randint(0, 33, (4,))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        h = torch.randn(4, 16, dtype=dtype, requires_grad=True)
        w = torch.randn(40, 16, dtype=dtype, requires_grad=True)
        lm_cross_entropy(h, w, labels, 33, fused=False, tuned=True)
    assert calls == [torch.float32, torch.bfloat16]


def test_linear_softmax_xent_equals_matmul_then_softmax_xent():
    torch.manual_seed(2)
    h, w = torch.randn(6, 8), torch.randn(24, 8)
    labels = torch.randint(0, 20, (6,))
    loss, grad = linear_softmax_xent(h, w, labels, 20)
    ref_loss, ref_grad = softmax_xent(h @ w.T, labels, 20)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    torch.library.opcheck(linear_softmax_xent, (h, w, labels, 20))
