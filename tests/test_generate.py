"""Generation's sampling and length control: the top-k draw, ``min_tokens``, EOS checks (the preallocated full
cache: tests/test_full_cache.py)."""

import dataclasses

import torch

from foresight.engine.generate import Decoding, GenerateOptions, filter_logits, generate, sample_tokens


def test_topk_draw_has_the_distribution_of_the_filtered_vocabulary():
    torch.manual_seed(0)
    logits = torch.randn(3, 500) * 3
    dec = Decoding(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    ref = filter_logits(logits / 0.7, 20, 0.9).softmax(-1)  # the whole-vocabulary reference
    g = torch.Generator().manual_seed(1)
    n = 20000
    draws = torch.stack([sample_tokens(logits, dec, g) for _ in range(n)], 1)  # [3, n]
    for row in range(3):
        freq = torch.bincount(draws[row], minlength=500).float() / n
        assert ((freq > 0) <= (ref[row] > 0)).all()  # never outside top-k ∩ top-p
        assert (freq - ref[row]).abs().max() < 0.02


def test_row_generators_make_each_row_independent_of_the_batch():
    logits = torch.randn(4, 300)
    dec = Decoding(do_sample=True, temperature=1.0, top_k=30, top_p=0.95)
    gens = [torch.Generator().manual_seed(10 + i) for i in range(4)]
    together = sample_tokens(logits, dec, row_generators=gens)
    alone = torch.cat([sample_tokens(logits[i:i + 1], dec, row_generators=[torch.Generator().manual_seed(10 + i)])
                       for i in range(4)])
    assert torch.equal(together, alone)


def test_min_tokens_keeps_eos_out_until_the_minimum(qwen3):
    ids = torch.randint(8, 170, (2, 12))
    first = generate(qwen3, ids, max_new_tokens=1).new_tokens[:, 0]
    eos = int(first[0])  # make the greedy first token the end of sequence: rows stop at once ...
    free = generate(qwen3, ids, max_new_tokens=20, decoding=Decoding(eos_token_id=eos))
    assert free.new_tokens[0, 0] == eos
    forced = generate(qwen3, ids, max_new_tokens=20, decoding=Decoding(eos_token_id=eos, min_tokens=8))
    assert not (forced.new_tokens[:, :8] == eos).any()  # ... unless EOS is barred for the first 8
    assert forced.new_tokens.shape[1] >= 8
    sampled = generate(qwen3, ids, max_new_tokens=20,
                       decoding=Decoding(do_sample=True, top_k=5, eos_token_id=eos, min_tokens=12),
                       options=GenerateOptions(generator=torch.Generator().manual_seed(0)))
    assert not (sampled.new_tokens[:, :12] == eos).any()


def test_checking_for_eos_every_few_tokens_returns_what_a_check_per_token_returns(qwen3, monkeypatch):
    """On an accelerator generation asks whether every row has stopped only every EOS_CHECK_EVERY tokens (the
    question is a host sync); the steps it runs past the last EOS are trimmed, so sequences and log-probabilities
    are those of a check at every token (the CPU's), with a bounded cache or the full one."""
    import foresight.engine.generate as gen_mod
    from foresight.config.eviction import EvictionSettings
    from foresight.policies import make_policy

    ids = torch.randint(8, 170, (1, 10), generator=torch.Generator().manual_seed(3)).expand(3, -1)
    dec = Decoding(do_sample=True, top_k=4)

    def run(decoding, **kw):  # each row sampled by its own generator: its tokens do not depend on the others'
        gens = [torch.Generator().manual_seed(100 + i) for i in range(3)]
        return generate(qwen3, ids, max_new_tokens=30, decoding=decoding, **kw, options=GenerateOptions(row_generators=gens))

    free = [row.tolist() for row in run(dec).new_tokens]
    firsts = {t: [row.index(t) + 1 for row in free] for t in set(free[0]) & set(free[1]) & set(free[2])}
    # a token every row draws, first at three different steps, the last of them between two checks of every 7
    eos, stops = next((t, f) for t, f in sorted(firsts.items()) if len(set(f)) == 3 and max(f) % 7 and max(f) < 30)
    for kw in ({}, {"policy": make_policy("h2o"), "settings": EvictionSettings(budget=16, interval=4)}):
        decoding = dataclasses.replace(dec, eos_token_id=eos)
        per_token = run(decoding, **kw)
        monkeypatch.setattr(gen_mod, "eos_check_interval", lambda device: 7)
        sparse = run(decoding, **kw)
        monkeypatch.undo()
        if not kw:
            assert [row.index(eos) + 1 for row in per_token.new_tokens.tolist()] == stops
            assert per_token.new_tokens.shape[1] == max(stops)
        assert torch.equal(sparse.sequences, per_token.sequences)
        assert torch.equal(sparse.logprobs, per_token.logprobs)


def test_the_vocabulary_projection_of_a_prefill_reads_contiguous_hidden_states(qwen3):
    """A prefill projects only its last position, through transformers' ``logits_to_keep``. Given the int 1, it hands
    ``lm_head`` a non-contiguous [b, 1, d] slice, for which ``torch.matmul`` broadcasts the [V, d] weight to a batch
    of b copies (SmolLM2, 66 rows in bfloat16: 3.7 GB and 8.9 s per prefill on 2 cores instead of 0.02 s). The
    projection must see contiguous rows, in a generation's prefill (full and bounded cache) and in an evaluation's
    chunks before the first eviction, and give the logits of the whole forward's last position."""
    from foresight.config.eviction import EvictionSettings
    from foresight.policies import make_policy
    from foresight.engine.rollout import RolloutOptions, rollout

    seen = []
    hook = qwen3.get_output_embeddings().register_forward_pre_hook(
        lambda mod, args: seen.append((tuple(args[0].shape), args[0].is_contiguous())))
    try:
        ids = torch.randint(8, 170, (3, 40), generator=torch.Generator().manual_seed(0))
        first = generate(qwen3, ids, max_new_tokens=1)  # greedy: the last position's best token and its log-prob
        settings = EvictionSettings(budget=16, interval=8)
        generate(qwen3, ids, max_new_tokens=2, policy=make_policy("h2o"), settings=settings)
        full = rollout(qwen3, ids)
        rollout(qwen3, ids, policy=make_policy("tova"), settings=settings,
                options=RolloutOptions(full=(full.token_loss, full.token_entropy)))
    finally:
        hook.remove()
    prefills = [shape for shape, _ in seen if shape[1] == 1]
    assert len(prefills) >= 3 and all(contiguous for _, contiguous in seen), seen
    best = torch.log_softmax(qwen3(ids).logits[:, -1].float(), -1).max(-1)
    assert torch.equal(first.new_tokens[:, 0], best.indices)
    assert torch.allclose(first.logprobs[:, 0], best.values, atol=1e-5)
