"""SFT's training examples: the scorer inputs, golden future scores and candidates at each eviction step along the
golden trajectory of a trace (:func:`golden_examples`), and a store that computes them once per trace and shares
them between training runs (``sft.example_steps > 0``).

Along the golden trajectory, the cache's contents and statistics do not depend on the scorer being trained, so every
SFT run on the same traces, eviction settings and golden pooling sees the same examples; only the scorer's inputs
(key, value, attention statistics) select different columns of them. The store keeps ``example_steps`` eviction
steps per trace (drawn once per trace, seeded by its tokens), inputs in float16 and the slots' ages in tokens (for a
scorer that reads ``age``), one file per trace named by a hash of
its tokens, under ``$FORESIGHT_CACHE/golden/<key>/`` (default ``~/.cache/foresight``; the key: the model, the
settings, the pooling, the steps per trace and the seed), written atomically, so a killed run keeps what it
computed and a second SFT run (an ablation, a resumed run, the same traces merged again) computes nothing.
``sft.example_steps = 0`` keeps the old way: every step, computed in the run.

With a ``behaviour`` scorer the store follows *that scorer's* trajectory instead (top-L by its scores) and labels its
states with golden's future scores (which come from the full cache, so they apply to any state): the states a scorer
visits once its own evictions have shifted the cache, which golden's trajectory never shows it (``sft.onpolicy``, a
DAgger round). Its key includes a digest of the scorer's weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from pathlib import Path

import torch

from foresight.runtime import atomic
from foresight.config.eviction import EvictionSettings
from foresight.engine.features import AHEAD_NAMES, SCORER_INPUTS, STAT_NAMES, age_feature, heads_feature, token_age
from foresight.targets.golden import GoldenPolicy, block_pooled_attention, eviction_steps, rows_per_pass
from foresight.data.prompts import pad_rows
from foresight.data.references import stack_padded
from foresight.engine.rollout import rollout
from foresight.scorers.bank import LearnedPolicy, ScorerBank, bank_for_model

ALL_FEATURES = ("key", "value", "attn", "ahead")  # the stored layout: [key; value; statistics; ahead statistics]
MAX_ROWS = 16  # traces per batched pass when filling the store (fewer when golden's memory bound says so)


@torch.no_grad()
def golden_examples(model, input_ids: torch.Tensor, bank: ScorerBank, settings: EvictionSettings, pool: str = "mean",
                    prompt_len: int | None = None, device="cpu"):
    """Per eviction step along the golden trajectory (top-L under ``settings``): (inputs [nl,1,h,n,D],
    future [nl,1,h,n], candidates)."""
    settings = settings.replace(selection="topk")
    prefix = settings.protected_prefix(prompt_len)
    policy = GoldenPolicy(block_pooled_attention(model, input_ids, settings, pool=pool, prefix=prefix).future())
    out = []

    def rec(st):
        v = st["view"]
        out.append((bank.inputs(v).to(device), policy.future_scores(v).to(device), st["evictable"].to(device)))

    rollout(model, input_ids, policy, settings, prompt_len=prompt_len, recorder=rec)
    return out


def feature_columns(features, head_dim: int, group: int) -> list[int]:
    """The columns of the stored [key; value; statistics; ahead statistics] inputs that a scorer with ``features``
    reads, in its order (its ``heads`` and ``age`` columns are derived from the stored statistics and ages)."""
    a = 2 * head_dim + len(STAT_NAMES) * group
    spans = {"key": range(0, head_dim), "value": range(head_dim, 2 * head_dim), "attn": range(2 * head_dim, a),
             "ahead": range(a, a + len(AHEAD_NAMES) * group)}
    return [c for f in ALL_FEATURES if f in features for c in spans[f]]


@dataclasses.dataclass
class GoldenStore:
    """Stored golden examples of traces under one (model, settings, pooling, steps per trace, seed)."""

    model: object
    settings: EvictionSettings
    pool: str
    steps: int
    seed: int = 0
    behaviour: ScorerBank | None = None  # a scorer whose own (top-L) trajectory is followed instead of golden's

    def __post_init__(self):
        self.full = bank_for_model(self.model, features=ALL_FEATURES)  # assembles the inputs only
        p = next(self.model.parameters())
        blob = {"model": [str(getattr(self.model.config, "_name_or_path", "")), str(p.dtype),
                          sum(x.numel() for x in self.model.parameters())],
                "settings": self.settings.replace(selection="topk").key(),
                "pool": self.pool, "steps": self.steps, "seed": self.seed, "layout": 3}  # 3: with the ahead statistics
        if self.behaviour is not None:  # its states depend on its weights: they are part of the key
            digest = hashlib.sha256()
            for name, t in sorted(self.behaviour.state_dict().items()):
                digest.update(name.encode() + t.detach().float().cpu().numpy().tobytes())
            blob["behaviour"] = digest.hexdigest()
        key = hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:24]
        root = Path(os.environ.get("FORESIGHT_CACHE", Path.home() / ".cache" / "foresight"))
        self.folder = root / "golden" / key

    @staticmethod
    def trace_key(row: dict) -> str:
        return hashlib.sha256(json.dumps([row["prompt_len"], list(row["input_ids"])]).encode()).hexdigest()[:24]

    def path(self, row: dict) -> Path:
        return self.folder / f"trace-{self.trace_key(row)}.pt"

    def picks(self, row: dict, n_steps: int) -> list[int]:
        """The trace's stored steps among its ``n_steps`` (seeded by the trace's tokens)."""
        rng = random.Random(self.seed * 1_000_003 + int(self.trace_key(row)[:12], 16))
        return sorted(rng.sample(range(n_steps), min(self.steps, n_steps)))

    def save(self, row: dict, steps: list[int], items: list) -> dict:
        data = {"x": torch.stack([x for x, _, _, _ in items]).half(), "future": torch.stack([f for _, f, _, _ in items]),
                "cand": torch.stack([c for _, _, c, _ in items]), "age": torch.stack([a for _, _, _, a in items]),
                "steps": steps}
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic.torch_save(data, self.path(row))
        return data

    def fill(self, indices: list[int], ds, progress: bool = True) -> int:
        """Compute the missing traces of ``indices`` in batches of similar length (right-padded; a row's evictions
        are those it has alone), as many rows per pass as the golden labels' memory allows. Returns how many were
        computed."""
        todo = sorted((i for i in indices if not self.path(ds[i]).exists()), key=lambda i: len(ds[i]["input_ids"]))
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc="golden examples", disable=not progress or not todo, unit="trace")
        k = 0
        while k < len(todo):
            longest = len(ds[todo[min(k + MAX_ROWS, len(todo)) - 1]]["input_ids"])
            part = todo[k:k + min(MAX_ROWS, rows_per_pass(self.model, self.settings.interval, longest))]
            rows = [ds[i] for i in part]
            prefixes = {self.settings.protected_prefix(r["prompt_len"]) for r in rows}
            if len(prefixes) > 1:  # a protected prompt of another length: one trace at a time
                part, rows = part[:1], rows[:1]
            self.compute_batch(rows)
            bar.update(len(part))
            k += len(part)
        bar.close()
        return len(todo)

    @torch.no_grad()
    def compute_batch(self, rows: list[dict]) -> list[dict]:
        """The stored steps of ``rows`` (one right-padded golden pass and rollout), written and returned."""
        settings = self.settings.replace(selection="topk")
        prefix = settings.protected_prefix(rows[0]["prompt_len"])
        dev = next(self.model.parameters()).device
        lengths = [len(r["input_ids"]) for r in rows]
        ids, mask = pad_rows([r["input_ids"] for r in rows], 0, dev, side="right")
        pooler = block_pooled_attention(self.model, ids, settings, pool=self.pool, lengths=lengths, prefix=prefix)
        golden = GoldenPolicy(stack_padded(pooler.futures(), (1, 3)))
        policy = golden if self.behaviour is None else LearnedPolicy(self.behaviour)
        n_steps = [eviction_steps(n, prefix, settings) for n in lengths]
        if min(n_steps) == 0:
            raise ValueError(f"a trace of {lengths[n_steps.index(0)]} tokens is too short for an eviction at "
                             f"B={settings.budget}, L={settings.interval}")
        picks = [self.picks(row, n) for row, n in zip(rows, n_steps)]
        items: list[list] = [[] for _ in rows]

        def rec(st):
            need = [r for r in range(len(rows)) if st["step"] in picks[r]]
            if need:
                v = st["view"]
                x, f = self.full.inputs(v), golden.future_scores(v)  # golden's labels on whichever state
                age = token_age(v.token, v.seen).to(torch.int32)
                for r in need:
                    items[r].append((x[:, r:r + 1].half(), f[:, r:r + 1], st["evictable"][:, r:r + 1],
                                     age[:, r:r + 1]))

        rollout(self.model, ids, policy, settings, prompt_len=rows[0]["prompt_len"], attention_mask=mask, recorder=rec)
        return [self.save(row, p, it) for row, p, it in zip(rows, picks, items)]

    def compute(self, row: dict) -> dict:
        """The trace's stored steps, computed (and written) when missing."""
        p = self.path(row)
        return torch.load(p) if p.exists() else self.compute_batch([row])[0]

    def prefetch(self, rows: list[dict]) -> int:
        """Ask the kernel to read these traces' stored files ahead (``POSIX_FADV_WILLNEED``; SFT names the next
        step's traces), so that a store larger than the page cache is read from disk while the current step computes.
        Returns how many files were advised (a missing file, or a system without ``posix_fadvise``, is skipped)."""
        if not hasattr(os, "posix_fadvise"):
            return 0
        n = 0
        for row in rows:
            try:
                fd = os.open(self.path(row), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                n += 1
            finally:
                os.close(fd)
        return n

    def examples(self, row: dict, bank: ScorerBank) -> list:
        """The trace's examples as :func:`golden_examples` gives them, with the inputs ``bank`` reads."""
        data = self.compute(row)
        c = self.full
        parts = []
        for f in (f for f in SCORER_INPUTS if f in bank.features):  # the order ScorerBank.assemble puts them in
            if f == "heads":  # the slots' ages name their tokens within a step (one `seen` per step)
                logs = data["x"][..., feature_columns(("attn",), c.head_dim, c.group)].float()  # stored logged
                parts.append(heads_feature(logs, c.group, data["age"]))
            elif f == "age":
                parts.append(age_feature(data["age"]))
            else:
                parts.append(data["x"][..., feature_columns((f,), c.head_dim, c.group)].float())
        x = torch.cat(parts, dim=-1)
        return [(x[k], data["future"][k], data["cand"][k]) for k in range(x.shape[0])]
