"""What the SmolLM2 probes under ``studies/results/`` share: the realbench recipe's model, its 32 validation traces as
references, a scorer checkpoint, and the references in batches with golden's block futures."""

from __future__ import annotations

import dataclasses

from foresight.config.recipe import load_recipe
from foresight.data.references import make_batch, stack_padded, trace_batches
from foresight.engine.models import load_model
from foresight.evaluation.validation_references import validation_references
from foresight.scorers.checkpoint import load_scorer
from foresight.targets.golden import block_pooled_attention

RECIPE = "recipes/smollm2-135m-realbench.yaml"
TRACES = "runs/rb/traces"  # the training traces; their last 32 are the validation split


@dataclasses.dataclass
class Probe:
    recipe: object
    model: object
    tok: object
    refs: list
    bank: object
    cfg: dict


def validation_probe(scorer_dir, traces=TRACES) -> Probe:
    """The model, its validation traces as references (refusing a scorer trained on them) and the scorer."""
    recipe = load_recipe(RECIPE, ["sft.val_traces=32", "eval.num_problems=32"])
    model, tok = load_model(recipe.model)
    _, refs = validation_references(recipe, traces, model, next(model.parameters()).device, [scorer_dir])
    bank, cfg = load_scorer(scorer_dir, model)
    return Probe(recipe, model, tok, refs, bank, cfg)


def golden_batches(probe: Probe, settings, batch_size: int = 48):
    """The references in batches, each with golden's block futures under ``settings`` (mean pooling)."""
    for members in trace_batches(probe.refs, batch_size, False):
        batch = make_batch(probe.refs, members, probe.tok.pad_token_id)
        pooled = block_pooled_attention(probe.model, batch["ids"], settings, "mean", lengths=batch["lengths"])
        yield batch, stack_padded(pooled.futures(), (1, 3))
