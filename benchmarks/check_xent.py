"""The loss kernel that writes its gradient in the forward pass (gptrain/kernels/xent.py) on one
GPU: numerics against the fp32 reference, then its time against a compiled cross-entropy's forward
and backward on the same bf16 logits (16384 tokens x 50304 columns, 50257 of them the vocabulary).

    python benchmarks/check_xent.py
"""
import torch
import torch.nn.functional as F

from cuda_timing import cuda_ms  # benchmarks/cuda_timing.py
from gptrain.kernels import xent

ROWS, WIDTH, VOCAB = 16384, 50304, 50257



def compiled_ce(logits, labels):
    x = logits.float().masked_fill(torch.arange(WIDTH, device=logits.device) >= VOCAB, float("-inf"))
    return F.cross_entropy(x, labels)


def main():
    torch.manual_seed(0)
    logits = (torch.randn(ROWS, WIDTH, device="cuda") * 4).to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (ROWS,), device="cuda")
    loss, grad = xent.softmax_xent(logits, labels, VOCAB)
    ref_loss, ref_grad = xent._reference(logits.float(), labels, VOCAB)
    print(f"device: {torch.cuda.get_device_name()}; {ROWS} x {WIDTH} bf16 logits")
    print(f"loss max abs diff vs fp32 reference {(loss - ref_loss).abs().max().item():.2e} "
          f"(mean loss {loss.mean().item():.6f} vs {ref_loss.mean().item():.6f}); gradient max abs diff "
          f"{(grad.float() - ref_grad).abs().max().item():.2e} (bf16 rounding of values up to 1: 3.9e-03); "
          f"padding gradient max {grad[:, VOCAB:].abs().max().item()}")
    h = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(WIDTH, 1024, device="cuda", dtype=torch.bfloat16) / 32
    in_place = xent.linear_softmax_xent(h, w, labels[:4096], VOCAB)
    apart = xent.softmax_xent(h @ w.T, labels[:4096], VOCAB)
    print("gradient written over the logits (linear_softmax_xent) equals a separate buffer: "
          f"loss {torch.equal(in_place[0], apart[0])}, gradient {torch.equal(in_place[1], apart[1])}")
    ce = torch.compile(compiled_ce)
    leaf = logits.detach().requires_grad_()

    def compiled_fwd_bwd():
        ce(leaf, labels).backward()
        leaf.grad = None
    t_ours = cuda_ms(lambda: xent.softmax_xent(logits, labels, VOCAB))
    t_ref = cuda_ms(compiled_fwd_bwd)
    gb = ROWS * WIDTH * 2 / 1e9
    print(f"softmax_xent (loss + gradient): {t_ours:.3f} ms ({2 * gb / t_ours:.2f} TB/s for 1 read + 1 write)")
    print(f"compiled cross-entropy forward + backward: {t_ref:.3f} ms; ratio {t_ref / t_ours:.2f}x")


if __name__ == "__main__":
    main()
