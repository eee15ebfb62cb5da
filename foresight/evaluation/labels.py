"""The evaluation's labels (:mod:`foresight.evaluation.evaluate`): golden's futures and KVpop's oracle priorities of
each reference trace, computed once and kept for every method that needs them, and golden's passes, one rollout
along the golden trajectory serving golden's own row and the recalls of every method with the same settings."""

from __future__ import annotations

import dataclasses

import torch

from foresight.config.eviction import EvictionSettings
from foresight.config.recipe import KVpopConfig
from foresight.data.references import stack_padded
from foresight.engine.rollout import RolloutOptions, rollout
from foresight.engine.selection import top_indices, topk_overlap
from foresight.evaluation.methods import Method
from foresight.evaluation.shared_prefixes import BatchPrefixes, SharedPrefixes
from foresight.targets.golden import GoldenPolicy, block_pooled_attention
from foresight.targets.golden import eviction_steps, rows_per_pass as golden_rows_per_pass
from foresight.targets.kvpop import kvpop_oracle_priorities


class Labels:
    """Golden's futures (per trace, budget, interval and protected prefix) and KVpop's oracle priorities (per trace)
    of the references ``refs``, each computed on first use. ``golden_pool``: ``sft.golden_pool``; ``kvpop``: the
    recipe's ``kvpop`` section."""

    def __init__(self, model, refs: list[dict], golden_pool, kvpop: KVpopConfig):
        self.model, self.refs, self.golden_pool, self.kvpop = model, refs, golden_pool, kvpop
        self.futures, self.priorities = {}, {}

    def future(self, batch: dict, settings: EvictionSettings):
        """The batch's golden futures under ``settings`` (blocks after the protected prompt, if any), computed
        for the traces that lack them in batched passes and kept for the other methods."""
        B, L = settings.budget, settings.interval
        prefix = settings.protected_prefix(batch["prompt_lens"][0])
        rows = [r for r, i in enumerate(batch["members"]) if (i, B, L, prefix) not in self.futures]
        per_pass = golden_rows_per_pass(self.model, L, max(batch["lengths"]))
        for k in range(0, len(rows), per_pass):
            part = rows[k:k + per_pass]
            lengths = [batch["lengths"][r] for r in part]
            pooler = block_pooled_attention(self.model, batch["ids"][part, :max(lengths)],
                                            EvictionSettings(budget=B, interval=L), self.golden_pool,
                                            lengths=lengths, prefix=prefix)
            for r, f in zip(part, pooler.futures()):
                self.futures[(batch["members"][r], B, L, prefix)] = f
        return stack_padded([self.futures[(i, B, L, prefix)] for i in batch["members"]], (1, 3))

    def stored_future(self, trace: int, budget: int, interval: int, prefix: int):
        """Trace ``trace``'s golden future if one was computed (None otherwise: a resumed run's rows need none)."""
        return self.futures.get((trace, budget, interval, prefix))

    def priority(self, batch: dict):
        """The batch's KVpop oracle priorities (the true future-attention target under the ``kvpop`` layout)."""
        for i in batch["members"]:
            if i not in self.priorities:
                self.priorities[i] = kvpop_oracle_priorities(self.model, self.refs[i]["ids"], self.kvpop)[0]
        return stack_padded([self.priorities[i] for i in batch["members"]], (2,))


@dataclasses.dataclass
class GoldenPass:
    """One rollout along the golden trajectory: golden's own per-token losses [b, S] and pairs held [b, S], and every
    scored method's recalls: (row of the batch, recall@L, keep recall) at each golden step of each row."""

    loss: torch.Tensor
    held: torch.Tensor
    recalls: dict


def golden_pass(methods: list[Method], model, batch: dict, settings: EvictionSettings, future, seed,
                shared: BatchPrefixes | None = None) -> GoldenPass:
    """Roll the batch along the golden trajectory once; at each step, every method scores the same view (with its
    own generator) and its top-L is compared with golden's L: |method's ∩ golden's| / L over layers and heads.
    ``shared``: as :func:`foresight.evaluation.evaluate.teacher_forced`'s."""
    scored = [m for m in methods if not (m.is_full or m.teacher_forced_only or m.stateful)]
    hits = {m.name: [] for m in methods}  # a stateful scorer (KVpop mLSTM) cannot score a trajectory it did not observe
    dev = batch["ids"].device
    scorers = [(m.name, m.make_policy(), torch.Generator(device=dev).manual_seed(seed)) for m in scored]
    prefix = settings.protected_prefix(batch["prompt_lens"][0])
    steps = [eviction_steps(n, prefix, settings) for n in batch["lengths"]]

    def rec(st):
        v = st["view"]
        live = [r for r in range(len(steps)) if st["step"] < steps[r]]
        for name, pol, gen in scorers:
            v.generator = gen
            s = pol.score(v).float().masked_fill(~st["evictable"], float("-inf"))
            k = st["chosen"].shape[-1]
            overlap = topk_overlap(top_indices(s, k), st["chosen"])  # [nl, b, h]
            kept = st["evictable"].sum(-1).float() - k  # candidates golden keeps
            keep = 1 - k * (1 - overlap) / kept.clamp(min=1)  # share of golden's kept candidates the method keeps too
            per_row, keep_row = overlap.mean((0, 2)).tolist(), keep.mean((0, 2)).tolist()  # [b]
            hits[name].extend((r, per_row[r], keep_row[r]) for r in live)

    golden = GoldenPolicy(future)
    prefix = shared.get(golden, settings, batch, recording=bool(scorers)) if shared is not None else None
    res = rollout(model, batch["ids"], golden, settings, prompt_len=batch["prompt_lens"][0],
                  attention_mask=batch["mask"], recorder=rec if scorers else None,
                  options=RolloutOptions(full=(batch["loss"], batch["entropy"]), entropy=False, prefix=prefix))
    return GoldenPass(res.token_loss, res.held_per_token.cpu(), hits)


def along_golden(s: EvictionSettings) -> EvictionSettings:
    """Settings on golden's path: top-L whatever a method samples, inside the prompt too."""
    return s.replace(prompt_overflow="evict", selection="topk", temperature=1.0)


class GoldenPasses:
    """Each batch's golden pass per settings, run once for the first method that needs it: the pass serves golden's
    own row and the recalls of every pending method (not in ``done``) with the same settings along golden's path
    (only golden's own row without ``recall``)."""

    def __init__(self, model, methods: list[Method], done: dict, recall: bool, prefixes: SharedPrefixes):
        self.model, self.methods, self.done, self.recall, self.prefixes = model, methods, done, recall, prefixes
        self.passes = {}

    def get(self, m: Method, budget: int, interval: int, settings: EvictionSettings, bi: int, batch: dict, future,
            seed) -> GoldenPass:
        """Batch ``bi``'s golden pass under ``m``'s settings."""
        settings = along_golden(settings)
        key = (settings.key(), m.protect_prompt, bi)
        if key not in self.passes:
            group = [x for x in self.methods if (x.name, budget, interval) not in self.done
                     and x.protect_prompt == m.protect_prompt
                     and (self.recall or x.kind == "golden")  # without recall only golden's own row
                     and along_golden(x.settings(budget, interval, "evict")) == settings]
            self.passes[key] = golden_pass(group, self.model, batch, settings, future, seed,
                                           self.prefixes.for_batch((m.protect_prompt, bi)))
        return self.passes[key]
