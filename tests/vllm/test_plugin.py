"""The vLLM plugin (``foresight.integrations.vllm``) on vLLM's CPU build, SmolLM2 exported in float32, eager: it keeps
stock tokens when disabled or unbounded, keeps at every eviction the pairs the project's own engine keeps (the shipped
scorer and the heuristics), treats each request of a batch as if it were alone, frees the blocks it evicted, refuses
what it cannot run with, and fails closed on a preempted request whose cache was evicted."""

from pathlib import Path

import pytest
import torch

from foresight.config.eviction import EvictionSettings
from foresight.engine.generate import Decoding, generate
from foresight.engine.rollout import rollout
from foresight.policies import make_policy
from foresight.scorers.checkpoint import load_scorer, policy_from_checkpoint
from benchmarks.vllm_plugin import STOCK
from benchmarks.vllm_run import run_llm

SCORER = "scorers/smollm2-135m/sft-w256-gap"
TIE = 1e-5  # a differing kept set must come from scores this close to the cut: float rounding, not logic


def llm_args(model_dir, foresight=None, **changes) -> dict:
    kw = dict(model=str(model_dir), dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=2048, max_num_batched_tokens=2048, enable_chunked_prefill=False, block_size=32)
    if foresight is not None:
        kw["additional_config"] = {"foresight": foresight}
    kw.update(changes)
    return kw


def spec(model_dir, prompts, max_tokens, foresight=None, **changes) -> dict:
    return {"llm": llm_args(model_dir, foresight, **changes), "prompts": prompts,
            "max_tokens": max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)}


def kept_steps(folder: Path) -> list[list[torch.Tensor]]:
    """Per request (in submission order), its kept token indices [layers, kv_heads, n] after each eviction."""
    reqs = sorted(folder.iterdir(), key=lambda p: int(p.name.split("-")[0]))
    return [[torch.load(f)["kept"] for f in sorted(r.iterdir())] for r in reqs]


def engine_steps(model, ids, policy, settings, prompt_len) -> list[dict]:
    steps = []
    rollout(model, torch.tensor([ids]), policy, settings, prompt_len=prompt_len, recorder=steps.append)
    return steps


def compare_kept(steps: list[dict], kept: list[torch.Tensor]) -> tuple[int, int, list[str]]:
    """(equal kept sets, all kept sets, first divergences that are not near-ties): per (step, layer, KV head), the
    engine's kept tokens (teacher-forced) against the plugin's. A head whose set differed once is compared no more
    (its cache, and so its later statistics, differ from then on)."""
    assert len(steps) == len(kept), f"{len(steps)} evictions in the engine, {len(kept)} in vLLM"
    equal = total = 0
    gone, bad = set(), []
    for s, (step, plug) in enumerate(zip(steps, kept)):
        tok = step["token"][:, 0]
        drop = torch.zeros_like(tok, dtype=torch.bool).scatter_(-1, step["chosen"][:, 0], True)
        mine = torch.sort(tok.masked_fill(drop, -1), -1).values[..., drop.shape[-1] - plug.shape[-1]:]
        same = (mine == torch.sort(plug, -1).values).all(-1)
        for layer in range(same.shape[0]):
            for head in range(same.shape[1]):
                if (layer, head) in gone:
                    continue
                total += 1
                if same[layer, head]:
                    equal += 1
                    continue
                gone.add((layer, head))
                scores, toks = step["scores"][layer, 0, head], tok[layer, head]
                cut = scores[step["chosen"][layer, 0, head]].min()
                swapped = set(mine[layer, head].tolist()) ^ set(plug[layer, head].tolist())
                gaps = [abs(float(scores[toks == t][0] - cut)) for t in swapped if (toks == t).any()]
                if not gaps or max(gaps) > TIE:
                    bad.append(f"step {s} layer {layer} head {head}: tokens {sorted(swapped)}, score gaps {gaps}")
    return equal, total, bad


def first_divergence(a: list[int], b: list[int]):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def test_disabled_and_unbounded_plugin_keep_stock_tokens(exported, prompts, tmp_path):
    s = spec(exported, prompts[:3], 200)
    stock = run_llm(tmp_path / "stock", s, env=STOCK)
    off = run_llm(tmp_path / "off", s)
    huge = run_llm(tmp_path / "huge", spec(exported, prompts[:3], 200, {"policy": "h2o", "budget": 1024,
                                                                         "interval": 64}))
    assert not stock["plugin_loaded"] and off["plugin_loaded"] and huge["plugin_loaded"]
    assert not off["plugin_active"] and huge["plugin_active"]
    for run in (off, huge):
        for i, (a, b) in enumerate(zip(stock["tokens"], run["tokens"])):
            assert a == b, f"request {i}: first differing token {first_divergence(a, b)}"


CASES = {  # name: (plugin settings, which prompts, new tokens, other LLM settings)
    "scorer-64:16": ({"scorer": SCORER, "budget": 64, "interval": 16}, [1, 3, 5], 240, {}),
    "scorer-128:32-protected": ({"scorer": SCORER, "budget": 128, "interval": 32, "protect_prompt": True},
                                [0, 1, 2], 320, {}),
    # prompts of 135-142 tokens prefilled in chunks of at most 48 tokens
    "scorer-128:32-protected-chunked-prefill": ({"scorer": SCORER, "budget": 128, "interval": 32,
                                                 "protect_prompt": True}, [0, 2], 200,
                                                {"enable_chunked_prefill": True, "max_num_batched_tokens": 48,
                                                 "max_model_len": 512, "max_num_seqs": 8}),
    "h2o-64:16": ({"policy": "h2o", "budget": 64, "interval": 16}, [1, 3], 200, {}),
    "tova-64:16": ({"policy": "tova", "budget": 64, "interval": 16}, [1, 3], 200, {}),
    "streamingllm-64:16": ({"policy": "streamingllm", "budget": 64, "interval": 16}, [1, 3], 200, {}),
}


def policy_of(cfg: dict, model):
    if "scorer" in cfg:
        bank, ckpt = load_scorer(cfg["scorer"], model)
        return policy_from_checkpoint(bank, ckpt)
    return make_policy(cfg["policy"])


@pytest.mark.parametrize("case", list(CASES))
def test_kept_pairs_and_tokens_equal_the_engine(case, exported, prompts, engine, tmp_path):
    cfg, which, new, llm = CASES[case]
    model = engine[0]
    record = tmp_path / "record"
    out = run_llm(tmp_path / "run", spec(exported, [prompts[i] for i in which], new, {**cfg, "record": str(record)},
                                         **llm))
    settings = EvictionSettings(budget=cfg["budget"], interval=cfg["interval"],
                                sinks=4 if cfg.get("policy") == "streamingllm" else 0,
                                protect_prompt=bool(cfg.get("protect_prompt")), prompt_overflow="evict")
    for i, (p, kept) in enumerate(zip(which, kept_steps(record))):
        ids, toks = prompts[p], out["tokens"][i]
        assert len(kept) >= 5  # it really evicted, several times
        equal, total, bad = compare_kept(engine_steps(model, ids + toks, policy_of(cfg, model), settings, len(ids)),
                                         kept)
        assert not bad, f"request {i}: kept sets differ beyond float rounding: {bad[:3]}"
        assert equal >= 0.97 * total, f"request {i}: {equal} of {total} kept sets equal"
        gen = generate(model, torch.tensor([ids]), max_new_tokens=new, policy=policy_of(cfg, model),
                       settings=settings, decoding=Decoding()).new_tokens[0].tolist()
        assert gen == toks, f"request {i}: greedy tokens differ from foresight.generate's at {first_divergence(gen, toks)}"


def test_each_request_of_a_mixed_batch_equals_itself_alone_and_holds_bounded_blocks(exported, prompts, tmp_path):
    cfg = {"scorer": SCORER, "budget": 64, "interval": 16}
    lengths = [260, 120, 200, 90]
    which = [prompts[i] for i in (0, 1, 3, 4)]
    batch = run_llm(tmp_path / "batch", spec(exported, which, lengths, {**cfg, "record": str(tmp_path / "rb")}))
    kept_batch = kept_steps(tmp_path / "rb")
    for i, (p, n) in enumerate(zip(which, lengths)):
        alone = run_llm(tmp_path / f"alone{i}", spec(exported, [p], n, {**cfg, "record": str(tmp_path / f"r{i}")}))
        assert batch["tokens"][i] == alone["tokens"][0], f"request {i}: first difference at " \
            f"{first_divergence(batch['tokens'][i], alone['tokens'][0])}"
        kept_alone = kept_steps(tmp_path / f"r{i}")[0]
        assert len(kept_alone) == len(kept_batch[i]) and all(torch.equal(a, b)
                                                            for a, b in zip(kept_alone, kept_batch[i]))
    bs = batch["block_size"]
    for i, p in enumerate(which):
        protected, cap = 0, 64 + 16
        first = max(len(p), protected + cap)
        after = [blocks for computed, blocks in batch["held"][str(i)] if computed > first]
        assert after, f"request {i} never evicted"
        assert max(after) <= -(-(protected + cap) // bs), f"request {i} held {max(after)} blocks of {bs}"


def test_settings_the_plugin_cannot_run_with_are_refused_at_start(exported, tmp_path):
    ours = {"policy": "h2o", "budget": 64, "interval": 16}
    bad = [llm_args(exported, ours, enable_prefix_caching=True),
           llm_args(exported, ours, kv_cache_dtype="fp8"),
           llm_args(exported, ours, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                       "prompt_lookup_max": 3}),
           llm_args(exported, ours, pipeline_parallel_size=2),
           llm_args(exported, {"scorer": "scorers/tiny-qwen3/grpo"}),
           llm_args(exported, {"policy": "no-such-policy", "budget": 64, "interval": 16})]
    errors = run_llm(tmp_path, {"refuse": bad})["errors"]
    named = ["prefix caching", "kv_cache_dtype=fp8", "speculative decoding", "pipeline/tensor parallelism",
             "trained for another model", "unknown eviction policy 'no-such-policy'"]
    for error, name in zip(errors, named):
        assert error is not None and "foresight plugin" in error and name in error, (name, error)


PREEMPTIONS = {  # prompts, new tokens, B, KV blocks of 32, max_model_len, reserve, what must happen
    # reserved admission: a request starts only when its bounded cache fits: nothing is preempted
    "reserved": ((1, 3, 5, 1, 3, 5, 1, 3), 150, 64, 8, 224, True, None),
    # vLLM's own admission: the newest request is preempted before its first eviction and, recomputed, ends as alone
    "before-eviction": ((1, 3, 5, 1, 3, 5, 1, 3), 150, 64, 8, 224, False, "length"),
    # prompts of 56-58 tokens evicted to 31 pairs (1 block) once prefilled; the next request is admitted, both need a
    # 2nd block, and vLLM preempts the newer one, already evicted
    "after-eviction": ((1, 5, 1), 36, 31, 4, 96, False, "error"),
}


@pytest.mark.parametrize("case", list(PREEMPTIONS))
def test_a_preempted_request_resumes_correctly_or_fails_closed(case, exported, prompts, tmp_path):
    """A KV space of a few blocks: with the plugin's reserved admission no request is preempted; with vLLM's own, a
    request preempted before its first eviction is recomputed and ends with the tokens it has alone, and one preempted
    after it ends with finish_reason "error" (vLLM's recomputation cannot restore an evicted cache), its tokens a
    prefix of those, and the log names the cause."""
    which, new, budget, blocks, max_len, reserve, expected = PREEMPTIONS[case]
    cfg = {"scorer": SCORER, "budget": budget, "interval": 16, "reserve": reserve}
    which = [prompts[i] for i in which]
    alone = run_llm(tmp_path / "alone", spec(exported, which, new, cfg, max_model_len=max_len))
    assert not alone["preempted"]  # room for all
    tight = run_llm(tmp_path / "tight", spec(exported, which, new, cfg, num_gpu_blocks_override=blocks,
                                             max_model_len=max_len))
    if expected is None:
        assert not tight["preempted"] and max(tight["running"]) == (blocks - 1) // -(-(budget + 16) // 32)
    else:
        assert tight["preempted"] and expected in tight["finish"], (tight["preempted"], tight["finish"])
    log = (tmp_path / "tight" / "run.log").read_text()
    for i, (finish, toks) in enumerate(zip(tight["finish"], tight["tokens"])):
        if finish == "error":
            assert i in tight["preempted"] and toks == alone["tokens"][i][:len(toks)]
            assert "was preempted after its KV cache was evicted" in log
        else:
            assert finish == "length" and toks == alone["tokens"][i], f"request {i}"


def test_the_plugin_runs_in_vllms_own_processes(exported, prompts, tmp_path):
    """vLLM's default: the scheduler in the engine-core process, the model runner in a worker process. Each loads the
    plugin and derives the same schedule: the tokens and the kept sets equal those of the one-process engine."""
    cfg = {"scorer": SCORER, "budget": 64, "interval": 16}
    which = [prompts[i] for i in (1, 3)]
    one = run_llm(tmp_path / "one", spec(exported, which, 160, {**cfg, "record": str(tmp_path / "r1")}))
    many = run_llm(tmp_path / "many", {**spec(exported, which, 160, {**cfg, "record": str(tmp_path / "r2")}),
                                       "multiprocess": True})
    assert many["tokens"] == one["tokens"]
    a, b = kept_steps(tmp_path / "r1"), kept_steps(tmp_path / "r2")
    assert [len(x) for x in a] == [len(x) for x in b] and min(len(x) for x in a) >= 5
    assert all(torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
