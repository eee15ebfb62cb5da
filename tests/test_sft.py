import json
import os
import subprocess
import sys

import pytest
import torch

from foresight.data import traces
from foresight.scorers.checkpoint import load_scorer
from foresight.config.recipe import load_recipe
from foresight.training.ranking import lost_future
from foresight.training.sft import pairwise_hinge, recall_at_l, train_sft

SETS = ["task.facts=4", "task.variables=2", "task.filler=0", "task.scratch=0", "traces.num_prompts=6",
        "traces.batch_size=3", "traces.require_correct=false", "traces.min_new_tokens=5", "traces.max_new_tokens=24",
        "cache.budget=12", "cache.interval=4", "sft.steps=6", "sft.batch_traces=2", "sft.ckpt_every=3",
        "sft.warmup=2"]


@pytest.fixture
def sft_setup(tiny_model_dir, tmp_path):
    r = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS])
    tdir = tmp_path / "traces"
    traces.make_traces(r, tdir, progress=False, log=lambda *_: None)
    return r, tdir


def test_pairwise_hinge_all_and_sampled_agree_on_a_crafted_row():
    phi = torch.tensor([[3.0, 2.0, 1.0, 0.0]])  # perfectly ordered: i evicted before j when fut_i < fut_j
    fut = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    cand = torch.ones(1, 4, dtype=torch.bool)
    loss, rows = pairwise_hinge(phi, fut, cand, margin=0.01)
    assert rows == 1 and loss.item() == 0.0
    bad = phi.flip(-1)
    loss, _ = pairwise_hinge(bad, fut, cand, margin=0.01)
    # pairs (i<j): phi_i - phi_j = -(j-i); hinge = 0.01 + (j - i); mean over 6 pairs = 0.01 + 10/6
    assert abs(loss.item() - (0.01 + 10 / 6)) < 1e-6
    s, _ = pairwise_hinge(bad, fut, cand, margin=0.01, mode="sampled", sampled=20000,
                          generator=torch.Generator().manual_seed(0))
    assert abs(s.item() - loss.item()) < 0.05
    assert recall_at_l(phi, fut, cand, 2).item() == 1.0 and recall_at_l(bad, fut, cand, 2).item() == 0.0


def test_gap_weighted_pairs_count_a_costly_swap_more_than_a_near_tie():
    """sft.pair_weight=gap: each ordered pair's hinge weighted by its future-score gap, the weights normalised per row.
    Swapping two pairs nobody attends to costs little; swapping one of them with a pair attended later costs a lot
    (uniform weights count both swaps alike). All pairs, sampled pairs and a brute-force sum agree."""
    fut = torch.tensor([[0.001, 0.002, 0.003, 0.5]])
    cand = torch.ones(1, 4, dtype=torch.bool)
    near_tie = torch.tensor([[2.0, 3.0, 1.0, 0.0]])  # slots 0 and 1 swapped (gap 0.001)
    costly = torch.tensor([[3.0, 2.0, 0.0, 1.0]])  # slots 2 and 3 swapped (gap 0.497)

    def brute(phi):
        num = den = 0.0
        for i in range(4):
            for j in range(4):
                if fut[0, i] < fut[0, j]:
                    w = float(fut[0, j] - fut[0, i])
                    num += w * max(0.0, 0.01 - float(phi[0, i] - phi[0, j]))
                    den += w
        return num / den

    uni = [pairwise_hinge(p, fut, cand, 0.01)[0].item() for p in (near_tie, costly)]
    assert abs(uni[0] - uni[1]) < 1e-6  # uniform: the same one swap of adjacent slots
    gap = [pairwise_hinge(p, fut, cand, 0.01, weight="gap")[0].item() for p in (near_tie, costly)]
    assert abs(gap[0] - brute(near_tie)) < 1e-6 and abs(gap[1] - brute(costly)) < 1e-6
    assert gap[1] > 100 * gap[0]
    s, _ = pairwise_hinge(costly, fut, cand, 0.01, "sampled", 40000, generator=torch.Generator().manual_seed(0),
                          weight="gap")
    assert abs(s.item() - gap[1]) < 0.05 * gap[1]
    b, _ = pairwise_hinge(costly, fut, cand, 0.01, "boundary", 40000, generator=torch.Generator().manual_seed(0),
                          k=3, weight="gap")
    # golden evicts slots 0-2 and keeps 3: pairs (0, 3), (1, 3), (2, 3), only the last one wrong (hinge 1.01)
    assert abs(b.item() - 1.01 * 0.497 / (0.499 + 0.498 + 0.497)) < 0.02
    with pytest.raises(ValueError, match="pair_weight"):
        pairwise_hinge(costly, fut, cand, 0.01, weight="square")


def test_lost_future_weighs_a_miss_by_what_it_evicts_where_recall_does_not():
    """Two scorers with the same recall@L (one of golden's two evictions each) lose very different future scores: one
    swaps in a pair nobody attends to, the other one that is attended later. Non-candidates are never counted."""
    fut = torch.tensor([[0.001, 0.002, 0.003, 0.5, 9.0]])
    cand = torch.tensor([[True, True, True, True, False]])  # slot 4 (huge future) is not a candidate
    cheap = torch.tensor([[3.0, 1.0, 2.0, 0.0, 99.0]])  # evicts 0 and 2 (golden: 0 and 1)
    costly = torch.tensor([[3.0, 1.0, 0.0, 2.0, 99.0]])  # evicts 0 and 3
    assert recall_at_l(cheap, fut, cand, 2).item() == recall_at_l(costly, fut, cand, 2).item() == 0.5
    gold = 0.001 + 0.002
    assert torch.allclose(lost_future(cheap, fut, cand, 2), torch.tensor([[0.004, gold]]))
    assert torch.allclose(lost_future(costly, fut, cand, 2), torch.tensor([[0.501, gold]]))
    perfect = -fut
    assert torch.allclose(lost_future(perfect, fut, cand, 2)[:, 0], torch.tensor([gold]))


def test_boundary_pairs_count_only_the_golden_set_against_the_rest():
    """sft.pairs=boundary: a scorer that puts golden's k evictions above every kept candidate has zero loss whatever
    its order inside either set (the all-pairs loss does not); one that swaps a member across the boundary does not."""
    fut = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 9.0]])
    cand = torch.tensor([[True, True, True, True, True, False]])  # the last slot is protected: never in a pair
    gen = torch.Generator().manual_seed(0)
    set_right = torch.tensor([[1.0, 2.0, 0.0, -1.0, -2.0, 5.0]])  # golden's 2 on top, reversed inside each set
    loss, rows = pairwise_hinge(set_right, fut, cand, 0.01, "boundary", 256, generator=gen, k=2)
    assert rows == 1 and loss.item() == 0.0
    assert pairwise_hinge(set_right, fut, cand, 0.01)[0].item() > 0  # all pairs: the inner order counts
    swapped = torch.tensor([[1.0, -1.5, 0.0, -1.0, -2.0, 5.0]])  # slot 1 (golden evicts it) below slot 2 (kept)
    loss, _ = pairwise_hinge(swapped, fut, cand, 0.01, "boundary", 4096, generator=gen, k=2)
    # 1/6 of the pairs are (slot 1, slot 2) with hinge 0.01 + 1.5, and (slot 1, slot 3) 0.01 + 0.5: mean ≈ 1/6 * 2.02
    assert abs(loss.item() - 2.02 / 6) < 0.03
    with pytest.raises(ValueError, match="boundary"):
        pairwise_hinge(swapped, fut, cand, 0.01, "boundary", 16, generator=gen, k=0)


def test_sft_leaves_kvpop_to_its_own_stage_and_refuses_unknown_objectives(tmp_path):
    r = load_recipe("recipes/tiny-qwen3.yaml", ["sft.objective=kvpop"])
    with pytest.raises(ValueError, match="trained by foresight.training.kvpop.train_kvpop"):
        train_sft(r, tmp_path / "traces", tmp_path / "out", progress=False, log=lambda *_: None)
    with pytest.raises(ValueError, match="sft.objective='ranknet': must be one of foresight, kvpop"):
        load_recipe("recipes/tiny-qwen3.yaml", ["sft.objective=ranknet"])
    with pytest.raises(ValueError, match="sft.val_traces"):
        load_recipe("recipes/tiny-qwen3.yaml", ["sft.val_traces=-1"])
    assert not (tmp_path / "out").exists()


def test_sft_trains_saves_and_resumes_exactly(sft_setup, tmp_path):
    r, tdir = sft_setup
    out = tmp_path / "sft"
    bank, metrics = train_sft(r, tdir, out, progress=False, log=lambda *_: None)
    assert metrics["val_traces"] == 1 and 0 <= metrics["val_recall_at_L"] <= 1  # sft.val_traces=2, at most 6 // 4
    assert metrics["val_lost_future_ratio"] >= 1 - 1e-6  # golden's evictions lose the least future score
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["stage"] == "sft" and cfg["budget"] == 12 and cfg["llm"]["num_layers"] == 2
    assert (out / "model.safetensors").exists() and (out / "README.md").exists()
    assert any((out / "tb").iterdir())
    loaded, _ = load_scorer(out)
    for k, v in bank.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])
    # kill after step 3 (the checkpoint at step 3 exists), resume: identical final weights
    out2 = tmp_path / "sft2"
    r3 = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={r.model.path}", *SETS, "sft.steps=6", "sft.snapshots=true"])
    from foresight.runtime import atomic

    class Kill(Exception):
        pass

    orig = atomic.torch_save
    calls = []

    def save_then_kill(obj, path):
        orig(obj, path)
        calls.append(obj["step"])
        raise Kill()

    atomic.torch_save = save_then_kill
    try:
        with pytest.raises(Kill):
            train_sft(r3, tdir, out2, progress=False, log=lambda *_: None)
    finally:
        atomic.torch_save = orig
    assert calls == [3]
    with pytest.raises(ValueError, match="--resume"):
        train_sft(r3, tdir, out2, progress=False, log=lambda *_: None)
    resumed, _ = train_sft(r3, tdir, out2, resume=True, progress=False, log=lambda *_: None)
    for k, v in bank.state_dict().items():
        assert torch.allclose(v, resumed.state_dict()[k], atol=1e-6), k
    # sft.snapshots: the scorers of each checkpoint (step 3 written before the kill), the last the final ones
    assert not (out / "steps").exists()
    assert sorted(p.name for p in (out2 / "steps").iterdir()) == ["step-000003", "step-000006"]
    mid, mid_cfg = load_scorer(out2 / "steps" / "step-000003")
    assert mid_cfg["stage"] == "sft" and mid_cfg["step"] == 3 and 0 <= mid_cfg["metrics"]["recall"] <= 1
    assert any(not torch.equal(v, mid.state_dict()[k]) for k, v in resumed.state_dict().items())
    final, _ = load_scorer(out2 / "steps" / "step-000006")
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, final.state_dict()[k]), k


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_deepspeed_two_processes_equal_one_process_on_the_combined_batch(sft_setup, tmp_path, zero):
    from safetensors.torch import load_file

    r, tdir = sft_setup
    out = tmp_path / "ds"
    sets = [x for s in [f"model.path={r.model.path}", *SETS, "sft.steps=4"] for x in ("--set", s)]
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port", "29541",
           "--module", "foresight", "sft", "--recipe", "recipes/tiny-qwen3.yaml", "--traces", str(tdir),
           "--out", str(out), "--deepspeed", f"recipes/ds/{zero}.json", "--no-progress", *sets]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    w0 = load_file(str(out / "ckpt" / "final-rank0.safetensors"))
    w1 = load_file(str(out / "ckpt" / "final-rank1.safetensors"))
    r1 = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={r.model.path}", *SETS, "sft.steps=4"])
    single, _ = train_sft(r1, tdir, tmp_path / "single", progress=False, log=lambda *_: None)
    for k, v in single.state_dict().items():
        assert torch.equal(w0[k], w1[k]), k
        assert torch.allclose(w0[k], v, atol=1e-5), k


def test_resume_checks_what_it_resumes(sft_setup, tmp_path):
    """Reproductions: --resume with a changed training field trained with the old one and recorded the new one;
    --resume on a finished run wrote NaN metrics; traces of another model trained without a word."""
    from conftest import killed_after_checkpoint

    r, tdir = sft_setup
    quiet = dict(progress=False, log=lambda *_: None)
    out = tmp_path / "sft"
    with killed_after_checkpoint():
        train_sft(r, tdir, out, **quiet)  # killed right after its step-3 checkpoint
    changed = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={r.model.path}", *SETS, "sft.lr=0.05"])
    with pytest.raises(ValueError, match=r"other settings or traces: sft\.lr: 0\.01 -> 0\.05"):
        train_sft(changed, tdir, out, resume=True, **quiet)
    _, m = train_sft(r, tdir, out, resume=True, **quiet)  # the same settings resume
    assert json.loads((out / "metrics.json").read_text()) == m and m["train_loss"] == m["train_loss"]
    with pytest.raises(ValueError, match="finished SFT run of 6 steps"):
        train_sft(r, tdir, out, resume=True, **quiet)
    more = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={r.model.path}", *SETS, "sft.steps=7"])
    _, m7 = train_sft(more, tdir, out, resume=True, **quiet)  # more steps may be added
    assert m7["steps"] == 7
    # a run killed after its last checkpoint, before its final files: the resume writes them with real metrics
    late = tmp_path / "late"
    last = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={r.model.path}", *SETS, "sft.ckpt_every=10"])
    with killed_after_checkpoint():
        train_sft(last, tdir, late, **quiet)
    _, m_late = train_sft(last, tdir, late, resume=True, **quiet)
    assert isinstance(m_late["train_loss"], float) and m_late["train_loss"] == m_late["train_loss"]  # not NaN
    json.loads((late / "metrics.json").read_text())  # valid JSON
    meta = json.loads((tdir / "meta.json").read_text())
    (tdir / "meta.json").write_text(json.dumps(dict(meta, model="HuggingFaceTB/another-model")))
    with pytest.raises(ValueError, match="made by the model 'HuggingFaceTB/another-model'"):
        train_sft(r, tdir, tmp_path / "other", **quiet)


def test_stored_golden_examples_are_the_run_s_own_and_shared_between_runs(sft_setup, tmp_path, monkeypatch):
    """sft.example_steps: the stored steps equal golden_examples' (inputs to float16), a scorer with fewer features
    reads its own columns, and a second SFT run computes nothing."""
    from foresight.training.golden_store import GoldenStore, golden_examples
    from foresight.engine.models import load_model
    from foresight.scorers.bank import bank_for_model
    from foresight.data.trace_data import load_traces

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


def test_onpolicy_states_follow_the_scorer_with_golden_labels(sft_setup, tmp_path, monkeypatch):
    """sft.onpolicy (a DAgger round): the store follows the given scorer's own top-L trajectory and labels its states
    with golden's future scores; SFT starts from that scorer and adds those states; bad settings are refused."""
    from foresight.targets.golden import GoldenPolicy, block_pooled_attention
    from foresight.training.golden_store import GoldenStore
    from foresight.engine.models import load_model
    from foresight.engine.rollout import rollout
    from foresight.scorers.bank import LearnedPolicy
    from foresight.data.trace_data import load_traces

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
    from foresight.training.golden_store import GoldenStore
    from foresight.engine.models import load_model
    from foresight.scorers.bank import bank_for_model
    from foresight.training.sft import budgets_loss, example_loss, training_settings
    from foresight.data.trace_data import load_traces
    from foresight.config.checks import RecipeError

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
