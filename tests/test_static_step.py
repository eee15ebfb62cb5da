"""The capturable decoding step: static shapes and positions on the device, recorded once and
replayed. A CUDA graph cannot be made on a CPU; its stand-in here is a ``torch.fx`` recording of the same step (every
Python value of the recording baked in, the aten operations replayed on the live buffers), which fails the same way a
graph would if the step read host state that changes from one token to the next."""

import pytest
import torch

from foresight.config.eviction import EvictionSettings
from foresight.engine.generate import Decoding, GenerateOptions, generate
from foresight.policies import make_policy
from foresight.policies.base import Policy
from foresight.engine.rollout import Chunking, forward_chunks, make_cache
from foresight.scorers.bank import LearnedPolicy, bank_for_model
from foresight.engine.static_step import SYNC_OPS, StaticDecoder
from tests.conftest import tiny_qwen3

SETTINGS = EvictionSettings(budget=24, interval=8)


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3(0)


def _prompts(b: int = 3, P: int = 37):
    ids = torch.randint(3, 50, (b, P), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in one row
    return ids, mask


def _policy(name, model):
    return LearnedPolicy(bank_for_model(model)) if name == "learned" else make_policy(name)


@pytest.mark.parametrize("policy", ["h2o", "tova", "snapkv", "scissorhands", "streamingllm", "learned"])
def test_static_and_recorded_steps_decode_like_the_eager_step(model, policy):
    """Sampled generation of 50 tokens (5 evictions past the prompt's), a padded batch: the same tokens, log-probs
    equal to float rounding (the static step also sums over masked empty slots), the same kept slots at the end."""
    ids, mask = _prompts()
    runs = {}
    for step in ("eager", "static", "graph"):
        runs[step] = generate(model, ids, mask, max_new_tokens=50, policy=_policy(policy, model), settings=SETTINGS,
                              decoding=Decoding(do_sample=True, top_k=20),
                              options=GenerateOptions(torch.Generator().manual_seed(0), step=step))
    eager = runs["eager"]
    for step in ("static", "graph"):
        r = runs[step]
        assert torch.equal(r.new_tokens, eager.new_tokens), step
        assert torch.allclose(r.logprobs, eager.logprobs, atol=1e-5, rtol=0), step
        assert torch.equal(r.cache.token, eager.cache.token), step  # every kept set, every layer and head
        assert r.cache.steps == eager.cache.steps > 5 and r.peak_slots == eager.peak_slots == 32


def _decode(model, capture, steps: int):
    ids, mask = _prompts()
    cache = make_cache(model, make_policy("h2o"), SETTINGS, prompt_len=ids.shape[1])
    for _, _, logits in forward_chunks(model, cache, ids, mask.bool(), Chunking(1024, logits_from=ids.shape[1])):
        last = logits[:, -1]
    dec = StaticDecoder(model, cache, capture=capture)
    pos, out = mask.sum(-1), []
    for _ in range(steps):
        last = dec.step(last.argmax(-1), pos).clone()
        out.append(last)
        pos = pos + 1
    return dec, torch.stack(out, 1)


def test_a_recorded_step_replays_every_later_token_without_host_syncs(model):
    """The step is recorded at the third token and replayed for 37 more, across four evictions: logits bit-identical
    to running the static step each time, so nothing in it is a baked position; the recording holds no operation
    that waits for the device and writes its pairs at a device-side slot."""
    eager, ref = _decode(model, None, 40)
    dec, rec = _decode(model, "fx", 40)
    assert dec.recording is not None and eager.recording is None
    assert dec.cache.steps == eager.cache.steps >= 4
    assert torch.equal(rec, ref)
    assert torch.equal(dec.cache.token, eager.cache.token)
    targets = [str(n.target) for n in dec.recording._module.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if any(f"aten.{s}." in t for s in SYNC_OPS)], targets
    nl = model.config.num_hidden_layers  # per layer its key, value and query; once the token index and the query's token
    assert sum("index_copy_" in t for t in targets) == 3 * nl + 2


class _Observing(Policy):
    name = "observing"

    def score(self, view):
        return view.keys.float().norm(dim=-1)

    def observe(self, cache, layer, n_old, count):
        pass


def test_the_static_step_refuses_what_it_cannot_record(model):
    ids, mask = _prompts()
    with pytest.raises(ValueError, match="step must be one of"):
        generate(model, ids, mask, max_new_tokens=2, policy=make_policy("h2o"), settings=SETTINGS,
                 options=GenerateOptions(step="compiled"))
    with pytest.raises(ValueError, match="needs a bounded cache"):
        generate(model, ids, mask, max_new_tokens=2, options=GenerateOptions(step="graph"))
    with pytest.raises(ValueError, match="observes every new pair"):
        generate(model, ids, mask, max_new_tokens=2, policy=_Observing(), settings=SETTINGS,
                 options=GenerateOptions(step="static"))
    cache = make_cache(model, make_policy("h2o"), SETTINGS)
    with pytest.raises(ValueError, match="was prefilled"):
        StaticDecoder(model, cache)
    model(input_ids=ids, cache=cache, use_cache=True)  # one oversized forward: the storage grew past the capacity
    with pytest.raises(ValueError, match="prefill in chunks"):
        StaticDecoder(model, cache)
    with pytest.raises(ValueError, match="CUDA device"):
        StaticDecoder(model, cache, capture="cuda")


def test_a_recording_refuses_storage_that_moved(model):
    dec, _ = _decode(model, "fx", 4)
    dec.cache.slots.grow(1)  # what an oversized forward outside the decoder would do
    with pytest.raises(RuntimeError, match="reallocated after the step was recorded"):
        dec.step(torch.zeros(3, dtype=torch.long), torch.full((3,), 50))


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "learned", "streamingllm", "random"])
def test_recorded_rollout_chunks_equal_the_eager_rollout(model, policy, monkeypatch):
    """Every chunk after the first eviction has the same host-visible state, so it is recorded once and replayed; the
    teacher-forced losses, entropies and slots held are bit-identical to the eager rollout's, with and without
    padding, with top-L and with the seeded Top-2L sampler (the eviction runs between replays, on the host)."""
    from foresight.engine.recorded import Recording
    from foresight.engine.rollout import RolloutOptions, rollout

    replays = []
    replay = Recording.replay
    monkeypatch.setattr(Recording, "replay", lambda self: replays.append(1) or replay(self))
    ids = torch.randint(3, 50, (3, 305), generator=torch.Generator().manual_seed(1))  # 80 + 7·32 + a 1-token chunk
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :7] = False
    for selection in ("topk", "sample"):
        settings = EvictionSettings(budget=48, interval=32, selection=selection, temperature=0.1)
        for attention_mask in (None, mask):
            runs = [rollout(model, ids, _policy(policy, model), settings, attention_mask=attention_mask,
                            options=RolloutOptions(torch.Generator().manual_seed(0), step=step))
                    for step in ("eager", "graph")]
            for name in ("token_loss", "token_entropy", "held_per_row"):
                assert torch.equal(getattr(runs[0], name), getattr(runs[1], name)), (selection, name)
            assert runs[0].peak_slots == runs[1].peak_slots == 80
    assert len(replays) == 4 * 4  # 7 chunks of 32 after the first eviction: two eager, one recorded, four replayed


def test_the_recipes_model_step_reaches_the_drivers(tiny_model_dir, monkeypatch):
    """``model.step: graph`` in a recipe makes every rollout and generation of that model record its steps (the
    stages pass the model, not the setting); a call may still ask for eager; an unknown step is refused."""
    from foresight.config.recipe import ModelConfig
    from foresight.engine.models import load_model
    from foresight.engine.recorded import Recording
    from foresight.engine.rollout import RolloutOptions, rollout

    with pytest.raises(ValueError, match="model.step must be one of"):
        load_model(ModelConfig(path=str(tiny_model_dir), step="compiled"))
    model, _ = load_model(ModelConfig(path=str(tiny_model_dir), step="graph"))
    replays = []
    replay = Recording.replay
    monkeypatch.setattr(Recording, "replay", lambda self: replays.append(1) or replay(self))
    ids = torch.randint(3, 50, (1, 300), generator=torch.Generator().manual_seed(1))
    settings = EvictionSettings(budget=48, interval=32)
    graph = rollout(model, ids, make_policy("h2o"), settings)
    assert len(replays) == 3
    eager = rollout(model, ids, make_policy("h2o"), settings, options=RolloutOptions(step="eager"))
    assert len(replays) == 3 and torch.equal(graph.token_loss, eager.token_loss)
    generate(model, ids[:, :40], max_new_tokens=12, policy=make_policy("h2o"), settings=settings)
    assert len(replays) > 3  # the decoding steps after the recording
    generate(model, ids[:, :40], max_new_tokens=4)  # the full cache decodes eagerly, whatever the model's step
