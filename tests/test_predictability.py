"""The predictability probe (studies/realbench/predictability.py): golden's state at an eviction step, other futures' golden
choices, and the ceiling estimate."""

import json

import pytest
import torch

from conftest import tiny_qwen3
from foresight.config.eviction import EvictionSettings
from foresight.config.recipe import load_recipe
from studies.realbench.predictability import (Probe, State, at_step, block_futures, compare, continuations, default_position,
                                      eviction_step_at, golden_state, measure_trace, run, stored_continuations)
from foresight.engine.generate import Decoding
from foresight.scorers.bank import bank_for_model
from foresight.engine.selection import select_topk

SETTINGS = EvictionSettings(budget=16, interval=4, selection="topk")


def test_eviction_points():
    assert eviction_step_at(20, SETTINGS) == 0  # the first eviction: the cache holds B + L
    assert eviction_step_at(36, SETTINGS) == 4
    for bad in (16, 19, 37):
        with pytest.raises(ValueError, match="not an eviction point"):
            eviction_step_at(bad, SETTINGS)
    p = default_position([(16, 4), (24, 8)], 100)
    assert p >= 50 and eviction_step_at(p, SETTINGS) >= 0 and eviction_step_at(p, EvictionSettings(24, 8)) >= 0
    with pytest.raises(ValueError):
        Probe(continuations=1)


def test_golden_state_is_golden_choice_under_its_own_future():
    model = tiny_qwen3()
    ids = torch.randint(3, 60, (1, 60), generator=torch.Generator().manual_seed(1))
    step = eviction_step_at(32, SETTINGS)
    bank = bank_for_model(model, hidden=8)
    state = golden_state(model, ids, SETTINGS, step, bank)
    assert isinstance(state, State)
    nl, h, n = state.token.shape
    assert n == SETTINGS.budget + SETTINGS.interval and state.chosen.shape == (nl, h, SETTINGS.interval)
    assert int(state.token.max()) == 31  # the cache has seen exactly the first 32 tokens
    own = at_step(block_futures(model, ids, SETTINGS), step, state.token)[0]
    assert torch.equal(select_topk(-own, state.evictable, SETTINGS.interval).sort(-1).values, state.chosen.sort(-1).values)
    assert state.scorer.shape == state.chosen.shape
    # the same trace as every "other" future: golden agrees with itself and every estimate is exact
    same = at_step(block_futures(model, ids.expand(3, -1), SETTINGS), step, state.token)
    figs = compare(state.chosen, state.evictable, same, SETTINGS.interval, {"scorer": state.scorer})
    for name in ("agreement", "ceiling", "ceiling_half", "mean_future"):
        assert torch.allclose(figs[name], torch.ones(nl)), name
    assert figs["scorer"].shape == (nl,) and float(figs["scorer"].mean()) < 1.0  # a random scorer is not golden
    # other futures change golden's choice; on the scorer's own states too, where its recall is that of its own choice
    other = torch.cat([ids[:, :32].expand(4, -1), torch.randint(3, 60, (4, 28), generator=torch.Generator().manual_seed(2))], 1)
    figs = measure_trace(model, ids, other, SETTINGS, step, bank)
    assert set(figs) == {"golden", "scorer"}
    for kind in figs:
        assert float(figs[kind]["agreement"].mean()) < 1.0 and set(figs[kind]) >= {"ceiling", "scorer"}


def test_ceiling_drops_what_most_futures_drop():
    # one layer, one head, 6 candidates, L = 2; golden (the reference's future) dropped slots 0 and 1
    cand, golden = torch.ones(1, 1, 6, dtype=torch.bool), torch.tensor([[[0, 1]]])
    f = torch.tensor([[0.0, 0.1, 0.9, 0.9, 0.9, 0.9],  # drops 0, 1
                      [0.0, 0.9, 0.1, 0.9, 0.9, 0.9],  # drops 0, 2
                      [0.0, 0.9, 0.9, 0.1, 0.9, 0.9],  # drops 0, 3
                      [0.9, 0.2, 0.9, 0.9, 0.9, 0.1]])  # drops 5, 1
    figs = compare(golden, cand, f.view(4, 1, 1, 6), 2, {"other": torch.tensor([[[1, 5]]])})
    assert figs["other"].item() == 0.5
    assert figs["agreement"].item() == pytest.approx((1.0 + 0.5 + 0.5 + 0.5) / 4)
    # counts: slot 0 three times, slot 1 twice, the others once -> {0, 1}
    assert figs["ceiling"].item() == 1.0
    # the first two futures: 0 twice, 1 and 2 once each; the tie goes to the lower mean future (1: 0.5, 2: 0.5 ->
    # the older slot)
    assert figs["ceiling_half"].item() == 1.0
    # mean future: 0 (0.225), 1 (0.525), 2 (0.7), 3 (0.7) -> {0, 1}
    assert figs["mean_future"].item() == 1.0


def test_continuations_keep_the_prefix_and_length():
    model = tiny_qwen3()
    ids = torch.randint(3, 60, (1, 30), generator=torch.Generator().manual_seed(3))
    dec = Decoding(do_sample=True, temperature=1.0, eos_token_id=2, pad_token_id=0)
    alt = continuations(model, ids, 20, 3, dec, seed=5)
    assert alt.shape == (3, 30) and torch.equal(alt[:, :20], ids[:, :20].expand(3, -1))
    assert not torch.equal(alt[0], alt[1])  # each row seeded on its own
    assert torch.equal(alt, continuations(model, ids, 20, 3, dec, seed=5))  # reproducible


def test_continuations_are_stored_and_reused(tmp_path):
    calls = []

    def make():  # another value on every call: only a stored file gives the same one twice
        calls.append(1)
        return torch.arange(6).view(2, 3) + 10 * len(calls)

    a = stored_continuations(tmp_path, {"k": 1}, make)
    b = stored_continuations(tmp_path, {"k": 1}, make)
    c = stored_continuations(tmp_path, {"k": 2}, make)
    assert torch.equal(a, b) and len(calls) == 2  # the second call read the file
    assert not torch.equal(a, c)  # another key was computed anew


def test_run_writes_a_summary_and_resumes(tiny_model_dir, tmp_path, monkeypatch):
    sets = [f"model.path={tiny_model_dir}", "task.facts=4", "task.variables=2", "task.filler=0", "task.scratch=0",
            "traces.min_new_tokens=5", "traces.max_new_tokens=40", "eval.budgets=16:4,24:4", "eval.do_sample=true",
            "traces.temperature=1.0"]
    r = load_recipe("recipes/tiny-qwen3.yaml", sets)
    summ = run(r, Probe(problems=2, continuations=2), tmp_path / "p", log=lambda *_: None)
    saved = json.loads((tmp_path / "p" / "rows.json").read_text())
    assert {row["budget"] for row in saved["rows"]} == {"16:4", "24:4"} and set(summ) == {"golden"}
    for b, s in summ["golden"].items():
        assert 0.0 <= s["agreement"] <= 1.0 and s["traces"] >= 1 and "scorer" not in s
    assert (tmp_path / "p" / "summary.md").read_text().startswith("# Predictability")
    import studies.realbench.predictability as pr

    def no_more(*a, **k):
        raise AssertionError("a finished trace was measured again")

    monkeypatch.setattr(pr, "measure_trace", no_more)
    again = run(r, Probe(problems=2, continuations=2), tmp_path / "p", log=lambda *_: None)
    assert again == summ  # resumed from rows.json: nothing recomputed, the same figures
    with pytest.raises(AssertionError, match="measured again"):  # another probe is another measurement
        run(r, Probe(problems=2, continuations=3), tmp_path / "p", log=lambda *_: None)
