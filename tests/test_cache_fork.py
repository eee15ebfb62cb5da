"""A bounded cache forked at its first eviction point (foresight.engine.cache.fork, RolloutOptions(prefix=...)): every policy
continues from a shared prefix pass with the losses, slots held and eviction choices of a rollout from token 0."""

import pytest
import torch

from foresight.engine.cache.bounded import BoundedCache
from foresight.engine.cache.fork import fork, uses_probabilities
from foresight.config.eviction import EvictionSettings
from foresight.targets.golden import GoldenPolicy, block_pooled_attention
from foresight.policies import REGISTRY, make_policy
from foresight.engine.rollout import RolloutOptions, rollout, shared_prefix
from foresight.scorers.bank import LearnedPolicy, bank_for_model
from foresight.engine.cache.attention_stats import accumulations


@pytest.fixture(scope="module")
def setup():
    from conftest import tiny_qwen3

    model = tiny_qwen3()
    torch.manual_seed(0)
    ids = torch.randint(8, 170, (3, 120))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :7] = False  # a left-padded row
    full = rollout(model, ids, attention_mask=mask)
    return model, ids, mask, (full.token_loss, full.token_entropy)


def policies(model):
    out = {name: (lambda name=name: make_policy(name)) for name in REGISTRY}
    out["learned"] = lambda: LearnedPolicy(bank_for_model(model))
    out["learned-ahead"] = lambda: LearnedPolicy(bank_for_model(model, features=("key", "value", "attn", "ahead")))

    def with_layout():  # a policy that brings its own sinks and protected window, as KVpop's do
        pol = make_policy("tova")
        pol.layout_window, pol.layout_sinks = 16, 3
        return pol

    out["layout"] = with_layout
    return out


@pytest.mark.parametrize("settings, prompt_len", [
    (EvictionSettings(budget=24, interval=8), None),
    (EvictionSettings(budget=24, interval=8, protect_prompt=True), 10),  # the prompt held besides the budget
    (EvictionSettings(budget=24, interval=8, protect_prompt=True, prompt_overflow="evict"), 30),  # fallback
    (EvictionSettings(budget=24, interval=8, sinks=2, selection="sample", temperature=0.3), None),
])
def test_every_policy_continues_from_a_shared_prefix_bit_for_bit(setup, settings, prompt_len):
    model, ids, mask, full = setup
    base = settings.replace(selection="topk", sinks=0)  # what acts at evictions only may differ from the prefix's
    prefixes = {p: shared_prefix(model, ids, base, prompt_len=prompt_len, attention_mask=mask, probabilities=p,
                                 options=RolloutOptions(full=full, entropy=False)) for p in (True, False)}
    assert prefixes[True].end == 32 + (10 if prompt_len == 10 else 0)  # B + L (+ the protected prompt)
    for name, make in policies(model).items():
        pol = make()
        probs = uses_probabilities(accumulations(getattr(pol, "reads", None)))
        kw = dict(prompt_len=prompt_len, attention_mask=mask)
        a = rollout(model, ids, make(), settings, **kw, options=RolloutOptions(torch.Generator().manual_seed(3),
                                                                               full=full, entropy=False))
        b = rollout(model, ids, pol, settings, **kw, options=RolloutOptions(torch.Generator().manual_seed(3), full=full,
                                                                            entropy=False, prefix=prefixes[probs]))
        assert torch.equal(a.token_loss, b.token_loss), name
        assert torch.equal(a.held_per_row, b.held_per_row) and a.mean_held == b.mean_held, name
        assert a.peak_slots == b.peak_slots, name
    # the prefixes are left as they were: a second fork gives the same losses again
    again, first = (rollout(model, ids, make_policy("h2o"), settings, prompt_len=prompt_len, attention_mask=mask,
                            options=RolloutOptions(full=full, entropy=False, generator=torch.Generator().manual_seed(3),
                                                   prefix=p))
                    for p in (prefixes[True], None))
    assert torch.equal(again.token_loss, first.token_loss)


def test_recorded_steps_and_repeated_rows_continue_from_one_row(setup):
    """GRPO's G trajectories of one trace: a one-row prefix, repeated G times, with the steps recorded (every
    statistic), the sampler drawing from the same generator: the same choices and losses as G rows from token 0."""
    model, ids, _, _ = setup
    settings = EvictionSettings(budget=24, interval=8, selection="sample", temperature=0.5)
    x = ids[1:2]
    prefix = shared_prefix(model, x, settings, probabilities=True)
    runs = []
    for p in (None, prefix):
        chosen = []
        res = rollout(model, x.expand(4, -1), LearnedPolicy(bank_for_model(model)), settings,
                      recorder=lambda st: chosen.append(st["chosen"].clone()),
                      options=RolloutOptions(generator=torch.Generator().manual_seed(5), prefix=p))
        runs.append((res, chosen))
    (a, ca), (b, cb) = runs
    assert len(ca) == len(cb) > 5 and all(torch.equal(u, v) for u, v in zip(ca, cb))
    assert torch.allclose(a.token_loss, b.token_loss, atol=1e-6) and torch.allclose(a.token_entropy, b.token_entropy,
                                                                                     atol=1e-6)
    assert (b.token_entropy[:, 1:] > 0).all()  # the prefix computed its entropies (no full cache was given)


def test_golden_recording_continues_from_the_prefix(setup):
    """The evaluation's golden pass: golden's trajectory with every statistic recorded for the scorers' recall."""
    model, ids, mask, full = setup
    settings = EvictionSettings(budget=24, interval=8)
    future = block_pooled_attention(model, ids, settings, "mean").futures()
    prefix = shared_prefix(model, ids, settings, attention_mask=mask, probabilities=True,
                           options=RolloutOptions(full=full, entropy=False))
    out = []
    for p in (None, prefix):
        views = []
        res = rollout(model, ids, GoldenPolicy(torch.stack(future)), settings, attention_mask=mask,
                      recorder=lambda st: views.append(st["view"].stats["sum"].clone()),
                      options=RolloutOptions(full=full, entropy=False, prefix=p))
        out.append((res.token_loss, views))
    assert torch.equal(out[0][0], out[1][0])
    assert len(out[0][1]) == len(out[1][1]) > 0 and all(torch.equal(u, v) for u, v in zip(out[0][1], out[1][1]))


def test_a_fork_that_would_change_the_results_is_refused(setup):
    model, ids, mask, full = setup
    settings = EvictionSettings(budget=24, interval=8)
    fused = shared_prefix(model, ids, settings, attention_mask=mask, probabilities=False,
                          options=RolloutOptions(full=full, entropy=False))
    with pytest.raises(ValueError, match="same attention path"):  # a scorer needs the explicit probabilities' path
        rollout(model, ids, LearnedPolicy(bank_for_model(model)), settings, attention_mask=mask,
                options=RolloutOptions(full=full, entropy=False, prefix=fused))
    with pytest.raises(ValueError, match="schedule"):  # another budget
        rollout(model, ids, make_policy("tova"), settings.replace(budget=32), attention_mask=mask,
                options=RolloutOptions(full=full, entropy=False, prefix=fused))
    with pytest.raises(ValueError, match="other rows"):
        rollout(model, ids.flip(0), make_policy("tova"), settings, attention_mask=mask,
                options=RolloutOptions(full=full, entropy=False, prefix=fused))
    losses_only = shared_prefix(model, ids, settings, attention_mask=mask, probabilities=False,
                                options=RolloutOptions(entropy=False))
    with pytest.raises(ValueError, match="entropies"):
        rollout(model, ids, make_policy("tova"), settings, attention_mask=mask, options=RolloutOptions(prefix=losses_only))

    class Stateful(type(make_policy("h2o"))):
        def observe(self, cache, layer, first, count):
            pass

    with pytest.raises(ValueError, match="stateful"):
        fork(fused.cache, Stateful(), settings)
    from conftest import feed_chunks

    evicted = BoundedCache(model.config, make_policy("h2o"), settings)
    feed_chunks(model, evicted, ids[:, :60])
    with pytest.raises(ValueError, match="has not evicted"):
        fork(evicted, make_policy("h2o"), settings)


def test_recorded_chunks_replay_after_a_fork(setup, monkeypatch):
    """``step="graph"``: a forked cache's chunks after the first eviction are recorded and replayed (torch.fx on a CPU,
    the tests' stand-in for CUDA graphs) with the losses of an eager rollout from token 0."""
    from foresight.engine.recorded import Recording

    model, ids, mask, full = setup
    replays = []
    replay = Recording.replay
    monkeypatch.setattr(Recording, "replay", lambda self: replays.append(1) or replay(self))
    settings = EvictionSettings(budget=24, interval=8)
    prefix = shared_prefix(model, ids, settings, attention_mask=mask, probabilities=True,
                           options=RolloutOptions(full=full, entropy=False))
    eager = rollout(model, ids, make_policy("h2o"), settings, attention_mask=mask,
                    options=RolloutOptions(full=full, entropy=False, step="eager"))
    graph = rollout(model, ids, make_policy("h2o"), settings, attention_mask=mask,
                    options=RolloutOptions(full=full, entropy=False, step="graph", prefix=prefix))
    assert torch.equal(eager.token_loss, graph.token_loss) and replays
