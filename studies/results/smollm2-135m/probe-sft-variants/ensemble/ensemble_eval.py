"""A probe, not a method of the package: does averaging two trained scorers' rankings beat each alone?

Runs ``foresight eval`` (held-out references of the recipe, every argument of foresight eval passed through) with one
more method, ``foresight-ensemble``: at each eviction, each scorer's scores are turned into ranks within each (layer,
sequence, KV head) and the mean rank decides (top-L). The scorers are the ``--scorers`` given.

    python studies/results/smollm2-135m/probe-sft-variants/ensemble/ensemble_eval.py --recipe R --scorers A --scorers B ...
"""

import dataclasses
import sys

import torch

import foresight.evaluation.evaluate as E
from foresight.cli import main
from foresight.policies.base import Policy


class RankMean(Policy):
    name = "ensemble"
    reads = None

    def __init__(self, policies):
        self.policies = policies

    @torch.no_grad()
    def score(self, view):
        ranks = [p.score(view).argsort(-1).argsort(-1).float() for p in self.policies]
        return torch.stack(ranks).mean(0)


build = E.build_methods


def with_ensemble(*args, **kw):
    meths = build(*args, **kw)
    learned = [m for m in meths if m.checkpoint is not None]
    if len(learned) >= 2:
        meths.append(dataclasses.replace(learned[0], name="foresight-ensemble", checkpoint=None,
                                         make_policy=lambda: RankMean([m.make_policy() for m in learned])))
    return meths


E.build_methods = with_ensemble
sys.exit(main(["eval"] + sys.argv[1:]))
