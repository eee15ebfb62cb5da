"""GRPO's held-out validation: deterministic (top-L) eviction by the current scorers on held-out traces, the loss
ratio and reward with bootstrap intervals, and the loss ratio's paired change since the SFT start."""

from __future__ import annotations

import torch

from foresight.config.eviction import EvictionSettings
from foresight.training.grpo.objective import trajectory_reward
from foresight.engine.rollout import rollout
from foresight.scorers.bank import LearnedPolicy


def first_scored_token(settings: EvictionSettings, prompt_len: int) -> int:
    """Index of the first token predicted after the first eviction."""
    prot = prompt_len if settings.protect_prompt else 0
    return prot + settings.budget + settings.interval + 1


@torch.no_grad()
def validate(model, bank, ds, idx, settings: EvictionSettings, grpo_cfg, seed: int = 0) -> dict:
    """Deterministic (top-L) eviction on the held-out traces ``idx``: the loss ratio (Σ evicted / Σ full loss after
    the prompt) and the mean reward, each with a 95% bootstrap interval over the traces (``*_lo``, ``*_hi``), and
    ``per_trace`` (each trace's evicted and full loss: what :func:`change_since_start` pairs)."""
    from foresight.evaluation.report import bootstrap_ci

    settings = settings.replace(selection="topk")
    evicted, full, rewards = [], [], []
    for i in idx:
        row = ds[i]
        ids = torch.tensor([row["input_ids"]])
        full_loss = torch.tensor(row["token_loss"])
        res = rollout(model, ids, LearnedPolicy(bank), settings, prompt_len=row["prompt_len"])
        p = row["prompt_len"]
        evicted.append(res.token_loss[0, p:].sum().item())
        full.append(full_loss[p:].sum().item())
        rewards.append(trajectory_reward(res.token_loss, full_loss, torch.tensor(row["token_entropy"]),
                                         first_scored_token(settings, p), grpo_cfg).item())
    out = {"val_loss_ratio": sum(evicted) / max(sum(full), 1e-9), "val_reward": sum(rewards) / max(len(rewards), 1)}
    for name, ci in (("val_loss_ratio", bootstrap_ci(evicted, full, seed)), ("val_reward", bootstrap_ci(rewards, None, seed))):
        if ci is not None:
            out[f"{name}_lo"], out[f"{name}_hi"] = ci
    out["per_trace"] = {"evicted_loss": evicted, "full_loss": full}
    return out


def change_since_start(val: dict, start: dict | None, seed: int = 0) -> dict:
    """The held-out loss ratio's change since the SFT start, with the 95% interval of a *paired* bootstrap over the
    same traces (trace difficulty cancels: a change far smaller than either interval shows). Empty without a
    start that kept its traces (a run resumed from an older checkpoint)."""
    from foresight.evaluation.report import paired_ratio_diff_ci

    if not start or "per_trace" not in start:
        return {}
    out = {"val_loss_ratio_change": val["val_loss_ratio"] - start["val_loss_ratio"]}
    ci = paired_ratio_diff_ci(val["per_trace"], start["per_trace"], seed)
    if ci is not None:
        out["val_loss_ratio_change_lo"], out["val_loss_ratio_change_hi"] = ci
    return out


def scalars(val: dict) -> dict:
    return {k: v for k, v in val.items() if k != "per_trace"}
