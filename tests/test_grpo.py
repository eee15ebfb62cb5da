import json

import pytest
import torch
from conftest import killed_after_checkpoint

from foresight.config.recipe import load_recipe
from foresight.data import traces
from foresight.training.grpo.stage import train_grpo
from foresight.training.sft import train_sft

SETS = ["task.facts=4", "task.variables=2", "task.filler=0", "task.scratch=0", "traces.num_prompts=6",
        "traces.batch_size=3", "traces.require_correct=false", "traces.min_new_tokens=5", "traces.max_new_tokens=24",
        "cache.budget=12", "cache.interval=4", "sft.steps=3", "sft.batch_traces=2", "grpo.steps=3",
        "grpo.traces_per_step=2", "grpo.group=4", "grpo.eta=0.0", "grpo.epochs=2", "grpo.ckpt_every=2", "grpo.warmup=1"]


def test_grpo_runs_checkpoints_and_resumes(tiny_model_dir, tmp_path):
    r = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS, "grpo.ratio=draw"])
    tdir = tmp_path / "traces"
    traces.make_traces(r, tdir, progress=False, log=lambda *_: None)
    train_sft(r, tdir, tmp_path / "sft", progress=False, log=lambda *_: None)
    bank, metrics = train_grpo(r, tdir, tmp_path / "sft", tmp_path / "grpo", progress=False, log=lambda *_: None)
    cfg = json.loads((tmp_path / "grpo" / "config.json").read_text())
    assert cfg["stage"] == "grpo" and "val_loss_ratio" in cfg["metrics"] and "sft_val_loss_ratio" in cfg["metrics"]
    assert any((tmp_path / "grpo" / "tb").iterdir())
    # the traces it was trained on, by content: its own training split's and its SFT start's
    from foresight.data.trace_data import fingerprint, load_traces

    ds = load_traces(tdir)
    sft_seen = json.loads((tmp_path / "sft" / "config.json").read_text())["training_traces"]["traces"]
    own = {fingerprint(ds[i]["input_ids"]) for i in range(len(ds) - metrics["val_traces"])}
    assert set(cfg["training_traces"]["traces"]) == own | set(sft_seen) and len(sft_seen) >= 1
    # the held-out curve: a point with its bootstrap interval at every checkpoint (steps 2 and 3), none between
    hist = metrics["history"]
    assert [i + 1 for i, h in enumerate(hist) if "val_reward" in h] == [2, 3]
    for h in hist[1:]:
        for k in ("val_reward", "val_loss_ratio"):  # intervals are rounded to 4 digits
            assert h[f"{k}_lo"] - 1e-4 <= h[k] <= h[f"{k}_hi"] + 1e-4
    assert metrics["val_reward"] == round(hist[-1]["val_reward"], 5) and metrics["val_traces"] >= 1
    for h in hist[1:]:  # the change since the SFT start, paired over the same held-out traces
        assert abs(h["val_loss_ratio_change"] - (h["val_loss_ratio"] - metrics["sft_val_loss_ratio"])) < 1e-4
        assert h["val_loss_ratio_change_lo"] - 1e-4 <= h["val_loss_ratio_change"] <= h["val_loss_ratio_change_hi"] + 1e-4
    assert all(0 <= h["group_overlap"] <= 1 and 0 <= h["flat_groups"] <= 1 for h in hist)
    # the scorers moved away from the SFT start
    from foresight.scorers.checkpoint import load_scorer

    sft_bank, _ = load_scorer(tmp_path / "sft")
    assert any(not torch.equal(a, b) for a, b in zip(sft_bank.state_dict().values(), bank.state_dict().values()))
    with pytest.raises(ValueError, match="--resume"):
        train_grpo(r, tdir, tmp_path / "sft", tmp_path / "grpo", progress=False, log=lambda *_: None)
    # a run killed right after its step-2 checkpoint (written by the stages' shared save_progress) and resumed
    # ends with the same weights

    # (this run also keeps its snapshots: a setting a resume may change, which does not change the training)
    r2 = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS, "grpo.ratio=draw",
                                                 "grpo.snapshots=true"])
    with killed_after_checkpoint():
        train_grpo(r2, tdir, tmp_path / "sft", tmp_path / "grpo2", progress=False, log=lambda *_: None)
    assert torch.load(tmp_path / "grpo2" / "ckpt" / "state.pt", weights_only=False)["step"] == 2
    resumed, m2 = train_grpo(r2, tdir, tmp_path / "sft", tmp_path / "grpo2", resume=True, progress=False,
                             log=lambda *_: None)
    assert "val_reward" in m2["history"][1]  # the point validated before the kill is in the resumed run's curve
    assert "val_loss_ratio_change" in m2["history"][2]  # the start's per-trace losses survive the kill
    for k, v in bank.state_dict().items():
        assert torch.allclose(v, resumed.state_dict()[k], atol=1e-6), k
    # snapshots: one standalone, loadable checkpoint per checkpoint step (step 2 written before the kill), the last
    # one the final scorers; none without the setting
    assert not (tmp_path / "grpo" / "steps").exists()
    steps = tmp_path / "grpo2" / "steps"
    assert sorted(p.name for p in steps.iterdir()) == ["step-000002", "step-000003"]
    snap, snap_cfg = load_scorer(steps / "step-000002")
    assert snap_cfg["stage"] == "grpo" and snap_cfg["step"] == 2 and snap_cfg["metrics"]["step"] == 2
    assert snap_cfg["metrics"]["reward_mean"] == pytest.approx(m2["history"][1]["reward_mean"], abs=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(snap.state_dict().values(), resumed.state_dict().values()))
    last, _ = load_scorer(steps / "step-000003")
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, last.state_dict()[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["zero2", "zero3-partitioned"])
def test_grpo_deepspeed_two_processes_equal_one_process(tiny_model_dir, tmp_path, zero):
    """ZeRO-2, and ZeRO-3 with a persistence threshold that would partition every scorer weight: the engine keeps
    the bank whole (its forward calls per process differ with the traces' lengths), so rollouts, checkpoints and
    the final weights see full tensors."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    r = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS, "grpo.steps=2"])
    tdir = tmp_path / "traces"
    traces.make_traces(r, tdir, progress=False, log=lambda *_: None)
    train_sft(r, tdir, tmp_path / "sft", progress=False, log=lambda *_: None)
    sets = [x for s in [f"model.path={tiny_model_dir}", *SETS, "grpo.steps=2"] for x in ("--set", s)]
    out = tmp_path / "ds"
    ds_config = "recipes/ds/zero2.json"
    if zero == "zero3-partitioned":
        conf = json.loads(open("recipes/ds/zero3.json").read())
        conf["zero_optimization"]["stage3_param_persistence_threshold"] = 10
        ds_config = tmp_path / "zero3.json"
        ds_config.write_text(json.dumps(conf))
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port", "29543",
           "--module", "foresight", "grpo", "--recipe", "recipes/tiny-qwen3.yaml", "--traces", str(tdir),
           "--init", str(tmp_path / "sft"), "--out", str(out), "--deepspeed", str(ds_config),
           "--no-progress", *sets]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    w0 = load_file(str(out / "ckpt" / "final-rank0.safetensors"))
    w1 = load_file(str(out / "ckpt" / "final-rank1.safetensors"))
    # the one-process reference runs in the same environment (1 thread): sampled evictions among near-tied
    # scores of a random tiny model are sensitive to float summation order
    one = [sys.executable, "-m", "foresight", "grpo", "--recipe", "recipes/tiny-qwen3.yaml", "--traces", str(tdir),
           "--init", str(tmp_path / "sft"), "--out", str(tmp_path / "single"), "--no-progress", *sets]
    res = subprocess.run(one, capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    single = load_file(str(tmp_path / "single" / "model.safetensors"))
    init = load_file(str(tmp_path / "sft" / "model.safetensors"))
    for k, v in single.items():
        assert torch.equal(w0[k], w1[k]), k  # the ranks stay in sync
        # equal to the one-process run on the combined batch up to float summation order (measured ≤ 6e-8 against
        # a 1.2e-3 change); a scorer output bias once made this ~1e-4 (its gradient is exactly zero, Adam amplified
        # the noise), which is why the scorers have none
        assert torch.allclose(w0[k], v, atol=1e-6), k
    assert any(not torch.equal(init[k], w0[k]) for k in init)


def test_the_default_and_every_shipped_recipe_use_the_ratio_whose_clip_acts():
    """``ratio=set`` never clipped (the test above; on the tiny teacher at 32 traces/step and lr 3e-4 it lost its
    own reward within 10 steps): the default and every recipe in recipes/ refine with per-draw ratios."""
    from pathlib import Path

    from foresight.config.recipe import GRPOConfig

    assert GRPOConfig().ratio == "draw"
    recipes = sorted(Path(__file__).resolve().parents[1].joinpath("recipes").glob("*.yaml"))
    assert len(recipes) >= 5
    for path in recipes:
        assert load_recipe(path, []).grpo.ratio == "draw", path.name


def test_skip_flat_takes_no_step_when_no_group_has_a_signal(tiny_model_dir, tmp_path):
    """With every reward 0 (eta far above any loss increase) all groups are flat: grpo.skip_flat takes no optimiser
    step (the scorers stay the SFT ones, Adam's moments stay empty), while the default steps Adam on the KL alone
    (from the SFT start its gradient is 0; after an informative step, its momentum and the KL move the scorers)."""
    from safetensors.torch import load_file

    base = [f"model.path={tiny_model_dir}", *SETS, "grpo.eta=1e9", "grpo.lr=0.01"]
    r = load_recipe("recipes/tiny-qwen3.yaml", base)
    tdir = tmp_path / "traces"
    traces.make_traces(r, tdir, progress=False, log=lambda *_: None)
    train_sft(r, tdir, tmp_path / "sft", progress=False, log=lambda *_: None)
    sft = load_file(tmp_path / "sft" / "model.safetensors")
    for skip in (True, False):
        rr = load_recipe("recipes/tiny-qwen3.yaml", [*base, f"grpo.skip_flat={str(skip).lower()}"])
        out = tmp_path / f"grpo-{skip}"
        _, metrics = train_grpo(rr, tdir, tmp_path / "sft", out, progress=False, log=lambda *_: None)
        assert all(h["flat_groups"] == 1.0 and h["skipped"] == float(skip) for h in metrics["history"])
        adam = torch.load(out / "ckpt" / "state.pt", weights_only=False)["opt"]["state"]
        steps = {int(v["step"]) for v in adam.values()}
        assert steps == (set() if skip else {rr.grpo.steps * rr.grpo.epochs})
        if skip:
            after = load_file(out / "model.safetensors")
            assert all(torch.equal(after[k], sft[k]) for k in sft)


def test_permuted_control_keeps_the_rewards_but_not_which_trajectory_earned_them(tiny_model_dir, tmp_path):
    """grpo.control=permuted (the null control): the first step draws the same trajectories and rewards as the real
    run, shuffled within each group, so the update has the same size and none of the rewards' information."""
    from safetensors.torch import load_file

    base = [f"model.path={tiny_model_dir}", *SETS, "grpo.steps=1", "grpo.lr=0.01", "grpo.warmup=0"]
    r = load_recipe("recipes/tiny-qwen3.yaml", base)
    tdir = tmp_path / "traces"
    traces.make_traces(r, tdir, progress=False, log=lambda *_: None)
    train_sft(r, tdir, tmp_path / "sft", progress=False, log=lambda *_: None)
    runs = {}
    for control in ("none", "permuted"):
        rr = load_recipe("recipes/tiny-qwen3.yaml", [*base, f"grpo.control={control}"])
        _, metrics = train_grpo(rr, tdir, tmp_path / "sft", tmp_path / control, progress=False, log=lambda *_: None)
        runs[control] = (metrics["history"][0], load_file(tmp_path / control / "model.safetensors"))
    (h0, w0), (h1, w1) = runs["none"], runs["permuted"]
    assert h0["flat_groups"] < 1
    for k in ("reward_mean", "reward_std", "adv_abs", "group_overlap"):
        assert h1[k] == pytest.approx(h0[k], abs=1e-6), k
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
    for setting, name in (("grpo.control=shuffled", "grpo.control"), ("grpo.low_entropy_below=-1", "low_entropy_below")):
        bad = load_recipe("recipes/tiny-qwen3.yaml", [*base, setting])
        with pytest.raises(ValueError, match=name):
            train_grpo(bad, tdir, tmp_path / "sft", tmp_path / "bad", progress=False, log=lambda *_: None)


def test_grpo_budgets_roll_out_each_budget_in_turn(tiny_model_dir, tmp_path, monkeypatch):
    import foresight.training.grpo.stage as grpo_mod

    r = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS, "grpo.steps=2",
                                                "grpo.budgets=12:4,16:4", "grpo.val_traces=0"])
    tdir = tmp_path / "traces"
    traces.make_traces(r, tdir, progress=False, log=lambda *_: None)
    train_sft(r, tdir, tmp_path / "sft", progress=False, log=lambda *_: None)
    seen, orig = [], grpo_mod.group_rollout

    def recording(model, bank, ids, G, settings, *a, **k):
        seen.append((settings.budget, settings.interval))
        return orig(model, bank, ids, G, settings, *a, **k)

    monkeypatch.setattr(grpo_mod, "group_rollout", recording)
    _, metrics = train_grpo(r, tdir, tmp_path / "sft", tmp_path / "grpo", progress=False, log=lambda *_: None)
    assert seen == [(12, 4), (16, 4)] * 2 and len(metrics["history"]) == 2  # 2 steps x 2 traces, one per budget
    cfg = json.loads((tmp_path / "grpo" / "config.json").read_text())
    assert cfg["recipe"]["grpo"]["budgets"] == "12:4,16:4" and cfg["budget"] == 12  # the cache's own, as validated
    bad = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS, "grpo.budgets=12:4,16:4,20:4"])
    with pytest.raises(ValueError, match="multiple of the number of grpo.budgets"):
        train_grpo(bad, tdir, tmp_path / "sft", tmp_path / "grpo-bad", progress=False, log=lambda *_: None)
    with pytest.raises(Exception, match="BUDGET:INTERVAL"):
        load_recipe("recipes/tiny-qwen3.yaml", ["grpo.budgets=12-4"])
