import json
import math

import pytest
import torch

from conftest import eager_attentions, killed_after_checkpoint
from foresight.engine.cache.bounded import BoundedCache
from foresight.config.eviction import EvictionSettings
from foresight.config.recipe import KVpopConfig
from foresight.engine.generate import generate
from foresight.scorers.kvpop import KVpopPolicy, scorer_for_model
from foresight.targets.kvpop import forward_lse, future_attention_mass, kvpop_targets, target_from_mass
from foresight.scorers.kvpop_topk import boundary_pairs, static_priority, topk_recall, topk_sets
from foresight.engine.rollout import rollout


def dense_target(model, ids, window, eps, agg):
    att = eager_attentions(model, ids)
    S = ids.shape[1]
    out = []
    for A in att:  # [1, Hq, S, S]
        A = A[0].view(2, 2, S, S).double()
        m = torch.zeros(2, 2, S, dtype=torch.float64)
        for t in range(S):
            d0 = t + window
            if d0 < S:
                m[:, :, t] = A[:, :, d0:, t].sum(-1) / max(1, S - d0)
        logm = torch.log(eps + m)
        out.append(logm.amax(1) if agg == "max" else logm.mean(1))
    return torch.stack(out).float()


@pytest.mark.parametrize("window,agg", [(0, "max"), (5, "mean"), (13, "max")])
def test_transposed_blockwise_target_equals_dense_reference(qwen3, window, agg):
    ids = torch.randint(8, 170, (1, 53))
    got = kvpop_targets(qwen3, ids, window, eps=1e-6, agg=agg, block=16)  # 53 = 3 blocks + 5: ragged edges
    ref = dense_target(qwen3, ids, window, 1e-6, agg)
    assert got["target"].shape == (2, 2, 53)
    assert torch.allclose(got["target"], ref, atol=1e-4), (got["target"] - ref).abs().max()
    assert got["keys"].shape == (2, 2, 53, 16)


def test_target_pass_gives_the_models_attention_output():
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 40, 8), torch.randn(2, 40, 8), torch.randn(2, 40, 8)
    lse, out = forward_lse(q, k, v, 8 ** -0.5, block=7)
    ref = torch.nn.functional.scaled_dot_product_attention(q[None], k.repeat_interleave(2, 0)[None],
                                                           v.repeat_interleave(2, 0)[None], is_causal=True)[0]
    assert torch.allclose(out, ref, atol=1e-5)
    # every query's probabilities sum to one, so the future masses with window 0 sum to S
    mass = future_attention_mass(q, k, lse, 8 ** -0.5, window=0, block=7)
    assert torch.allclose(mass.sum(-1), torch.full((2, 2), 40.0), atol=1e-3)
    assert target_from_mass(mass, 0).shape == (2, 40)


def brute_pairs(p, s, w, k):
    H, S = p.shape
    t_bnd, keep = [], []
    for q in range(s + w + k, S):
        prev = list(range(s, q - w))  # E(q-1)
        rows_b, rows_k = [], []
        for h in range(H):
            best = sorted(prev, key=lambda t: (-p[h, t].item(), t))
            bnd = best[k - 1]
            rows_b.append(bnd)
            full = sorted(prev + [q - w], key=lambda t: (-p[h, t].item(), t))[:k]
            rows_k.append((q - w) in full)
        t_bnd.append(rows_b)
        keep.append(rows_k)
    return torch.tensor(t_bnd).T, torch.tensor(keep).T


@pytest.mark.parametrize("S,s,w,k", [(60, 2, 5, 7), (33, 0, 0, 1), (50, 4, 3, 20)])
def test_fenwick_cutoff_equals_brute_force_topk(S, s, w, k):
    g = torch.Generator().manual_seed(S)
    p = torch.randn(3, S, generator=g)
    got = boundary_pairs(p, s, w, k)
    t_bnd, keep = brute_pairs(p, s, w, k)
    assert torch.equal(got["t_bnd"], t_bnd)
    assert torch.equal(got["keep"], keep)
    assert torch.equal(got["t_new"], got["q"] - w)
    # the decisions replay as an eviction schedule: the kept set after q is the top-k of E(q)
    q = S - 1
    kept = topk_sets(p, s, w, k, q)
    assert int(kept.sum(-1).min()) == k


def test_decay_counts_whole_steps_on_the_absolute_grid():
    r = torch.zeros(1, 10)
    tok = torch.arange(10)[None]
    p = static_priority(r, tok, torch.tensor([[math.log(0.5)]]), 4)
    assert torch.allclose(p[0], torch.tensor([0., 0, 0, 0, 1, 1, 1, 1, 2, 2]) * math.log(2.0))


def test_topk_recall_is_one_for_identical_priorities_and_lower_otherwise():
    p = torch.randn(2, 80, generator=torch.Generator().manual_seed(0))
    assert topk_recall(p, p, 2, 8, 16, [40, 79]) == 1.0
    assert topk_recall(p, -p, 2, 8, 16, [79]) < 0.5


@pytest.mark.parametrize("kind,delayed", [("mlp", True), ("mlstm", True), ("mlstm", False)])
def test_cache_priorities_equal_whole_trace_priorities(qwen3, kind, delayed):
    """The priorities the cache computes chunk by chunk (rollout, uneven chunks) are those trained on."""
    cfg = KVpopConfig(scorer=kind, delayed=delayed, window=6, sinks=2, hidden=8, memory_dim=4, block=16)
    sc = scorer_for_model(qwen3, cfg, budget=200, seed=1)
    ids = torch.randint(8, 170, (1, 45))
    data = kvpop_targets(qwen3, ids, window=6)
    want = sc.sequence_priorities(data["keys"], data["values"])  # [nl, h, S]
    first = {}

    def rec_first(st):  # at the first eviction 35 tokens were fed with nothing evicted yet: full-cache keys
        if "p" not in first:
            v = st["view"]
            first["p"], first["tok"] = -KVpopPolicy(sc).score(v), v.token

    rollout(qwen3, ids, KVpopPolicy(sc), EvictionSettings(budget=30, interval=5), recorder=rec_first)
    p, tok = first["p"], first["tok"]
    live = (tok[:, 0] >= 0) & (tok[:, 0] <= 34 - 6)  # tokens that have left the window have been read out
    got = p[:, 0][live]
    ref = want.gather(-1, tok[:, 0].clamp(min=0))[live]
    assert live.sum() == 2 * 2 * 29
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_layout_validation_and_mlstm_needs_observation(qwen3):
    with pytest.raises(ValueError, match="top-k room"):
        scorer_for_model(qwen3, KVpopConfig(window=60, sinks=4), budget=64)
    sc = scorer_for_model(qwen3, KVpopConfig(window=16, sinks=2), budget=64)
    with pytest.raises(ValueError, match="sinks \\+ window"):
        BoundedCache(qwen3.config, KVpopPolicy(sc), EvictionSettings(budget=17, interval=4))
    cache = BoundedCache(qwen3.config, KVpopPolicy(sc), EvictionSettings(budget=64, interval=8))
    assert (cache.window, cache.settings.sinks) == (16, 2)


@pytest.mark.parametrize("kind", ["mlp", "mlstm"])
def test_generation_with_kvpop_policy_keeps_sinks_window_and_budget(qwen3, kind):
    sc = scorer_for_model(qwen3, KVpopConfig(scorer=kind, window=8, sinks=3, hidden=8, memory_dim=4), budget=24)
    ids = torch.randint(8, 170, (2, 10))
    out = generate(qwen3, ids, max_new_tokens=60, policy=KVpopPolicy(sc), settings=EvictionSettings(budget=24, interval=4))
    cache = out.cache
    assert cache.peak_slots <= 28
    tok = cache.token[:, :, :, : cache.n]
    for t in range(3):  # sinks
        assert (tok == t).any(-1).all()
    newest = cache.seen - 1
    for t in range(newest - 7, newest + 1):  # the window (the last fed token is in the cache)
        assert (tok == t).any(-1).all() or t >= cache.seen


# ------------------------------------------------------------------------------ training, checkpoint, eval
from foresight.data import traces  # noqa: E402
from foresight.scorers.checkpoint import load_scorer  # noqa: E402
from foresight.config.recipe import load_recipe  # noqa: E402
from foresight.evaluation.evaluate import run_eval  # noqa: E402
from foresight.integrations.hf import ForesightCache  # noqa: E402
from foresight.training.kvpop import boundary_loss, train_kvpop  # noqa: E402

KSETS = ["task.facts=4", "task.variables=2", "task.filler=0", "task.scratch=0", "traces.num_prompts=6",
         "traces.batch_size=3", "traces.require_correct=false", "traces.min_new_tokens=20", "traces.max_new_tokens=24",
         "cache.budget=20", "cache.interval=4", "sft.steps=8", "sft.batch_traces=2", "sft.ckpt_every=4",
         "sft.warmup=1", "sft.lr=0.01", "sft.objective=kvpop", "kvpop.sinks=2", "kvpop.window=4", "kvpop.hidden=8",
         "kvpop.memory_dim=4", "kvpop.decay_step=8", "kvpop.queries_per_trace=16", "eval.num_problems=2"]


def test_boundary_loss_prefers_the_teachers_decisions():
    ex = {"t_new": torch.tensor([5, 6]), "t_bnd": torch.tensor([[[1, 2]]]), "keep": torch.tensor([[[True, False]]]),
          "gap": torch.tensor([[[1.0, 1.0]]])}
    kc = KVpopConfig(margin=0.5, tau=1.0)
    good = torch.zeros(1, 1, 8)
    good[0, 0, 5], good[0, 0, 6] = 3.0, -3.0  # keeps t_new=5 above its cut-off, drops t_new=6 below
    bad = -good
    lg, ag = boundary_loss(good, ex, kc)
    lb, ab = boundary_loss(bad, ex, kc)
    assert ag.item() == 1.0 and ab.item() == 0.0
    assert lg.item() < 0.05 < 3.0 < lb.item()
    # near-ties of the teacher weigh less (margin weighting)
    half = torch.zeros(1, 1, 8)
    half[0, 0, 5], half[0, 0, 6] = -3.0, -3.0  # wrong on the first query, right on the second
    ex_tie = dict(ex, gap=torch.tensor([[[0.05, 1.0]]]))
    assert boundary_loss(half, ex_tie, kc)[0].item() < 0.5 * boundary_loss(half, ex, kc)[0].item()


@pytest.mark.parametrize("kind,delayed", [("mlp", True), ("mlstm", True), ("mlstm", False)])
def test_kvpop_sft_trains_saves_resumes_and_evaluates(tiny_model_dir, tmp_path, kind, delayed):
    r = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *KSETS, f"kvpop.scorer={kind}",
                                                f"kvpop.delayed={delayed}"])
    traces.make_traces(r, tmp_path / "tr", progress=False, log=lambda *_: None)
    out = tmp_path / "kv"
    scorer, metrics = train_kvpop(r, tmp_path / "tr", out, progress=False, log=lambda *_: None)
    stage = "kvpop-mlp" if kind == "mlp" else f"kvpop-mlstm-{'delayed' if delayed else 'immediate'}"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["stage"] == stage and cfg["scorer"]["kind"] == f"kvpop-{kind}" and cfg["scorer"]["window"] == 4
    assert 0.0 <= metrics["val_topk_recall"] <= 1.0 and "KVpop" in (out / "README.md").read_text()
    loaded, _ = load_scorer(out)
    for k, v in scorer.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    if kind == "mlstm" and delayed:  # resume after a kill gives the same weights

        with killed_after_checkpoint():
            train_kvpop(r, tmp_path / "tr", tmp_path / "kv2", progress=False, log=lambda *_: None)
        resumed, _ = train_kvpop(r, tmp_path / "tr", tmp_path / "kv2", resume=True, progress=False,
                                 log=lambda *_: None)
        for k, v in scorer.state_dict().items():
            assert torch.allclose(v, resumed.state_dict()[k], atol=1e-6), k
    rows = run_eval(r, tmp_path / "ev", methods="full,streamingllm,kvpop-oracle", budgets="20:4", scorers=[out],
                    progress=False, log=lambda *_: None)
    oracle = next(x for x in rows if x["method"] == "kvpop-oracle")
    assert oracle["accuracy"] is None and oracle["loss_ratio"] > 0 and oracle["mean_cache"] <= 24
    row = next(x for x in rows if x["method"] == stage)
    assert row["mean_cache"] <= 24 and row["loss_ratio"] > 0
    assert (row["recall_at_L"] is None) == (kind == "mlstm")
    # the checkpoint drives plain transformers generate with its own layout
    from foresight.engine.models import load_model

    model, _ = load_model(r.model)
    cache = ForesightCache.from_pretrained(out, model, budget=20, interval=4)
    assert (cache.window, cache.settings.sinks) == (4, 2)
    ids = torch.randint(8, 170, (1, 12))
    model.generate(ids, cache=cache, max_new_tokens=30, do_sample=False)
    assert cache.n <= 24 and cache.seen >= 30


@pytest.mark.slow
def test_kvpop_deepspeed_two_processes_equal_one_process(tiny_model_dir, tmp_path):
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    sets = [f"model.path={tiny_model_dir}", *KSETS, "kvpop.scorer=mlstm", "sft.steps=3", "kvpop.queries_per_trace=8"]
    r = load_recipe("recipes/tiny-qwen3.yaml", sets)
    traces.make_traces(r, tmp_path / "tr", progress=False, log=lambda *_: None)
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port", "29543",
           "--module", "foresight", "sft", "--recipe", "recipes/tiny-qwen3.yaml", "--traces", str(tmp_path / "tr"),
           "--out", str(tmp_path / "ds"), "--deepspeed", "recipes/ds/zero2.json", "--no-progress",
           *[x for s in sets for x in ("--set", s)]]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    w0 = load_file(str(tmp_path / "ds" / "ckpt" / "final-rank0.safetensors"))
    w1 = load_file(str(tmp_path / "ds" / "ckpt" / "final-rank1.safetensors"))
    single, _ = train_kvpop(r, tmp_path / "tr", tmp_path / "single", progress=False, log=lambda *_: None)
    for k, v in single.state_dict().items():
        assert torch.equal(w0[k], w1[k]), k
        assert torch.allclose(w0[k], v, atol=1e-5), k


def test_mlstm_one_shot_prefill_is_processed_in_blocks(qwen3):
    """transformers' generate feeds the whole prompt at once: the mLSTM splits it and gets the same priorities."""
    sc = scorer_for_model(qwen3, KVpopConfig(scorer="mlstm", window=5, sinks=1, hidden=8, memory_dim=4, block=8),
                          budget=100)
    ids = torch.randint(8, 170, (1, 30))
    data = kvpop_targets(qwen3, ids, window=5)
    want = sc.sequence_priorities(data["keys"], data["values"])
    cache = BoundedCache(qwen3.config, KVpopPolicy(sc), EvictionSettings(budget=100, interval=4))
    with torch.no_grad():
        qwen3(input_ids=ids, cache=cache, use_cache=True)
    r = cache.slots.extra["kvpop_r"][:, 0, :, :25]
    got = sc.priority(r[:, None], torch.arange(25).expand(2, 1, 2, 25))[:, 0]
    assert torch.allclose(got, want[..., :25], atol=1e-4)
