import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import SFT_SETS as SETS

from foresight.config.recipe import load_recipe
from foresight.scorers.checkpoint import load_scorer
from foresight.training.ranking import HingeSettings, lost_future
from foresight.training.sft import pairwise_hinge, recall_at_l, train_sft


def test_pairwise_hinge_all_and_sampled_agree_on_a_crafted_row():
    phi = torch.tensor([[3.0, 2.0, 1.0, 0.0]])  # perfectly ordered: i evicted before j when fut_i < fut_j
    fut = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    cand = torch.ones(1, 4, dtype=torch.bool)
    loss, rows = pairwise_hinge(phi, fut, cand, HingeSettings(margin=0.01))
    assert rows == 1 and loss.item() == 0.0
    bad = phi.flip(-1)
    loss, _ = pairwise_hinge(bad, fut, cand, HingeSettings(margin=0.01))
    # pairs (i<j): phi_i - phi_j = -(j-i); hinge = 0.01 + (j - i); mean over 6 pairs = 0.01 + 10/6
    assert abs(loss.item() - (0.01 + 10 / 6)) < 1e-6
    s, _ = pairwise_hinge(bad, fut, cand, HingeSettings(margin=0.01, pairs="sampled", sampled=20000),
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

    uni = [pairwise_hinge(p, fut, cand, HingeSettings(margin=0.01))[0].item() for p in (near_tie, costly)]
    assert abs(uni[0] - uni[1]) < 1e-6  # uniform: the same one swap of adjacent slots
    gap = [pairwise_hinge(p, fut, cand, HingeSettings(margin=0.01, weight="gap"))[0].item() for p in (near_tie, costly)]
    assert abs(gap[0] - brute(near_tie)) < 1e-6 and abs(gap[1] - brute(costly)) < 1e-6
    assert gap[1] > 100 * gap[0]
    s, _ = pairwise_hinge(costly, fut, cand, HingeSettings(margin=0.01, pairs="sampled", sampled=40000, weight="gap"),
                          generator=torch.Generator().manual_seed(0))
    assert abs(s.item() - gap[1]) < 0.05 * gap[1]
    b, _ = pairwise_hinge(costly, fut, cand, HingeSettings(margin=0.01, pairs="boundary", sampled=40000, k=3, weight="gap"),
                          generator=torch.Generator().manual_seed(0))
    # golden evicts slots 0-2 and keeps 3: pairs (0, 3), (1, 3), (2, 3), only the last one wrong (hinge 1.01)
    assert abs(b.item() - 1.01 * 0.497 / (0.499 + 0.498 + 0.497)) < 0.02
    with pytest.raises(ValueError, match="pair_weight"):
        pairwise_hinge(costly, fut, cand, HingeSettings(margin=0.01, weight="square"))


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
    loss, rows = pairwise_hinge(set_right, fut, cand, HingeSettings(margin=0.01, pairs="boundary", sampled=256, k=2),
                                generator=gen)
    assert rows == 1 and loss.item() == 0.0
    assert pairwise_hinge(set_right, fut, cand, HingeSettings(margin=0.01))[0].item() > 0  # all pairs: the inner order counts
    swapped = torch.tensor([[1.0, -1.5, 0.0, -1.0, -2.0, 5.0]])  # slot 1 (golden evicts it) below slot 2 (kept)
    loss, _ = pairwise_hinge(swapped, fut, cand, HingeSettings(margin=0.01, pairs="boundary", sampled=4096, k=2), generator=gen)
    # 1/6 of the pairs are (slot 1, slot 2) with hinge 0.01 + 1.5, and (slot 1, slot 3) 0.01 + 0.5: mean ≈ 1/6 * 2.02
    assert abs(loss.item() - 2.02 / 6) < 0.03
    with pytest.raises(ValueError, match="boundary"):
        pairwise_hinge(swapped, fut, cand, HingeSettings(margin=0.01, pairs="boundary", sampled=16, k=0), generator=gen)


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


@pytest.mark.slow
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


