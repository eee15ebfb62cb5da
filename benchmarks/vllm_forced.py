"""Teacher forcing through vLLM: a logits processor that makes each request emit given tokens, so that with vLLM's
default ``logprobs_mode="raw_logprobs"`` (log-probabilities taken before any logits processor) and ``logprobs=0``
a request returns the model's log-probability of every forced token, computed through vLLM's own cache, the foresight
plugin's eviction included. A request forces ``SamplingParams(extra_args={"force": [token ids]})``; others are left
alone."""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality


class ForcedTokens(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory: bool):
        self.rows: dict[int, tuple[list[int], list[int]]] = {}  # batch row -> (tokens to force, tokens so far)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.rows.pop(i, None)
        for i, params, _, output in batch_update.added:
            force = (getattr(params, "extra_args", None) or {}).get("force")
            if force:
                self.rows[i] = (list(force), output)  # ``output`` is the request's live list of generated tokens
            else:
                self.rows.pop(i, None)
        for a, b, kind in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if kind == MoveDirectionality.SWAP and rb is not None:
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, (force, output) in self.rows.items():
            if len(output) < len(force):
                token = force[len(output)]
                logits[i].fill_(float("-inf"))
                logits[i, token] = 0.0
        return logits
