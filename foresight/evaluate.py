"""``foresight eval``: every method on the same held-out problems, the same traces and the same engine.

For each (method, budget B:L) it reports, on ``eval.num_problems`` held-out problems:

* ``loss_ratio`` — Σ NLL of the solution tokens under eviction / Σ NLL with the full cache, teacher-forced on
  the model's own full-cache traces of those problems (paper Table 2);
* ``low_entropy_loss_increase`` / ``high_entropy_loss_increase`` — mean per-token loss increase after the first
  eviction on the lowest-80%-entropy tokens and on the rest (paper Table 1);
* ``accuracy`` — task accuracy of generation under eviction, pass@1 averaged over ``eval.n_samples`` seeded
  samples (avg@n; one greedy sample when ``eval.do_sample`` is false), by the task's checker;
* ``recall_at_L`` — overlap of the method's L evictions with Golden Eviction's along the golden trajectory;
* ``mean_cache`` — mean pairs held per (sequence, layer, KV head) over the teacher-forced traces.

Methods: ``full``, ``golden`` (teacher-forced only: it needs the future), ``kvpop-oracle`` (KVpop's teacher: the
true future-attention target under the recipe's ``kvpop`` layout; teacher-forced only), the heuristics of
:mod:`foresight.policies`, ``random-keep-prompt`` (random eviction with the prompt protected), and each ``--scorers
DIR`` (named ``foresight-<stage>``, or ``kvpop-<scorer>`` for KVpop checkpoints). ``eval.protect_prompt=true``
protects the prompt for every method; the tables say which rows did. Outputs in OUT: ``results.json``,
``results.md``, ``accuracy.png``, ``loss_ratio.png`` and ``eviction_map.png``. Everything is seeded: the same
command gives the same numbers.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

import torch

from foresight import prompts
from foresight.checkpoint import load_scorer, method_name, policy_from_checkpoint, record_eval
from foresight.config import EvictionSettings, parse_budgets
from foresight.generate import Decoding, generate
from foresight.golden import GoldenPolicy, block_pooled_attention
from foresight.kvpop.target import KVpopOraclePolicy, kvpop_oracle_priorities
from foresight.models import load_model
from foresight.policies import make_policy
from foresight.reward import low_entropy_mask
from foresight.rollout import rollout
from foresight.selection import topk_overlap

STREAMING_SINKS = 4


@dataclasses.dataclass(frozen=True)
class Method:
    """One evaluated method, complete from construction on.

    ``kind``: ``full`` (no eviction), ``golden`` and ``kvpop-oracle`` (teacher-forced only: they need the future),
    or ``policy`` (a heuristic or a trained scorer). ``make_policy`` builds a fresh policy for every run (None for
    the full cache)."""

    name: str
    kind: str = "policy"
    make_policy: Callable | None = None
    protect_prompt: bool = False
    sinks: int = 0
    stateful: bool = False  # a scorer that must observe every pair (KVpop's mLSTM): no recall along golden's path
    checkpoint: Path | None = None  # a scorer checkpoint, whose model card records the evaluation

    @property
    def is_full(self) -> bool:
        return self.kind == "full"

    @property
    def teacher_forced_only(self) -> bool:
        return self.kind in ("golden", "kvpop-oracle")

    def settings(self, budget: int, interval: int, overflow: str) -> EvictionSettings:
        """The eviction settings of this method at B:L (top-L selection)."""
        return EvictionSettings(budget=budget, interval=interval, sinks=self.sinks, protect_prompt=self.protect_prompt,
                                prompt_overflow=overflow)


def build_methods(names: list[str], scorer_dirs: list, model, protect_all: bool) -> list[Method]:
    out = []
    for n in names:
        n = n.strip()
        if not n:
            continue
        if n == "full":
            out.append(Method("full", "full", make_policy=lambda: None))
        elif n in ("golden", "kvpop-oracle"):  # kvpop-oracle: KVpop's teacher under the recipe's kvpop layout
            out.append(Method(n, n, protect_prompt=protect_all))
        elif n == "random-keep-prompt":
            out.append(Method(n, make_policy=lambda: make_policy("random"), protect_prompt=True))
        else:
            make_policy(n)  # validates the name
            out.append(Method(n, make_policy=lambda name=n: make_policy(name), protect_prompt=protect_all,
                              sinks=STREAMING_SINKS if n == "streamingllm" else 0))
    seen = {m.name for m in out}
    for d in scorer_dirs:
        bank, cfg = load_scorer(d, model)
        name = method_name(cfg)
        if name in seen:
            name = f"{name}({Path(d).name})"
        seen.add(name)
        out.append(Method(name, make_policy=lambda b=bank, c=cfg, nm=name: policy_from_checkpoint(b, c, nm),
                          protect_prompt=protect_all, stateful=bool(getattr(bank, "stateful", False)),
                          checkpoint=Path(d)))
    return out


def reference_traces(recipe, model, tok, problems, device):
    """Full-cache greedy traces of the held-out problems, with their per-token loss and entropy."""
    refs = []
    decoding = Decoding.from_recipe(recipe.traces, tok, do_sample=False)
    for p in problems:
        ids = prompts.encode(p, tok)
        g = generate(model, torch.tensor([ids], device=device), max_new_tokens=recipe.traces.max_new_tokens,
                     decoding=decoding)
        new = decoding.truncate(g.new_tokens[0].tolist())
        seq = torch.tensor([ids + new], device=device)
        full = rollout(model, seq)
        refs.append({"ids": seq, "prompt_len": len(ids), "loss": full.token_loss[0], "entropy": full.token_entropy[0],
                     "correct": prompts.check(recipe, new, tok.decode(new, skip_special_tokens=True), p.answer)})
    return refs


def group_refs(refs: list[dict]) -> list[dict]:
    """Batch the reference traces that share (length, prompt length): one rollout per group."""
    groups: dict = {}
    for j, r in enumerate(refs):
        groups.setdefault((r["ids"].shape[1], r["prompt_len"]), []).append(j)
    out = []
    for (S, P), idx in sorted(groups.items()):
        out.append({"members": idx, "prompt_len": P, "ids": torch.cat([refs[j]["ids"] for j in idx]),
                    "loss": torch.stack([refs[j]["loss"] for j in idx]),
                    "entropy": torch.stack([refs[j]["entropy"] for j in idx])})
    return out


def teacher_forced(method: Method, model, grp, settings: EvictionSettings, seed: int, future=None, kvpop_cfg=None):
    """Per-token losses [b, S] of a group of traces under the method, and the mean pairs held."""
    if method.is_full:
        return grp["loss"], float(grp["ids"].shape[1])
    if method.kind == "kvpop-oracle":
        if "kvpop_prio" not in grp:
            grp["kvpop_prio"] = kvpop_oracle_priorities(model, grp["ids"], kvpop_cfg)
        pol = KVpopOraclePolicy(grp["kvpop_prio"], kvpop_cfg.window, kvpop_cfg.sinks)
    else:
        pol = GoldenPolicy(future) if method.kind == "golden" else method.make_policy()
    gen = torch.Generator(device=grp["ids"].device).manual_seed(seed)
    res = rollout(model, grp["ids"], pol, settings, prompt_len=grp["prompt_len"], generator=gen)
    return res.token_loss, res.mean_held


def recall_vs_golden(method: Method, model, grp, settings: EvictionSettings, future, seed) -> list[float]:
    """Per golden step: |method's top-L ∩ golden's L| / L along the golden trajectory (all rows, layers, heads)."""
    if method.is_full or method.teacher_forced_only or method.stateful:
        return []  # a stateful scorer (KVpop mLSTM) cannot score a trajectory it did not observe
    pol = method.make_policy()
    gen = torch.Generator(device=grp["ids"].device).manual_seed(seed)
    hits = []

    def rec(st):
        v = st["view"]
        v.generator = gen
        s = pol.score(v).float().masked_fill(~st["evictable"], float("-inf"))
        mine = s.topk(st["chosen"].shape[-1], -1).indices
        hits.append(topk_overlap(mine, st["chosen"]).mean().item())

    rollout(model, grp["ids"], GoldenPolicy(future), settings.replace(prompt_overflow="evict"),
            prompt_len=grp["prompt_len"], recorder=rec)
    return hits


def accuracy(method: Method, recipe, model, tok, problems, budget: int, interval: int, device):
    """Task accuracy of generation under the method (pass@1 averaged over the seeded samples), and the samples."""
    if method.teacher_forced_only or recipe.task.kind == "none":
        return None, 0  # golden needs the future; a task without a checker has no accuracy
    eval_cfg = recipe.eval
    n = eval_cfg.n_samples if eval_cfg.do_sample else 1
    ids, mask = prompts.left_pad([prompts.encode(p, tok) for p in problems], tok.pad_token_id, device)
    decoding = Decoding.from_recipe(recipe.traces, tok, do_sample=eval_cfg.do_sample)
    settings = method.settings(budget, interval, "evict")
    correct = 0
    for k in range(n):
        gen = torch.Generator(device=device).manual_seed(eval_cfg.seed * 1009 + k)
        out = generate(model, ids, mask, max_new_tokens=recipe.traces.max_new_tokens, policy=method.make_policy(),
                       settings=settings, decoding=decoding, generator=gen)
        for p, new in zip(problems, out.new_tokens.tolist()):
            new = decoding.truncate(new)
            correct += bool(prompts.check(recipe, new, tok.decode(new, skip_special_tokens=True), p.answer))
    return correct / (n * len(problems)), n


def loss_increases(loss, grp, protected: int, budget: int, interval: int):
    """Per-token loss increase (evicted − full) after the first eviction, on the low-entropy tokens (the lowest
    80% by full-cache entropy) and on the rest: two lists of per-row tensors."""
    low_d, high_d = [], []
    S = grp["ids"].shape[1]
    start = min(protected + budget + interval + 1, S)
    for r in range(loss.shape[0]):
        low = low_entropy_mask(grp["entropy"][r], start, 0.8)
        after = torch.zeros_like(low)
        after[start:] = True
        delta = loss[r] - grp["loss"][r]
        if low.any():
            low_d.append(delta[low])
        if (after & ~low).any():
            high_d.append(delta[after & ~low])
    return low_d, high_d


def run_eval(recipe, out, methods=None, budgets=None, scorers=(), progress=True, log=print) -> list[dict]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    eval_cfg = recipe.eval
    if eval_cfg.num_problems <= 0:
        raise ValueError(f"eval.num_problems must be > 0, got {eval_cfg.num_problems}")
    budget_list = parse_budgets(budgets or eval_cfg.budgets)
    model, tok = load_model(recipe.model)
    device = next(model.parameters()).device
    meths = build_methods((methods or eval_cfg.methods).split(","), list(scorers), model, eval_cfg.protect_prompt)
    # held-out problems: synthetic seeds from traces.heldout_offset, or the dataset rows after the training prompts
    start = recipe.traces.heldout_offset if recipe.traces.prompt_dataset is None else recipe.traces.num_prompts
    problems = prompts.load_prompts(recipe, start, eval_cfg.num_problems, tok)
    if not problems:
        raise ValueError(f"no held-out problems: the prompt dataset has no rows after the first {start}")
    t0 = time.time()
    log(f"[eval] {len(problems)} held-out problems; reference full-cache traces ...")
    refs = reference_traces(recipe, model, tok, problems, device)
    rows = []
    from tqdm import tqdm

    jobs = [(m, B, L) for (B, L) in budget_list for m in meths]
    bar = tqdm(jobs, desc="eval", disable=not progress)
    groups = group_refs(refs)
    goldens = {}

    def golden_for(gi, B, L):
        if (gi, B, L) not in goldens:
            blocks = EvictionSettings(budget=B, interval=L)
            goldens[(gi, B, L)] = torch.stack([
                block_pooled_attention(model, refs[j]["ids"], blocks, recipe.sft.golden_pool).future()
                for j in groups[gi]["members"]])
        return goldens[(gi, B, L)]

    max_prompt = max(r["prompt_len"] for r in refs)
    overflow = recipe.cache.prompt_overflow
    for m, B, L in bar:
        bar.set_postfix(method=m.name, budget=f"{B}:{L}")
        protect_label = m.protect_prompt
        if m.protect_prompt and max_prompt > B:
            if overflow == "error":
                log(f"[eval] skipping {m.name} at B={B}: the prompt ({max_prompt} tokens) is longer than the budget "
                    "and is protected (set cache.prompt_overflow=evict to evict inside the prompt instead)")
                continue
            protect_label = "fallback"
        settings = m.settings(B, L, overflow)
        tot_e = tot_f = 0.0
        low_d, high_d, held, recalls = [], [], [], []
        for gi, grp in enumerate(groups):
            future = None if m.is_full else golden_for(gi, B, L)
            seed = eval_cfg.seed * 7919 + gi
            loss, mean_held = teacher_forced(m, model, grp, settings, seed, future, recipe.kvpop)
            p = grp["prompt_len"]
            tot_e += loss[:, p:].sum().item()
            tot_f += grp["loss"][:, p:].sum().item()
            low, high = loss_increases(loss, grp, p if protect_label is True else 0, B, L)
            low_d += low
            high_d += high
            held.append(mean_held)
            if future is not None:
                recalls += recall_vs_golden(m, model, grp, settings, future, seed)
        acc, n = accuracy(m, recipe, model, tok, problems, B, L, device)
        row = {
            "method": m.name, "budget": B, "interval": L, "protect_prompt": protect_label,
            "loss_ratio": round(tot_e / max(tot_f, 1e-12), 5),
            "low_entropy_loss_increase": round(torch.cat(low_d).mean().item(), 5) if low_d else 0.0,
            "high_entropy_loss_increase": round(torch.cat(high_d).mean().item(), 5) if high_d else 0.0,
            "accuracy": None if acc is None else round(acc, 4), "n_samples": n,
            "recall_at_L": None if not recalls else round(sum(recalls) / len(recalls), 4),
            "mean_cache": round(sum(held) / len(held), 1), "num_problems": len(problems),
        }
        rows.append(row)
    full_acc = None if recipe.task.kind == "none" else sum(bool(r["correct"]) for r in refs) / len(refs)
    meta = {"recipe": recipe.name, "model": recipe.model.path, "num_problems": len(problems),
            "full_cache_trace_accuracy": full_acc, "mean_trace_length": sum(r["ids"].shape[1] for r in refs) / len(refs),
            "mean_prompt_length": sum(r["prompt_len"] for r in refs) / len(refs), "seconds": round(time.time() - t0, 1)}
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    (out / "results.md").write_text(results_table(rows, meta))
    for m in meths:  # the scorers' model cards carry their evaluation
        if m.checkpoint is not None:
            record_eval(m.checkpoint, rows, m.name)
    from foresight import plots

    plots.budget_curves(rows, out)
    best = next((m for m in reversed(meths) if m.name.startswith("foresight")), None) or \
        next((m for m in meths if m.name == "golden"), None) or next((m for m in meths if not m.is_full), None)
    if best is not None and refs:
        B, L = budget_list[0]
        future = goldens[(0, B, L)][0] if (0, B, L) in goldens else None
        first = refs[groups[0]["members"][0]]
        plots.eviction_map(model, first, best, B, L, future, out / "eviction_map.png")
    log(results_table(rows, meta))
    return rows


def _prot(v) -> str:
    return "fallback (prompt > B)" if v == "fallback" else ("yes" if v else "no")


def _fmt(v, nd=3):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def results_table(rows, meta) -> str:
    head = ("| method | prompt kept | B:L | loss ratio | Δloss low-H | Δloss high-H | accuracy | n | recall@L | "
            "mean cache |\n|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['method']} | {_prot(r['protect_prompt'])} | {r['budget']}:{r['interval']} | "
        f"{_fmt(r['loss_ratio'], 4)} | {_fmt(r['low_entropy_loss_increase'])} | {_fmt(r['high_entropy_loss_increase'])} | "
        f"{_fmt(r['accuracy'])} | {r['n_samples']} | {_fmt(r['recall_at_L'])} | {_fmt(r['mean_cache'], 1)} |\n"
        for r in rows)
    info = (f"\n{meta['num_problems']} held-out problems, mean trace {meta['mean_trace_length']:.0f} tokens "
            f"(prompt {meta['mean_prompt_length']:.0f}); full-cache accuracy of the reference traces: "
            f"{_fmt(meta['full_cache_trace_accuracy'])}.\n")
    return head + body + info
