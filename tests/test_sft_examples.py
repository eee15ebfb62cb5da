"""SFT's stored golden examples: the run's own, shared between runs and seeds; on-policy states with golden labels;
several training budgets."""

import pytest
import torch
from conftest import SFT_SETS as SETS

from foresight.config.recipe import load_recipe
from foresight.data import traces
from foresight.training.sft import train_sft


def test_stored_golden_examples_are_the_run_s_own_and_shared_between_runs(sft_setup, tmp_path, monkeypatch):
    """sft.example_steps: the stored steps equal golden_examples' (inputs to float16), a scorer with fewer features
    reads its own columns, and a second SFT run computes nothing."""
    from foresight.data.trace_data import load_traces
    from foresight.engine.models import load_model
    from foresight.scorers.bank import bank_for_model
    from foresight.training.golden_store import GoldenStore, golden_examples

    monkeypatch.setenv("FORESIGHT_CACHE", str(tmp_path / "cache"))
    r, tdir = sft_setup
    model, _ = load_model(r.model)
    ds = load_traces(tdir)
    store = GoldenStore(model, r.cache, "mean", steps=2, seed=0)
    row = ds[0]
    for feats in (("key", "value", "attn"), ("attn",), ("key", "value"), ("key", "value", "attn", "age"), ("attn", "age"),
                  ("key", "value", "attn", "heads", "age"), ("heads",), ("key", "value", "attn", "ahead"),
                  ("ahead", "age", "key")):
        bank = bank_for_model(model, features=feats)
        ref = golden_examples(model, torch.tensor([row["input_ids"]]), bank, r.cache, prompt_len=row["prompt_len"])
        got = store.examples(row, bank)
        picked = torch.load(store.path(row))["steps"]
        assert len(got) == min(2, len(ref)) and len(ref) > 2
        for (x, f, c), k in zip(got, picked):
            assert x.shape == ref[k][0].shape
            assert torch.allclose(x, ref[k][0], atol=2e-3 * (1 + ref[k][0].abs().max().item()))
            assert torch.equal(f, ref[k][1]) and torch.equal(c, ref[k][2])
    monkeypatch.setenv("FORESIGHT_CACHE", str(tmp_path / "cache-batched"))
    batched = GoldenStore(model, r.cache, "mean", steps=2, seed=0)
    rows = [dict(ds[i], input_ids=ds[i]["input_ids"][:len(ds[i]["input_ids"]) - 3 * i]) for i in range(len(ds))]
    assert len({len(x["input_ids"]) for x in rows}) == len(rows) > 2  # rows of several lengths: padding is tested
    assert batched.fill(list(range(len(rows))), rows, progress=False) == len(rows)
    monkeypatch.setenv("FORESIGHT_CACHE", str(tmp_path / "cache-single"))
    single = GoldenStore(model, r.cache, "mean", steps=2, seed=0)
    for i in range(len(rows)):  # a batch of right-padded traces stores what each trace alone gives
        a, b = torch.load(batched.path(rows[i])), single.compute(rows[i])
        assert a["steps"] == b["steps"]
        assert torch.allclose(a["x"].float(), b["x"].float(), atol=2e-3 * (1 + b["x"].float().abs().max().item()))
        assert torch.allclose(a["future"], b["future"], atol=1e-5) and torch.equal(a["cand"], b["cand"])
        assert torch.equal(a["age"], b["age"])
    monkeypatch.setenv("FORESIGHT_CACHE", str(tmp_path / "cache"))
    r2 = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={r.model.path}", *SETS, "sft.example_steps=2"])
    train_sft(r2, tdir, tmp_path / "a", progress=False, log=lambda *_: None)
    files = sorted(store.folder.glob("trace-*.pt"))
    assert len(files) >= 3 and all(p.parent == store.folder for p in files)
    stamps = {p: p.stat().st_mtime_ns for p in files}
    traces.make_traces(r, tdir, progress=False, log=lambda *_: None)  # merged again (a new date): the same traces
    r3 = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={r.model.path}", *SETS, "sft.example_steps=2",
                                                 "scorer.features=[attn]", "scorer.hidden=8"])
    _, m = train_sft(r3, tdir, tmp_path / "b", progress=False, log=lambda *_: None)
    assert {p: p.stat().st_mtime_ns for p in files} == stamps  # shared, not recomputed
    assert 0 < m["val_recall_at_L"] <= 1


def test_example_seed_lets_another_sft_seed_reuse_the_stored_examples(sft_setup, tmp_path, monkeypatch):
    """sft.example_seed: a second SFT seed that keeps the first's example seed reads the stored golden examples (none
    computed) and still trains another scorer; without it, the seed picks other steps, in a store of its own."""
    from foresight.scorers.checkpoint import load_scorer

    monkeypatch.setenv("FORESIGHT_CACHE", str(tmp_path / "cache"))
    r, tdir = sft_setup
    base = [f"model.path={r.model.path}", *SETS, "sft.example_steps=2"]

    def run(name, *extra):
        train_sft(load_recipe("recipes/tiny-qwen3.yaml", [*base, *extra]), tdir, tmp_path / name, progress=False,
                  log=lambda *_: None)

    run("s0")
    (folder,) = {p.parent for p in (tmp_path / "cache").rglob("trace-*.pt")}
    stamps = {p: p.stat().st_mtime_ns for p in folder.glob("trace-*.pt")}
    run("s1-shared", "sft.seed=1", "sft.example_seed=0")
    assert {p.parent for p in (tmp_path / "cache").rglob("trace-*.pt")} == {folder}  # no other store
    assert {p: p.stat().st_mtime_ns for p in folder.glob("trace-*.pt")} == stamps  # nothing recomputed
    a, b = (load_scorer(tmp_path / n)[0] for n in ("s0", "s1-shared"))
    assert not torch.equal(a.w1, b.w1)  # the seed still sets the initialisation and the batches
    run("s1", "sft.seed=1")
    assert len({p.parent for p in (tmp_path / "cache").rglob("trace-*.pt")}) == 2  # its own steps, its own store
    with pytest.raises(ValueError, match="sft.example_seed"):
        load_recipe("recipes/tiny-qwen3.yaml", [*base, "sft.example_seed=-1"])


def test_each_sft_step_reads_ahead_the_stored_files_of_the_next_step(sft_setup, tmp_path, monkeypatch):
    """With stored examples, step s asks the kernel to read step s + 1's trace files ahead (so a store larger than the
    page cache is read while a step computes): every advised file is one the next step reads, and it exists."""
    from foresight.data.stage_inputs import load_stage_inputs
    from foresight.training import sft
    from foresight.training.golden_store import GoldenStore

    monkeypatch.setenv("FORESIGHT_CACHE", str(tmp_path / "cache"))
    r, tdir = sft_setup
    recipe = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={r.model.path}", *SETS, "sft.example_steps=2"])
    advised, prefetch = [], GoldenStore.prefetch

    def record(store, rows):
        n = prefetch(store, rows)
        advised.append(([store.trace_key(row) for row in rows], n))
        return n

    monkeypatch.setattr(GoldenStore, "prefetch", record)
    sft.train_sft(recipe, tdir, tmp_path / "run", progress=False, log=lambda *_: None)
    _, _, ds, train, _ = load_stage_inputs(recipe.sft, recipe.model, tdir, 1)
    assert len(advised) == recipe.sft.steps
    for step, (keys, n) in enumerate(advised):
        nxt = sft.step_traces(recipe.sft, train, step + 1)
        assert keys == [GoldenStore.trace_key(ds[i]) for i in nxt]
        assert n == len(nxt) == recipe.sft.batch_traces  # every file existed (the store was filled first)


def test_onpolicy_states_follow_the_scorer_with_golden_labels(sft_setup, tmp_path, monkeypatch):
    """sft.onpolicy (a DAgger round): the store follows the given scorer's own top-L trajectory and labels its states
    with golden's future scores; SFT starts from that scorer and adds those states; bad settings are refused."""
    from foresight.data.trace_data import load_traces
    from foresight.engine.models import load_model
    from foresight.engine.rollout import rollout
    from foresight.scorers.bank import LearnedPolicy
    from foresight.targets.golden import GoldenPolicy, block_pooled_attention
    from foresight.training.golden_store import GoldenStore

    monkeypatch.setenv("FORESIGHT_CACHE", str(tmp_path / "cache"))
    r, tdir = sft_setup
    base = [f"model.path={r.model.path}", *SETS, "sft.example_steps=2"]
    first, _ = train_sft(load_recipe("recipes/tiny-qwen3.yaml", base), tdir, tmp_path / "a", progress=False,
                         log=lambda *_: None)
    model, _ = load_model(r.model)
    row = load_traces(tdir)[0]
    own = GoldenStore(model, r.cache, "mean", steps=2, seed=0, behaviour=first)
    golden = GoldenStore(model, r.cache, "mean", steps=2, seed=0)
    assert own.folder != golden.folder
    data = own.compute(row)
    ids = torch.tensor([row["input_ids"]])
    gold = GoldenPolicy(block_pooled_attention(model, ids, r.cache).future())
    seen = {}

    def rec(st):
        seen[st["step"]] = (own.full.inputs(st["view"]), gold.future_scores(st["view"]), st["evictable"])

    rollout(model, ids, LearnedPolicy(first), r.cache, prompt_len=row["prompt_len"], recorder=rec)
    for k, step in enumerate(data["steps"]):
        x, f, c = seen[step]
        assert torch.allclose(data["x"][k].float(), x, atol=2e-3 * (1 + x.abs().max().item()))
        assert torch.equal(data["future"][k], f) and torch.equal(data["cand"][k], c)
    assert not torch.equal(data["x"], golden.compute(row)["x"])  # another trajectory: other states
    tuned, m = train_sft(load_recipe("recipes/tiny-qwen3.yaml", [*base, f"sft.onpolicy={tmp_path / 'a'}", "sft.lr=1e-12"]),
                         tdir, tmp_path / "b", progress=False, log=lambda *_: None)
    assert all(torch.allclose(p, q, atol=1e-9) for p, q in zip(tuned.parameters(), first.parameters()))  # from `first`
    assert 0 <= m["val_recall_at_L_onpolicy_states"] <= 1
    with pytest.raises(ValueError, match="example_steps"):
        train_sft(load_recipe("recipes/tiny-qwen3.yaml", [*base, "sft.example_steps=0", f"sft.onpolicy={tmp_path / 'a'}"]),
                  tdir, tmp_path / "c", progress=False, log=lambda *_: None)
    with pytest.raises(ValueError, match="set one of them"):
        train_sft(load_recipe("recipes/tiny-qwen3.yaml", [*base, f"sft.init={tmp_path}", f"sft.onpolicy={tmp_path / 'a'}"]),
                  tdir, tmp_path / "e", progress=False, log=lambda *_: None)
    with pytest.raises(ValueError, match="not the recipe's"):
        train_sft(load_recipe("recipes/tiny-qwen3.yaml", [*base, "scorer.hidden=8", f"sft.onpolicy={tmp_path / 'a'}"]),
                  tdir, tmp_path / "d", progress=False, log=lambda *_: None)


def test_several_training_budgets_average_their_losses(sft_setup, tmp_path, monkeypatch):
    """sft.budgets: each budget's golden examples are stored on their own, the training loss is the mean of the
    budgets' losses (a one-budget run's loss is that budget's), each budget's validation recall is reported, and bad
    settings are refused."""
    from foresight.config.checks import RecipeError
    from foresight.data.trace_data import load_traces
    from foresight.engine.models import load_model
    from foresight.scorers.bank import bank_for_model
    from foresight.training.golden_store import GoldenStore
    from foresight.training.sft import budgets_loss, example_loss, training_settings

    monkeypatch.setenv("FORESIGHT_CACHE", str(tmp_path / "cache"))
    r, tdir = sft_setup
    base = [f"model.path={r.model.path}", *SETS, "sft.example_steps=2"]
    multi = load_recipe("recipes/tiny-qwen3.yaml", [*base, "sft.budgets=8:4,16:4"])
    settings = training_settings(multi)
    assert [(s.budget, s.interval) for s in settings] == [(8, 4), (16, 4)]
    assert training_settings(load_recipe("recipes/tiny-qwen3.yaml", base)) == [r.cache]
    bank, m = train_sft(multi, tdir, tmp_path / "multi", progress=False, log=lambda *_: None)
    model, _ = load_model(r.model)
    stores = [GoldenStore(model, s, "mean", steps=2, seed=0) for s in settings]
    row = load_traces(tdir)[0]
    assert stores[0].folder != stores[1].folder and all(st.path(row).exists() for st in stores)
    assert set(m["val_recall_at_L_per_budget"]) == {"8:4", "16:4"}
    fresh = bank_for_model(model, hidden=r.scorer.hidden)
    cfg = multi.sft
    groups = [(s.interval, st.examples(row, fresh)) for s, st in zip(settings, stores)]
    per = [example_loss(fresh, ex, cfg, k, torch.Generator().manual_seed(0)) for k, ex in groups]
    loss, rec = budgets_loss(fresh, groups, cfg, torch.Generator().manual_seed(0))
    assert per[0][0].item() != pytest.approx(per[1][0].item())  # the budgets' examples differ
    assert loss.item() == pytest.approx((per[0][0].item() + per[1][0].item()) / 2, rel=1e-5)
    assert torch.allclose(rec, (per[0][1] + per[1][1]) / 2)
    with pytest.raises(RecipeError, match="sft.budgets"):
        load_recipe("recipes/tiny-qwen3.yaml", [*base, "sft.budgets=8:8"])
    with pytest.raises(ValueError, match="sft.budgets"):
        train_sft(load_recipe("recipes/tiny-qwen3.yaml", [*base, "sft.budgets=8:4,16:4", f"sft.onpolicy={tmp_path / 'multi'}"]),
                  tdir, tmp_path / "c", progress=False, log=lambda *_: None)
