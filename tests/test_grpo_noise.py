"""The GRPO gradient noise scale (studies.grpo_noise): the estimator on vectors of known signal and noise, and the
measurement on a tiny model end to end (files, resume, refusal of other settings)."""

import json

import numpy as np
import pytest
import torch

from foresight.data import traces
from foresight.config.recipe import load_recipe
from studies.grpo_noise import gram_of, noise_scale, run
from foresight.training.sft import train_sft

SETS = ["task.facts=4", "task.variables=2", "task.filler=0", "task.scratch=0", "traces.num_prompts=8",
        "traces.batch_size=4", "traces.require_correct=false", "traces.min_new_tokens=5", "traces.max_new_tokens=24",
        "cache.budget=12", "cache.interval=4", "sft.steps=3", "sft.batch_traces=2", "grpo.group=4", "grpo.eta=0.0",
        "grpo.val_traces=2"]


def gradients(signal: float, noise: float, n: int = 64, d: int = 4000, seed: int = 0) -> np.ndarray:
    """n per-trace gradients G + noise: |G|² = signal², tr(Σ) = noise² · d."""
    rng = np.random.default_rng(seed)
    G = np.zeros(d)
    G[0] = signal
    g = G + noise * rng.standard_normal((n, d))
    return g @ g.T


def test_noise_scale_recovers_a_known_signal_and_noise():
    # |G|² = 1, tr(Σ) = 0.0625 * 4000 = 250 -> B_noise = 250 traces; with 64 traces the signal is still seen
    # (|ḡ|² = 1 + 250/64 in expectation)
    s = noise_scale(gradients(1.0, 0.25))
    assert 150 < s["b_noise"] < 400 and 200 < s["trace_cov"] < 300
    assert s["signal_sq_ci"][0] < 1.0 < s["signal_sq_ci"][1]
    # a strong signal: halves agree, B_noise small
    strong = noise_scale(gradients(3.0, 0.02))
    assert strong["split_half_cosine"] > 0.9 and strong["b_noise"] < 1.0 and strong["signal_sq_ci"][0] > 5
    # no signal: the interval reaches 0 and two halves do not agree
    none = noise_scale(gradients(0.0, 0.25))
    assert none["signal_sq_ci"][0] < 0 < none["signal_sq_ci"][1] and abs(none["split_half_cosine"]) < 0.2
    with pytest.raises(ValueError, match="at least 4 traces"):
        noise_scale(np.eye(3))


def test_noise_scale_of_a_tiny_model_resumes_and_refuses_other_settings(tiny_model_dir, tmp_path):
    r = load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS])
    tdir = tmp_path / "traces"
    traces.make_traces(r, tdir, progress=False, log=lambda *_: None)
    train_sft(r, tdir, tmp_path / "sft", progress=False, log=lambda *_: None)
    out = tmp_path / "noise"
    s = run(r, tdir, tmp_path / "sft", out, n=5, log=lambda *_: None)
    files = sorted((out / "grads").glob("draw-*.pt"))
    assert len(files) == 5 and json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(s))
    g = [torch.load(f, weights_only=False) for f in files]
    informative = [x for x in g if not x["flat"]]
    assert informative, "eta=0: some group's rewards differ"
    for x in informative:  # the null control uses the same rollout with its rewards shuffled: another gradient
        assert x["real"].norm() > 0 and not torch.equal(x["real"], x["permuted"])
    for x in g:
        if x["flat"]:  # equal rewards: zero advantages, and at the start the KL term has no gradient either
            assert x["real"].abs().max() == 0
    real = torch.stack([x["real"].double() for x in g])
    assert np.allclose(gram_of(real).diagonal(), [v.norm().item() ** 2 for v in real])
    assert s["real"]["n"] == 5 and 0 <= s["flat_groups"] <= 1
    # the per-tensor figures partition the coordinates: noise and signal add up to the whole gradient's
    parts = s["real"]["by_tensor"]
    assert set(parts) == {"ln_w", "ln_b", "w1", "b1", "w2"}
    for k in ("trace_cov", "signal_sq"):
        assert sum(p[k] for p in parts.values()) == pytest.approx(s["real"][k], rel=1e-6, abs=1e-12)
    assert s["real"]["adam"]["n"] == 5 and s["real"]["adam"]["trace_cov"] > 0
    stamps = {f: f.stat().st_mtime_ns for f in files}
    again = run(r, tdir, tmp_path / "sft", out, n=5, log=lambda *_: None)  # resumed: nothing recomputed
    assert {f: f.stat().st_mtime_ns for f in files} == stamps and again["real"] == s["real"]
    with pytest.raises(ValueError, match="other settings"):
        run(load_recipe("recipes/tiny-qwen3.yaml", [f"model.path={tiny_model_dir}", *SETS, "grpo.group=6"]), tdir,
            tmp_path / "sft", out, n=5, log=lambda *_: None)
    with pytest.raises(ValueError, match="traces-n"):
        run(r, tdir, tmp_path / "sft", tmp_path / "other", n=3, log=lambda *_: None)
