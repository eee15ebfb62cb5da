import random

import pytest

from data_prep import ledger
from data_prep.tokenizer import build_tokenizer


def test_problem_structure_and_checker():
    spec = ledger.LedgerSpec()
    p = ledger.make_problem(spec, random.Random(0))
    assert len(p.solution_ids) == spec.solution_len == 1201 and p.solution_ids[-1] == ledger.EOS
    assert len(p.prompt_ids) == 3 + spec.facts * (2 + spec.filler) + 1 + spec.facts + spec.variables + 3 == 167
    assert ledger.check(p.solution_ids, p.answer, spec)
    # one wrong variable value breaks the answer
    bad = list(p.solution_ids)
    s = (spec.facts + spec.variables) * spec.step_len + 2
    bad[s] = ledger.succ(bad[s])
    assert not ledger.check(bad, p.answer, spec)
    assert ledger.extract_answer(p.solution_ids[:10], spec) is None


def test_every_solution_token_is_determined_by_its_context():
    """Re-derive the solution from the prompt alone with the task's rules (dense supervision)."""
    spec = ledger.LedgerSpec(facts=10, variables=4, filler=2, scratch=6)
    p = ledger.make_problem(spec, random.Random(3))
    content = p.prompt_ids[3:-3]
    table = {}
    for i in range(spec.facts):
        e = content[i * (2 + spec.filler):(i + 1) * (2 + spec.filler)]
        table[e[0]] = e[1]
    questions = content[spec.facts * (2 + spec.filler) + 1:]
    sol = []
    for q in questions + [ledger.VAR0 + k for k in range(spec.variables)]:
        if q >= ledger.VAR0 and q not in table:
            table[q] = ledger.succ(sol[-1])
        v = table[q]
        sol += [q, q, v]
        for k in range(spec.scratch // 3):
            sol += [ledger.COUNTER0 + k, q, v]
    assert sol + [ledger.EOS] == p.solution_ids


def test_lookup_distances_spread_and_scale_with_scratch():
    probs = [ledger.make_problem(ledger.LedgerSpec(), random.Random(i)) for i in range(30)]
    shares = ledger.lookup_distance_shares(probs)
    assert shares[">256"] > 0.5 and shares[">512"] > 0.3 and shares["max"] > 1024
    long = ledger.LedgerSpec(scratch=96)
    assert long.solution_len == 7921


def test_variables_need_the_solution_not_the_prompt():
    p = ledger.make_problem(ledger.LedgerSpec(), random.Random(1))
    P = len(p.prompt_ids)
    var_lookups = [(u, s) for u, s in p.lookups if s >= P]
    assert len(var_lookups) == 16  # the final phase reads definitions written inside the solution


def test_tokenizer_round_trip_with_chat_template():
    tok = build_tokenizer()
    p = ledger.make_problem(ledger.LedgerSpec(), random.Random(0))
    enc = tok.apply_chat_template([{"role": "user", "content": ledger.prompt_text(p)}], add_generation_prompt=True,
                                  tokenize=True)
    assert list(enc["input_ids"]) == p.prompt_ids
    text = tok.decode(p.solution_ids)
    assert tok(text, add_special_tokens=False)["input_ids"] == p.solution_ids


def test_bad_spec_errors():
    with pytest.raises(ValueError, match="facts must be in 1..64"):
        ledger.LedgerSpec(facts=65)
    with pytest.raises(ValueError, match="scratch a multiple of 3"):
        ledger.LedgerSpec(scratch=10)
