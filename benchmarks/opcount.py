"""Machine-independent costs of the eviction engine: how many aten operations it dispatches per chunk and layer
beyond a plain forward of the same chunks, and the largest tensor a chunked prefill materialises. Counted with a
``TorchDispatchMode``, so the figures are the same on any machine (a regression shows on CPU in the tests) and
track GPU kernel launches, which is what bounds the engine on a GPU.

``python -m benchmarks.opcount`` prints them for the reference shape (a 4-layer Qwen3, d=256, 8 query
/ 4 KV heads, B=256, L=64, 1,024 tokens; batch 4, vocabulary 1,000 for the prefill); ``make bench`` includes them.
"""

from __future__ import annotations

import argparse
import json
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from foresight.config.eviction import EvictionSettings
from benchmarks.opcount_table import opcount_table

IGNORED = {"aten.detach.default", "aten.alias.default", "aten._to_copy.default"}  # views of no cost, dtype moves


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten operations and the tensors they allocate (views of existing storage, such as slices of
    the cache, are not allocations): ``largest`` of all, ``largest_transient`` of those freed again before the block
    ends (working memory), ``largest_resident`` of those still alive (the cache's own storage, results)."""

    def __init__(self, track_from: int = 1 << 16):
        super().__init__()
        self.ops = 0
        self.largest = self.largest_transient = self.largest_resident = 0
        self.by_name: dict[str, int] = {}
        self.track_from = track_from
        self._big: list = []  # (values, weakref) of allocations of at least track_from values

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name not in IGNORED:
            self.ops += 1
            self.by_name[name] = self.by_name.get(name, 0) + 1
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values())
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
                if t.numel() >= self.track_from:
                    self._big.append((t.numel(), weakref.ref(t)))
        return out

    def __exit__(self, *exc):
        for n, ref in self._big:
            if ref() is None:
                self.largest_transient = max(self.largest_transient, n)
            else:
                self.largest_resident = max(self.largest_resident, n)
        self._big = []
        return super().__exit__(*exc)


def reference_model(vocab: int = 1000, layers: int = 4, seed: int = 0):
    """The reference shape (random weights: counts do not depend on their values)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from foresight.engine.attention import use_foresight_attention

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=8192,
                      tie_word_embeddings=True)
    return use_foresight_attention(Qwen3ForCausalLM(cfg).eval())


def policy_for(name: str, model):
    """A heuristic by name, or ``learned``: a randomly initialised scorer bank (it costs what a trained one does)."""
    from foresight.policies import make_policy
    from foresight.scorers.bank import LearnedPolicy, bank_for_model

    return LearnedPolicy(bank_for_model(model)) if name == "learned" else make_policy(name)


@torch.no_grad()
def ops_per_chunk(policy: str, model=None, S: int = 1024, B: int = 256, L: int = 64) -> dict:
    """A teacher-forced rollout of ``S`` tokens under ``policy`` against a plain forward of the same chunks through
    transformers' ``DynamicCache``: dispatched operations per chunk and layer, for both and their difference."""
    from transformers import DynamicCache

    from foresight.engine.rollout import RolloutOptions, rollout

    model = model or reference_model()
    layers = model.config.num_hidden_layers
    ids = torch.randint(10, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(0))
    settings = EvictionSettings(budget=B, interval=L)
    chunks = [L] * (S // L) + ([S % L] if S % L else [])  # the rollout's own chunks: L tokens up to each eviction
    with OpCounter() as plain:
        cache, s = DynamicCache(), 0
        for q in chunks:
            model(input_ids=ids[:, s:s + q], cache=cache, use_cache=True)
            s += q
    with OpCounter() as ours:
        rollout(model, ids, policy_for(policy, model), settings,
                options=RolloutOptions(generator=torch.Generator().manual_seed(0)))
    per = len(chunks) * layers
    return {"policy": policy, "chunks": len(chunks), "layers": layers, "plain_per_chunk_layer": round(plain.ops / per, 1),
            "rollout_per_chunk_layer": round(ours.ops / per, 1), "extra_per_chunk_layer": round((ours.ops - plain.ops) / per, 1)}


@torch.no_grad()
def prefill_largest(prompt_len: int, policy: str = "h2o", model=None, batch: int = 4, B: int = 256, L: int = 64) -> dict:
    """The largest tensor (values) materialised while a bounded cache prefills ``batch`` prompts of ``prompt_len``
    tokens and decodes one token, against the bound max(b·V, b·H·L·(B+L))."""
    from foresight.engine.generate import GenerateOptions, generate

    model = model or reference_model()
    ids = torch.randint(10, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    with OpCounter() as c:
        res = generate(model, ids, max_new_tokens=1, policy=policy_for(policy, model),
                       settings=EvictionSettings(budget=B, interval=L),
                       options=GenerateOptions(generator=torch.Generator().manual_seed(0)))
        del res
    bound = max(batch * model.config.vocab_size, batch * model.config.num_attention_heads * L * (B + L))
    return {"prompt_len": prompt_len, "policy": policy, "largest_transient": c.largest_transient,
            "largest_resident": c.largest_resident, "bound": bound}


class _RecordingsCountOnce:
    """Within this block a recorded step (foresight.engine.recorded.Recording) counts as one operation, its recording and
    each replay alike: on a GPU each is one graph launch."""

    def __enter__(self):
        from torch.utils._python_dispatch import _disable_current_modes

        from foresight.engine.recorded import Recording

        self.calls, self._saved = 0, (Recording.record, Recording.replay)

        def once(method):
            def run(rec, *args):
                self.calls += 1
                with _disable_current_modes():
                    return method(rec, *args)
            return run

        Recording.record, Recording.replay = once(Recording.record), once(Recording.replay)
        return self

    def __exit__(self, *exc):
        from foresight.engine.recorded import Recording

        Recording.record, Recording.replay = self._saved


def _host_ops(run) -> tuple[int, int]:
    """Operations ``run()`` dispatches on the host, a recording or replay counting as one, and how many of them wait
    for the device (:data:`foresight.engine.static_step.SYNC_OPS`: on a GPU each stalls the launch queue)."""
    from foresight.engine.static_step import SYNC_OPS

    with _RecordingsCountOnce() as rec, OpCounter() as c:
        run()
    return c.ops + rec.calls, sum(n for name, n in c.by_name.items() if name.split(".")[1] in SYNC_OPS)


class _AsOnAccelerator:
    """Within this block the engine's device-dependent choices are an accelerator's, so that counts made on a CPU
    are a GPU's: generation checks for EOS every EOS_CHECK_EVERY tokens (a CPU: every token) and the golden pass
    runs as many blocks per forward as its memory limit allows (a CPU: one)."""

    def __enter__(self):
        from foresight.engine import generate
        from foresight.targets import golden

        self._saved = generate.eos_check_interval, golden.queries_per_chunk
        per_chunk = golden.queries_per_chunk
        generate.eos_check_interval = lambda device: generate.EOS_CHECK_EVERY
        golden.queries_per_chunk = lambda rows, q_heads, length, interval, device: per_chunk(
            rows, q_heads, length, interval, torch.device("cuda"))
        return self

    def __exit__(self, *exc):
        from foresight.engine import generate
        from foresight.targets import golden

        generate.eos_check_interval, golden.queries_per_chunk = self._saved


@torch.no_grad()
def recorded_rollout_ops(policy: str, model=None, S: int = 1024, B: int = 256, L: int = 64) -> dict:
    """:func:`ops_per_chunk`'s rollout with its chunks recorded (``rollout(options=RolloutOptions(step="graph"))``):
    operations the host dispatches per chunk and layer once chunks replay (the difference between a rollout of S + 8L
    and one of S tokens, over 8 chunks), a recording or replay counting as one (a graph launch), against the eager
    rollout's the same way."""
    from foresight.engine.rollout import RolloutOptions, rollout

    model = model or reference_model()
    ids = torch.randint(10, model.config.vocab_size, (1, S + 8 * L), generator=torch.Generator().manual_seed(0))

    def count(n: int, step: str) -> int:
        ops, _ = _host_ops(lambda: rollout(model, ids[:, :n], policy_for(policy, model),
                                           EvictionSettings(budget=B, interval=L),
                                           options=RolloutOptions(torch.Generator().manual_seed(0), step=step)))
        return ops

    per = 8 * model.config.num_hidden_layers
    return {"policy": policy, "S": S, "eager_per_chunk_layer": round((count(S + 8 * L, "eager") - count(S, "eager")) / per, 1),
            "recorded_per_chunk_layer": round((count(S + 8 * L, "graph") - count(S, "graph")) / per, 1)}


@torch.no_grad()
def decode_ops(policy: str, model=None, batch: int = 1, prompt: int = 320, new_tokens: int = 257, B: int = 256,
               L: int = 64) -> dict:
    """Operations the host dispatches per generated token (prefill excluded; evictions amortised): eager decoding
    against the static step recorded as a graph (``GenerateOptions(step="graph")``), where a step's own operations are
    one replay (on a GPU: one launch) and the host runs only what lies between steps (sampling, positions, the
    eviction every L tokens); and how many of them are host syncs. Decoding has an EOS token (never drawn: it lies
    outside the vocabulary) checked as on an accelerator."""
    from foresight.engine.generate import Decoding, GenerateOptions, generate

    model = model or reference_model()
    ids = torch.randint(10, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    settings = EvictionSettings(budget=B, interval=L)
    decoding = Decoding(eos_token_id=model.config.vocab_size)

    def count(step: str, tokens: int) -> tuple[int, int]:
        with _AsOnAccelerator():
            return _host_ops(lambda: generate(model, ids, max_new_tokens=tokens, policy=policy_for(policy, model),
                                              settings=settings, decoding=decoding,
                                              options=GenerateOptions(torch.Generator().manual_seed(0), step=step)))

    res = {"policy": policy, "batch": batch, "B": B, "L": L, "tokens": new_tokens - 1}
    for step in ("eager", "graph"):
        (ops, syncs), (ops1, syncs1) = count(step, new_tokens), count(step, 1)
        res[f"{step}_per_token"] = round((ops - ops1) / (new_tokens - 1), 1)
        res[f"{step}_syncs_per_token"] = round((syncs - syncs1) / (new_tokens - 1), 2)
    return res


@torch.no_grad()
def golden_ops(model=None, S: int = 1024, B: int = 256, L: int = 64) -> dict:
    """Operations of the golden labels' dense pooled pass per block of L queries, as a CPU runs it (one block per
    forward) and as an accelerator does (as many blocks per forward as the explicit scores' memory limit allows),
    against a plain chunked forward of L tokens at a time."""
    from transformers import DynamicCache

    from foresight.targets.golden import block_pooled_attention

    model = model or reference_model()
    ids = torch.randint(10, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(0))
    settings = EvictionSettings(budget=B, interval=L)
    blocks = S // L
    with OpCounter() as plain:
        cache = DynamicCache()
        for s in range(0, S, L):
            model(input_ids=ids[:, s:s + L], cache=cache, use_cache=True)
    with OpCounter() as cpu:
        block_pooled_attention(model, ids, settings)
    with _AsOnAccelerator(), OpCounter() as acc:
        block_pooled_attention(model, ids, settings)
    return {"S": S, "B": B, "L": L, "plain_per_block": round(plain.ops / blocks, 1),
            "cpu_per_block": round(cpu.ops / blocks, 1), "accelerator_per_block": round(acc.ops / blocks, 1)}


def report(policies=("streamingllm", "h2o", "learned"), prompts=(1024, 4096)) -> dict:
    model = reference_model()
    return {"ops": [ops_per_chunk(p, model) for p in policies],
            "prefill": [prefill_largest(n, policy=p, model=model) for p in ("h2o", "learned") for n in prompts],
            "recorded": [recorded_rollout_ops(p, model) for p in policies],
            "decode": [decode_ops(p, model) for p in policies], "golden": golden_ops(model)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = report()
    print(json.dumps(res) if args.json else opcount_table(res))


if __name__ == "__main__":
    main()
