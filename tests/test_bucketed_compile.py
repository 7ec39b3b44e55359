"""--overlap-grad-reduce's compiled step (parallel/bucketed_compile.py): the whole step through one
torch.compile, cut by DDPOptimizer where about a bucket of parameters ends, gives the eager step's
loss and gradients, and its backward is one autograd node per cut graph (so the last layers'
gradients reach their hooks, and their all-reduce starts, while the first layers' backward runs),
where the plain compile's is one node for the whole step."""
from __future__ import annotations

import copy

import pytest
import torch

from model_parity import tiny_train_module


def compiled_nodes(loss: torch.Tensor) -> int:
    """The compiled graphs' backward nodes in ``loss``'s autograd graph."""
    seen, stack, count = set(), [loss.grad_fn], 0
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        count += "CompiledFunction" in type(fn).__name__
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return count


@pytest.mark.slow  # Inductor compiles on CPU
def test_the_cut_step_equals_eager_and_hands_gradients_over_in_parts():
    from gptrain.parallel.bucketed_compile import compile_in_buckets

    eager = tiny_train_module(seed=3)
    whole, cut = copy.deepcopy(eager), copy.deepcopy(eager)
    block_bytes = sum(p.numel() * p.element_size() for p in eager.model.layers["0"].parameters())
    step = compile_in_buckets(cut, None, block_bytes)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = (tokens, torch.roll(tokens, -1, 1), torch.ones(2, 16))
    loss = step(*batch)
    assert compiled_nodes(loss) == len(step.splitter.buckets) >= 3  # 2 blocks, the embeddings and head
    assert compiled_nodes(torch.compile(whole)(*batch)) == 1
    loss.backward()
    reference = eager(*batch)
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(cut.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
