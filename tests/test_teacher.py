"""The shipped teacher (foresight/assets/tiny-qwen3): loads like any checkpoint and solves held-out ledgers."""

import json
import random

import pytest
import torch

from data_prep import ledger
from foresight.config.recipe import ModelConfig
from foresight.engine.generate import Decoding, generate
from foresight.engine.models import ASSETS, load_model


def test_shipped_teacher_is_a_real_qwen3_with_gqa_and_qk_norms():
    model, tok = load_model(ModelConfig(), device="cpu")
    c = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM" and c.num_key_value_heads < c.num_attention_heads
    assert hasattr(model.model.layers[0].self_attn, "k_norm")
    assert tok.chat_template and len(tok) == len(ledger.VOCAB)
    info = json.loads((ASSETS / "tiny-qwen3" / "teacher.json").read_text())
    assert info["heldout_metrics"]["greedy"]["n"] >= 200


@pytest.mark.slow
def test_shipped_teacher_accuracy_on_held_out_problems():
    model, tok = load_model(ModelConfig(), device="cpu")
    spec = ledger.LedgerSpec()
    rng = random.Random(123456)  # seeds the training run never drew from this generator
    probs = [ledger.make_problem(spec, rng) for _ in range(24)]
    ids = torch.tensor([p.prompt_ids for p in probs])
    out = generate(model, ids, max_new_tokens=spec.solution_len,
                   decoding=Decoding(eos_token_id=ledger.EOS, pad_token_id=ledger.PAD))
    acc = sum(ledger.check(row, p.answer, spec) for p, row in zip(probs, out.new_tokens.tolist())) / len(probs)
    assert acc >= 0.75, acc


def test_teacher_training_resumes_exactly_and_introduces_new_tokens(tmp_path):
    """`make teacher`'s loop: a run killed at a checkpoint and resumed ends with the same weights as one straight
    run; a stage that brings tokens unseen so far (the variables) re-draws their embeddings at the names' scale."""
    from data_prep import teacher

    def run(steps):
        return teacher.TeacherRun(steps, seed=3, tokens_per_batch=512, eval_every=2, advance_at=(-1.0,), cooldown=0.5,
                                  ckpt_every=2, min_exact=0.0)

    straight = teacher.train(tmp_path / "a", run(4), log=lambda s: None)
    teacher.train(tmp_path / "b", run(2), log=lambda s: None)
    resumed = teacher.train(tmp_path / "b", run(4), log=lambda s: None)
    for (name, p), q in zip(straight["model"].state_dict().items(), resumed["model"].state_dict().values()):
        assert torch.equal(p, q), name
    with pytest.raises(ValueError, match="beyond --steps 3"):  # another run's checkpoint is not silently reused
        teacher.train(tmp_path / "b", run(3), log=lambda s: None)
    state = straight["state"]
    assert state["stage"] == 2  # advance_at -1: one stage per evaluation
    introduced = set(state["introduced"])
    assert set(range(ledger.VAR0, ledger.VAR0 + 16)) <= introduced and ledger.COUNTER0 in introduced
    assert ledger.COUNTER0 + 1 not in introduced  # stage 2 scratch=3 uses c00 only


def test_introduced_tokens_are_drawn_at_the_trained_names_scale():
    from transformers import Qwen3ForCausalLM

    from data_prep import teacher

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(teacher.model_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    E = model.get_input_embeddings().weight
    with torch.no_grad():
        E[ledger.NAME0:ledger.NAME0 + ledger.NUM_NAMES] *= 50  # as if trained: far from the 0.02 init
    model(input_ids=torch.randint(0, len(ledger.VOCAB), (2, 8))).logits.sum().backward()
    opt.step()
    before = E.detach().clone()
    new = list(range(ledger.VAR0, ledger.VAR0 + 4))
    teacher.introduce_tokens(model, opt, new)
    scale = E[ledger.NAME0:ledger.NAME0 + ledger.NUM_NAMES].norm(dim=1).mean()
    assert torch.allclose(E[new].norm(dim=1).mean(), scale, rtol=0.3)
    assert before[new].norm(dim=1).mean() < 0.2 * scale
    others = torch.ones(len(E), dtype=torch.bool)
    others[new] = False
    assert torch.equal(E.detach()[others], before[others])
    assert opt.state[E]["exp_avg"][new].abs().sum() == 0 and opt.state[E]["exp_avg"][others].abs().sum() > 0
