"""ForesightPress against the real kvpress package (runs in its own environment: kvpress pins an older
transformers; `.ci/run` builds `.venv-kvpress` for it). Skipped where kvpress is not installed."""

import pytest
import torch

kvpress = pytest.importorskip("kvpress")

from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from foresight.scorers.checkpoint import save_scorer  # noqa: E402
from foresight.integrations.kvpress import ForesightPress  # noqa: E402
from foresight.scorers.bank import ScorerBank  # noqa: E402


def tiny(tmp_path):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
    model = Qwen3ForCausalLM(cfg).eval()
    bank = ScorerBank(2, 2, 16, 2, seed=1)
    info = {"model_type": "qwen3", "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "name_or_path": "tiny"}
    save_scorer(bank, tmp_path / "ck", info, budget=24, interval=8, sinks=0, stage="sft")
    return model, tmp_path / "ck"


def test_decoding_press_keeps_the_scorers_top_and_stays_in_bounds(tmp_path):
    model, ck = tiny(tmp_path)
    target, interval = 24, 8
    inner = ForesightPress(scorer_dir=str(ck), protect_recent=interval)
    press = kvpress.DecodingPress(inner, compression_interval=interval, target_size=target,
                                  hidden_states_buffer_size=interval)
    sizes, checks = [], []
    orig = inner.score

    def spy(module, hidden_states, keys, values, attentions, kwargs):
        s = orig(module, hidden_states, keys, values, attentions, kwargs)
        checks.append((module.layer_idx, keys.clone(), s.clone()))
        return s

    inner.score = spy

    def probe(module, args, kwargs, output):  # on the decoder layer: runs after the press's attention hook
        hs = args[0] if args else kwargs["hidden_states"]
        cache = kwargs.get("past_key_values")
        if cache is not None and hs.shape[1] == 1:
            sizes.append(cache.layers[0].keys.shape[2])

    hooks = [model.model.layers[0].register_forward_hook(probe, with_kwargs=True)]
    ids = torch.randint(0, 128, (1, 30))
    with press(model):
        model.generate(ids, max_new_tokens=60, do_sample=False)
    for hk in hooks:
        hk.remove()
    assert checks, "the press never compressed"
    first = next(i for i, s in enumerate(sizes) if s <= target)  # the first compression
    assert len(sizes) - first > 3 * interval
    assert all(target <= s <= target + interval - 1 for s in sizes[first:]), sizes
    # the kept keys are exactly the ones the scorer ranks highest
    layer, keys, scores = checks[-1]
    top = scores.topk(target, dim=-1).indices
    kept = keys.gather(2, top.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    assert kept.shape[2] == target
    newest = keys[:, :, -interval:]
    for hh in range(keys.shape[1]):
        for j in range(interval):
            assert any(torch.equal(newest[0, hh, j], kept[0, hh, i]) for i in range(target))


def test_text_generation_pipeline_accepts_the_press(tmp_path):
    from transformers import pipeline

    from data_prep.tokenizer import build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer()
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      pad_token_id=0, eos_token_id=2, bos_token_id=1)
    model = Qwen3ForCausalLM(cfg).eval()
    bank = ScorerBank(2, 2, 16, 2, seed=1)
    info = {"model_type": "qwen3", "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "name_or_path": "tiny"}
    save_scorer(bank, tmp_path / "ck", info, budget=16, interval=4, sinks=0, stage="sft")
    press = kvpress.DecodingPress(ForesightPress(scorer_dir=str(tmp_path / "ck"), protect_recent=4),
                                  compression_interval=4, target_size=16, hidden_states_buffer_size=4)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok)
    out = pipe("n01 v02 n03 v04 n05 v06 n07 v08", question="n03", press=press, max_new_tokens=30)
    assert isinstance(out["answer"], str)


def test_press_refuses_another_model(tmp_path):
    model, ck = tiny(tmp_path)
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=6, num_key_value_heads=2))
    from foresight.scorers.checkpoint import ScorerMismatchError

    with pytest.raises(ScorerMismatchError):
        ForesightPress(scorer_dir=str(ck)).post_init_from_model(other)


def test_readme_kvpress_snippet_runs(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    body = text.split("## Use trained scorers in your own code", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", body, re.S)[1]
    model, ck = tiny(tmp_path)
    dest = tmp_path / "scorers" / "tiny-qwen3" / "grpo"
    dest.parent.mkdir(parents=True)
    ck.rename(dest)
    monkeypatch.chdir(tmp_path)
    small = {"target_size=640": "target_size=24", "compression_interval=128": "compression_interval=8",
             "protect_recent=128": "protect_recent=8", "hidden_states_buffer_size=128": "hidden_states_buffer_size=8",
             "max_new_tokens=1400": "max_new_tokens=40", '"scorers/tiny-qwen3/grpo"': '"scorers/tiny-qwen3/grpo"'}
    for a, b in small.items():
        assert a in code, f"the README's kvpress snippet no longer has {a}"
        code = code.replace(a, b)
    ns = {"model": model, "input_ids": torch.randint(0, 128, (1, 30))}
    exec(code, ns)  # noqa: S102
    assert ns["out"].shape[1] == 70


def test_an_age_scorer_sees_each_kept_pair_s_age_across_compressions(tmp_path):
    """The press carries the kept pairs' positions in kvpress's order: at the first compression the cache holds every
    position in order (ages n-1 .. 0); at each later one a carried pair is older by exactly the tokens fed since, and
    it is the pair the previous compression kept (the same key). A `heads` scorer gets each pair's position as its token
    (what matches a token across the KV heads)."""
    model, _ = tiny(tmp_path)
    bank = ScorerBank(2, 2, 16, 2, seed=1, features=("key", "value", "attn", "heads", "age"))
    info = {"model_type": "qwen3", "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "name_or_path": "tiny"}
    save_scorer(bank, tmp_path / "age", info, budget=24, interval=8, sinks=0, stage="sft")
    inner = ForesightPress(scorer_dir=str(tmp_path / "age"), protect_recent=8)
    press = kvpress.DecodingPress(inner, compression_interval=8, target_size=24, hidden_states_buffer_size=8)
    calls = []
    orig_assemble = None

    def spy_post_init(model_):
        nonlocal orig_assemble
        ForesightPress.post_init_from_model(inner, model_)
        orig_assemble = inner.bank.assemble

        def assemble(keys, values, stats, age=None, token=None):
            assert torch.equal(token + age, torch.full_like(age, int((token + age).flatten()[0])))  # positions
            calls.append((keys.clone(), age.clone()))
            return orig_assemble(keys, values, stats, age, token)

        inner.bank.assemble = assemble

    inner.post_init_from_model = spy_post_init
    with press(model):
        model.generate(torch.randint(0, 128, (1, 30)), max_new_tokens=50, do_sample=False)
    layer0 = calls[0::2]  # layers 0 and 1 alternate
    assert len(layer0) >= 3
    keys, age = layer0[0]
    n = keys.shape[2]
    assert torch.equal(age, (n - 1 - torch.arange(n)).expand_as(age))
    for (k_prev, a_prev), (k_now, a_now) in zip(layer0, layer0[1:]):
        kept = 24
        fed = k_now.shape[2] - kept
        for hh in range(k_now.shape[1]):
            for j in range(kept):  # the j-th carried pair: find it among the previous call's keys
                match = (k_prev[0, hh] == k_now[0, hh, j]).all(-1).nonzero()
                assert len(match) == 1
                assert a_now[0, hh, j] == a_prev[0, hh, match[0, 0]] + fed
        assert torch.equal(a_now[0, :, kept:], (fed - 1 - torch.arange(fed)).expand(k_now.shape[1], fed))


def test_an_ahead_scorer_gets_the_buffered_queries_attention_at_later_positions(tmp_path):
    """`ahead`: at each compression the press's a{Δ} statistics equal the buffered queries recomputed by the model's
    own projections and rotary embedding at their positions + Δ, each over the keys up to its own position."""
    from kvpress.utils import get_prerope_query_states
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from foresight.engine.features import AHEAD_NAMES, AHEAD_SHIFTS

    model, _ = tiny(tmp_path)
    bank = ScorerBank(2, 2, 16, 2, seed=1, features=("key", "value", "attn", "ahead"))
    info = {"model_type": "qwen3", "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "name_or_path": "tiny"}
    save_scorer(bank, tmp_path / "ahead", info, budget=24, interval=8, sinks=0, stage="sft")
    inner = ForesightPress(scorer_dir=str(tmp_path / "ahead"), protect_recent=8)
    press = kvpress.DecodingPress(inner, compression_interval=8, target_size=24, hidden_states_buffer_size=8)
    seen, checked = {}, []
    orig_score = inner.score

    def score(module, hidden_states, keys, values, attentions, kwargs):
        seen["ref"] = (module, hidden_states, keys, kwargs)
        return orig_score(module, hidden_states, keys, values, attentions, kwargs)

    def spy_post_init(model_):
        ForesightPress.post_init_from_model(inner, model_)
        orig_assemble = inner.bank.assemble

        def assemble(keys, values, stats, age=None, token=None):
            module, hs, K, kw = seen["ref"]
            q = get_prerope_query_states(module, hs)  # [1, 4, nq, 16]
            nq, n = q.shape[2], K.shape[2]
            last = int(kw["cache_position"].reshape(-1)[-1])
            pos = torch.arange(last - nq + 1, last + 1)[None]
            for name, shift in zip(AHEAD_NAMES, AHEAD_SHIFTS):
                cos, sin = model_.model.rotary_emb(hs, pos + shift)
                qs, _ = apply_rotary_pos_emb(q, q, cos, sin)
                logits = (qs[0].view(2, 2, nq, 16) @ K[0, :, None].transpose(-1, -2)) * module.scaling
                hidden = torch.arange(n)[None, :] > (n - nq + torch.arange(nq))[:, None]
                ref = logits.float().masked_fill(hidden, float("-inf")).softmax(-1).sum(2)
                assert torch.allclose(stats[name][0], ref, atol=1e-5), name
            checked.append(n)
            return orig_assemble(keys, values, stats, age, token)

        inner.bank.assemble = assemble

    inner.score = score
    inner.post_init_from_model = spy_post_init
    with press(model):
        model.generate(torch.randint(0, 128, (1, 30)), max_new_tokens=40, do_sample=False)
    assert len(checked) >= 4
