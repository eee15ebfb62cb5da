"""The evaluation's generation side (:mod:`foresight.evaluation.evaluate`): task accuracy of generation under a method (seeded
samples, the task's checker) and, for greedy decoding, where it first leaves the full-cache reference
(:mod:`foresight.evaluation.divergence`)."""

from __future__ import annotations

import dataclasses

import torch

from foresight.data import prompts
from foresight.evaluation.divergence import DivergenceStats, first_divergence
from foresight.engine.generate import Decoding, GenerateOptions, generate
from foresight.config.recipe import EvalConfig, TaskConfig, TracesConfig
from foresight.evaluation.methods import Method


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """What the evaluation's generation reads: the recipe's ``task`` (its checker), ``traces`` (the sampling and
    ``max_new_tokens``) and ``eval`` (``n_samples``, ``do_sample``, ``seed``) sections."""

    task: TaskConfig
    traces: TracesConfig
    eval: EvalConfig


def accuracy(method: Method, gen: GenerationSettings, model, tok, problems, budget: int, interval: int, device):
    """Task accuracy of generation under the method per problem (the share of the seeded samples that solve it: pass@1
    with ``eval.n_samples``), the number of samples and the first sample's (new tokens, correct) per problem;
    (None, 0, None) when there is no accuracy to measure."""
    if method.teacher_forced_only or gen.task.kind == "none":
        return None, 0, None  # golden needs the future; a task without a checker has no accuracy
    eval_cfg = gen.eval
    n = eval_cfg.n_samples if eval_cfg.do_sample else 1
    ids, mask = prompts.pad_rows([prompts.encode(p, tok) for p in problems], tok.pad_token_id, device)
    decoding = Decoding.from_recipe(gen.traces, tok, do_sample=eval_cfg.do_sample)
    settings = method.settings(budget, interval, "evict")
    solved, first = [0] * len(problems), None
    for k in range(n):
        generator = torch.Generator(device=device).manual_seed(eval_cfg.seed * 1009 + k)
        out = generate(model, ids, mask, max_new_tokens=gen.traces.max_new_tokens, policy=method.make_policy(),
                       settings=settings, decoding=decoding, options=GenerateOptions(generator=generator))
        sample = []
        for p, new in zip(problems, out.new_tokens.tolist()):
            new = decoding.truncate(new)
            sample.append((new, bool(prompts.check(gen.task, new, tok.decode(new, skip_special_tokens=True), p.answer))))
        solved = [c + ok for c, (_, ok) in zip(solved, sample)]
        first = first or sample
    return [c / n for c in solved], n, first


def divergences(refs: list[dict], sample: list[tuple[list[int], bool]], along: dict) -> dict:
    """Greedy generation's first divergence from each reference, with the teacher-forced losses ``along`` the
    references ({trace: [S]}) of the same method (:mod:`foresight.evaluation.divergence`)."""
    stats = DivergenceStats()
    for i, (new, ok) in enumerate(sample):
        p = refs[i]["prompt_len"]
        pos = first_divergence(refs[i]["ids"][0, p:].tolist(), new)
        stats.add(i, pos, p, along[i], refs[i]["loss"], refs[i]["entropy"], ok)
    return stats.row()
