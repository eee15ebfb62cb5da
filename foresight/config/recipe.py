"""Recipes: typed sections read from YAML, with ``--set section.field=value`` overrides.

A recipe is data: a new model size is a YAML file, not a code change. Unknown sections or fields are
errors that name the offending key (a misspelled field must never be silently ignored).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from foresight.config.typed_yaml import fill, read_yaml
from foresight.config.checks import RecipeError, check_recipe, parse_budgets
from foresight.config.eviction import EvictionSettings

__all__ = ["RecipeError", "load_recipe", "parse_budgets", "Recipe", "EvictionSettings"]


@dataclass
class ModelConfig:
    path: str = "builtin:tiny-qwen3"  # a local folder, a hub name, or builtin:NAME (shipped in foresight/assets)
    revision: str | None = None
    gguf_file: str | None = None  # a GGUF file inside `path` (or an absolute path), loaded with transformers' gguf support
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    step: str = "eager"  # eager | graph: bounded-cache forwards recorded once and replayed (CUDA graphs; for GPUs)


@dataclass
class TaskConfig:
    kind: str = "ledger"  # ledger (the synthetic task) | math (\boxed{} answers) | none (keep by length only)
    facts: int = 48
    variables: int = 16
    filler: int = 0
    scratch: int = 12
    system_prompt: str | None = None
    instruction: str | None = None  # text appended to each math prompt (the paper's \boxed{} request)


@dataclass
class TracesConfig:
    num_prompts: int = 64
    seed: int = 0
    prompt_dataset: str | None = None  # local json/jsonl/parquet path or a hub name; None = the synthetic generator
    prompt_split: str = "train"
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    min_new_tokens: int = 1000  # keep traces whose solution is at least this long
    min_tokens: int = 0  # EOS cannot be drawn before this many new tokens (vLLM's min_tokens; 0: free length)
    max_new_tokens: int = 1300
    batch_size: int = 16
    do_sample: bool = False
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    require_correct: bool = True
    loss_chunk: int = 1024  # tokens per chunk of the full-cache loss/entropy pass
    heldout_offset: int = 1_000_000  # prompt seeds of held-out problems start here (synthetic task)
    # who decodes: hf = this process (transformers); openai = an OpenAI-compatible server (vLLM, SGLang, transformers
    # serve) at base_url; the checks, the length filter and the full-cache loss pass stay local either way
    engine: str = "hf"
    base_url: str | None = None  # e.g. http://localhost:8000/v1
    server_model: str | None = None  # the name the server serves the model under (default: model.path)
    api_key_env: str | None = None  # environment variable holding the server's API key
    concurrency: int = 8  # requests in flight
    # openai: score finished batches while the server decodes the rest (a server on other hardware); false: wait for
    # every completion first (a server on this machine's cores decodes faster without the scoring pass beside it)
    score_during_decoding: bool = True
    request_timeout: float = 1800.0  # seconds per request
    max_retries: int = 5  # retries of a transient failure (backoff 0.5 s, doubling)


@dataclass
class ScorerConfig:
    hidden: int = 16
    activation: str = "gelu"
    # the scorer's inputs: a subset of key, value, attn, heads, ahead, age (foresight.engine.features.SCORER_INPUTS)
    features: list[str] = field(default_factory=lambda: ["key", "value", "attn"])


@dataclass
class SFTConfig:
    steps: int = 200
    batch_traces: int = 4
    lr: float = 1e-2
    warmup: int = 10
    schedule: str = "cosine"
    margin: float = 0.01
    pairs: str = "all"  # all | sampled | boundary (sampled pairs across golden's eviction set only)
    pair_weight: str = "uniform"  # uniform (the paper's) | gap: each pair weighted by its future-score gap F_j - F_i
    sampled_pairs: int = 4096
    pair_chunk: int = 65536
    golden_pool: str = "mean"  # mean | max (pooling over a block's queries and a GQA group's heads) | output (mean of
                               # how far dropping a key moves each query's attention output, foresight.targets.golden) | loss
                               # (first-order loss change of dropping it, foresight.targets.golden_loss)
    cache_golden: bool = True  # keep each trace's golden-trajectory features in memory (tiny models)
    example_steps: int = 0  # > 0: that many eviction steps per trace, computed once and stored on disk for every SFT
                            # run on the same traces and settings (foresight.training.golden_store); 0: every step, in the run
    grad_clip: float = 1.0
    ckpt_every: int = 50
    snapshots: bool = False  # also keep the scorers of every checkpoint as OUT/steps/step-NNNNNN (evaluable)
    seed: int = 0
    example_seed: int | None = None  # which eviction steps of each trace are stored (example_steps > 0); null: `seed`.
                                     # Set it to compare SFT seeds on the same stored examples (no new golden pass)
    deepspeed: str | None = None
    objective: str = "foresight"  # foresight (golden ranking, pairwise hinge) | kvpop (boundary loss, see `kvpop`)
    val_traces: int = 2  # the last traces of the dataset, held out for validation (at most a quarter of them)
    train_traces: int = 0  # > 0: train on the first N training traces only (a data-scaling curve on one traces folder:
                           # the same validation traces and stored golden examples at every size); 0: all of them
    init: str = ""  # a scorer checkpoint to start from (its scorer must be the recipe's)
    onpolicy: str = ""  # a scorer checkpoint: start from it and add, per trace, example_steps states of its own
                        # trajectory labelled by golden (a DAgger round; needs example_steps > 0)
    budgets: str = ""  # "B:L,B:L": train on golden's states at each of these budgets (equal weight per budget), so
                       # one scorer serves them all; empty: the cache's own budget only


@dataclass
class KVpopConfig:
    """KVpop (arXiv 2607.05061): layout s sinks + w window + top-k (k = cache.budget - s - w), future-attention
    target and boundary loss. Used by ``sft.objective=kvpop``; the optimiser settings come from ``sft``."""

    scorer: str = "mlp"  # mlp (stateless, on [key; value]) | mlstm (matrix-memory scorer)
    delayed: bool = True  # mlstm: read the memory when the token leaves the window (False: at insertion)
    sinks: int = 4  # s: first tokens always kept
    window: int = 64  # w: protected recent tokens; a token's keep/drop decision is made when it leaves them
    gamma: float = 0.9  # temporal decay of priorities per decay step (per head; one value for all heads)
    decay_step: int = 64  # n: tokens per decay step
    eps: float = 1.0e-6  # target = Agg_g log(eps + mean future attention)
    agg: str = "max"  # max | mean: aggregation of the log-targets over a GQA group's query heads
    tau: float = 1.0  # temperature of the boundary loss
    margin: float = 0.5  # margin weighting: weight = min(1, teacher gap / margin); 0 disables
    balance_min: float = 0.25  # keep/drop balancing weights are clipped to [balance_min, balance_max]
    balance_max: float = 4.0
    queries_per_trace: int = 512  # boundary queries sampled per trace and step (0 = all)
    hidden: int = 32  # scorer MLP width
    memory_dim: int = 16  # mlstm: key/value dimension of the matrix memory
    block: int = 256  # block size of the transposed target pass and of the chunked mLSTM scan


@dataclass
class GRPOConfig:
    steps: int = 40
    traces_per_step: int = 4
    group: int = 8
    lr: float = 3e-4
    warmup: int = 10
    clip_eps: float = 0.2
    epochs: int = 2
    beta: float = 0.03
    eta: float = 1.5
    low_entropy_share: float = 0.8
    low_entropy_below: float | None = None  # nats: tokens whose full-cache entropy is below it count as low-entropy
                                            # too, whatever their rank (the share is a rank rule; foresight/targets/reward.py)
    normalise: str = "low_entropy"  # low_entropy | counted
    temperature: float = 1.0
    ratio: str = "draw"  # draw: a clipped ratio per Plackett-Luce draw | set: the set log-ratio / L per row, whose clip
                         # never acts (foresight.training.grpo.stage; docs/results/tiny-qwen3/grpo-32traces)
    skip_flat: bool = False  # no optimiser step when every group of the step (over all processes) has equal rewards:
                             # its only gradient is the KL's, which Adam's momentum and normalisation turn into drift
    budgets: str = ""  # "B:L,B:L": a step's traces are rolled out at these budgets in turn (the k-th trace of the
                       # step at the (k mod n)-th), so one scorer is refined for all of them; empty: the cache's own
    control: str = "none"  # none | permuted: each group's rewards shuffled among its trajectories before the
                           # advantages (a null control: the same update sizes without the rewards' information)
    ckpt_every: int = 10
    snapshots: bool = False  # also keep the scorers of every checkpoint as OUT/steps/step-NNNNNN, for a held-out
                             # curve (`foresight eval --scorers OUT/steps/step-000005 ...`)
    val_traces: int = 2  # the last traces of the dataset, held out for validation (at most a quarter of them)
    seed: int = 0
    deepspeed: str | None = None


@dataclass
class EvalConfig:
    num_problems: int = 16
    budgets: str = "256:64,512:128"
    methods: str = "full,golden,random,streamingllm,h2o,tova,snapkv,rkv,scissorhands,knorm,keydiff,random-keep-prompt"
    n_samples: int = 1
    do_sample: bool = False
    seed: int = 0
    protect_prompt: bool = False
    cache_references: bool = True  # keep the full-cache reference traces on disk ($FORESIGHT_CACHE) and reuse them
    batch_size: int = 32  # traces per teacher-forced batch (similar lengths, right-padded)
    scorer_selection: str = "topk"  # how trained scorers pick their L pairs: topk | sample (Top-2L) | multinomial
    scorer_temperature: float = 1.0  # the samplers' softmax temperature
    # recall@L and keep recall against golden for every method: golden's labels and a golden rollout per batch and
    # budget, the evaluation's costliest part on a CPU (SmolLM2: ~10 s per trace and budget, against ~2 s per method).
    # false: loss ratios and loss increases only (golden, when evaluated, still computes its own labels)
    recall: bool = True
    # a traces folder: evaluate on its validation traces (the last sft.val_traces, at most num_problems of them; they
    # already hold their full-cache losses) instead of the held-out references, to choose evaluation settings without
    # looking at the test set (foresight/evaluation/validation_references.py). null: the held-out prompts' references
    traces: str | None = None


@dataclass
class Recipe:
    name: str = "tiny-qwen3"
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    traces: TracesConfig = field(default_factory=TracesConfig)
    cache: EvictionSettings = field(default_factory=EvictionSettings)
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    kvpop: KVpopConfig = field(default_factory=KVpopConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe (None = the built-in defaults, i.e. tiny-qwen3) and apply ``section.field=value`` overrides."""
    recipe = Recipe()
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise RecipeError(f"recipe file not found: {p}")
        if not p.is_file():
            raise RecipeError(f"recipe {p} is not a file")
        try:
            data = read_yaml(p.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise RecipeError(f"recipe {p} is not valid YAML: {e}") from None
        fill(recipe, data, "")
    for item in overrides or []:
        if "=" not in item:
            raise RecipeError(f"--set expects section.field=value, got {item!r}")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        try:
            value = read_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError:
            raise RecipeError(f"--set {item!r}: the value is not valid YAML (quote strings)") from None
        nested: dict = {}
        cur = nested
        for part in parts[:-1]:
            cur = cur.setdefault(part, {})
        cur[parts[-1]] = value
        fill(recipe, nested, "")
    check_recipe(recipe)
    return recipe
