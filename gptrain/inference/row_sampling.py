"""What the fused decode loop (``rows.py``'s ``RowDecoder``, and slots.py's in-flight one over it) keeps per row of
the batch besides the model's state: each row's sampling settings on the device (temperature,
top-k, top-p and its decay, seed, the no-newline-after-colon rule), and the log-probabilities a
step records (the chosen token's, and the ``top_n`` most likely) with their way back to the host
into each ``Generation``; and a request's checks. A mixin over a loop's ``model``, ``batch`` and
``window``: a loop calls ``_init_sampling`` in its ``__init__``.
"""
from __future__ import annotations

import torch

from gptrain.inference.generate import EolIds, Generation, SamplingParams, check_request
from gptrain.inference.host_loop import set_item


class RowSampling:
    """Per-row sampling buffers and log-probability records (a decode loop's base class)."""

    def _init_sampling(self, batch: int, window: int, device: torch.device) -> None:
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, device=device, dtype=dtype)

        self.temperature, self.top_p = zeros(batch, dtype=torch.float32), zeros(batch, dtype=torch.float32)
        self.decay, self.bound = zeros(batch, dtype=torch.float32), zeros(batch, dtype=torch.float32)
        self.top_k, self.seeds = zeros(batch), zeros(batch)
        self.colon_rows = zeros(batch, dtype=torch.bool)
        self.chosen_lp = zeros(window, batch, dtype=torch.float32)  # step-major, as the ids
        self.top: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # top_n -> (values, indices)

    def _begin_request(self, prompts: list[list[int]], params: list[SamplingParams], eol: EolIds | None,
                       no_newline_after_colon: list[bool] | None) -> tuple[EolIds, list[int], list[bool]]:
        """A request's checks, with the model put in eval mode: at most ``batch`` prompts, each row's end
        (``check_request``); its eol ids, and the colon rule's flag for every row of the batch."""
        n = len(prompts)
        if not 0 < n <= self.batch:
            raise ValueError(f"{n} prompts for a decoder of {self.batch} rows")
        eol = eol or EolIds()
        self.model.eval()
        ends = check_request(prompts, params, self.window)
        colon = list(no_newline_after_colon or []) + [False] * (self.batch - len(no_newline_after_colon or []))
        return eol, ends, colon

    def _load_sampling(self, row_params: list[SamplingParams], colon: list[bool]) -> None:
        """A request's settings, one ``SamplingParams`` and one colon flag per row of the batch."""
        self.temperature.copy_(torch.tensor([p.temperature for p in row_params]))
        self.top_k.copy_(torch.tensor([p.top_k for p in row_params]))
        self.top_p.copy_(torch.tensor([p.top_p for p in row_params]))
        self.seeds.copy_(torch.tensor([p.seed for p in row_params]))
        self.decay.copy_(torch.tensor([p.top_p_decay for p in row_params]))
        self.bound.copy_(torch.tensor([p.top_p_bound for p in row_params]))
        self.colon_rows.copy_(torch.tensor(colon, dtype=torch.bool))

    def _load_row(self, row: int, params: SamplingParams, colon: bool) -> None:
        """One row's settings (a request joining a running batch, slots.py)."""
        for buf, value in ((self.temperature, params.temperature), (self.top_k, params.top_k),
                           (self.top_p, params.top_p), (self.seeds, params.seed), (self.decay, params.top_p_decay),
                           (self.bound, params.top_p_bound), (self.colon_rows, colon)):
            set_item(buf, row, value)  # not an assignment: that waits for the steps queued ahead

    def _top_buffers(self, top_n: int) -> None:
        """Buffers for the ``top_n`` most likely tokens of every step (made once per ``top_n``)."""
        if top_n and top_n not in self.top:
            window, batch = self.chosen_lp.shape
            dev = self.chosen_lp.device
            self.top[top_n] = (torch.zeros(window, batch, top_n, device=dev),
                               torch.zeros(window, batch, top_n, device=dev, dtype=torch.long))

    def _record_logprobs(self, logits: torch.Tensor, chosen: torch.Tensor, at: torch.Tensor, top_n: int) -> None:
        """On the device, at step ``at`` (a one-element tensor): the log-probability of each row's
        ``chosen`` id under ``logits`` (rows, vocabulary), and with ``top_n`` the most likely ids."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        self.chosen_lp.index_copy_(0, at, lp.gather(1, chosen[:, None]).T)
        if top_n:
            values, indices = self.top[top_n]
            top = lp.topk(top_n, dim=-1)
            values.index_copy_(0, at, top.values[None])
            indices.index_copy_(0, at, top.indices[None])

    def _append_logprobs(self, out: list[Generation], start: int, stop: int, counts: list[int],
                         top_n: int) -> None:
        """On the host: the first ``counts[i]`` of steps ``start .. stop - 1``'s records appended to
        ``out[i]``'s ``logprobs`` (and ``top_logprobs``)."""
        n = len(out)
        chosen = self.chosen_lp[start:stop, :n].double().cpu()
        if top_n:
            values, indices = self.top[top_n]
            values, indices = values[start:stop, :n].double().cpu(), indices[start:stop, :n].cpu()
        for i, g in enumerate(out):
            for j in range(counts[i]):
                g.logprobs.append(float(chosen[j, i]))
                if top_n:
                    g.top_logprobs.append({int(k): float(v) for k, v in zip(indices[j, i].tolist(),
                                                                            values[j, i].tolist())})
