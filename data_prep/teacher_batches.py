"""The teacher's training batches (:mod:`data_prep.teacher`): ledger problems with the loss on their solutions,
plain copy batches, and the language-model loss on the masked targets."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from data_prep import ledger


def task_batch(spec: ledger.LedgerSpec, n: int, rng: random.Random):
    """[n, len] ids, a loss mask over solution targets, and the problems (all of one length)."""
    probs = [ledger.make_problem(spec, rng) for _ in range(n)]
    ids = torch.tensor([p.prompt_ids + p.solution_ids for p in probs])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, len(probs[0].prompt_ids) :] = True
    return ids, mask, probs


def copy_batch(length: int, n: int, rng: random.Random):
    """Rows of random name/value segments, each followed by a separator and repeated (loss on the repeats).

    Segment lengths vary (4 .. length/2), so the repeat is never at a constant offset: a positional head cannot
    solve it and an induction circuit (match the previous token, copy the next) has to form, which is the circuit
    the ledger's content-addressed look-ups use."""
    rows, masks = [], []
    for _ in range(n):
        row, m = [ledger.BOS], [False]
        while len(row) < length:
            k = rng.randint(4, max(4, length // 2))
            seg = [ledger.NAME0 + rng.randrange(ledger.NUM_NAMES + ledger.NUM_VALUES) for _ in range(k)]
            row += seg + [ledger.SEP] + seg
            m += [False] * (k + 1) + [True] * k
        rows.append(row[:length])
        masks.append(m[:length])
    return torch.tensor(rows), torch.tensor(masks)


def lm_loss(model, ids, mask):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids[:, :-1]).logits
    tgt = mask[:, 1:]
    return F.cross_entropy(logits[tgt].float(), ids[:, 1:][tgt]), logits
