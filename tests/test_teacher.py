"""The shipped teacher (foresight/assets/tiny-qwen3): loads like any checkpoint and solves held-out ledgers."""

import json
import random

import torch

from data_prep import ledger
from foresight.config import ModelConfig
from foresight.generate import generate
from foresight.models import ASSETS, load_model


def test_shipped_teacher_is_a_real_qwen3_with_gqa_and_qk_norms():
    model, tok = load_model(ModelConfig(), device="cpu")
    c = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM" and c.num_key_value_heads < c.num_attention_heads
    assert hasattr(model.model.layers[0].self_attn, "k_norm")
    assert tok.chat_template and len(tok) == len(ledger.VOCAB)
    info = json.loads((ASSETS / "tiny-qwen3" / "teacher.json").read_text())
    assert info["heldout_metrics"]["greedy"]["n"] >= 200


def test_shipped_teacher_accuracy_on_held_out_problems():
    model, tok = load_model(ModelConfig(), device="cpu")
    spec = ledger.LedgerSpec()
    rng = random.Random(123456)  # seeds the training run never drew from this generator
    probs = [ledger.make_problem(spec, rng) for _ in range(24)]
    ids = torch.tensor([p.prompt_ids for p in probs])
    out = generate(model, ids, max_new_tokens=spec.solution_len, eos_token_id=ledger.EOS, pad_token_id=ledger.PAD)
    acc = sum(ledger.check(row, p.answer, spec) for p, row in zip(probs, out.new_tokens.tolist())) / len(probs)
    assert acc >= 0.75, acc
