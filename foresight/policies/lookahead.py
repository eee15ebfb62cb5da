"""Lookahead (this project's, from the scorer input ``ahead``): keep the pairs the recent queries would attend to most
if they were written a little later.

Rule: eviction score = -(``a32``: the sum over the last 32 queries of the attention each would give the pair from 32
tokens further on — its post-RoPE vector turned by 32 more positions, :mod:`foresight.engine.cache.rope_shift` — averaged over the
GQA group's query heads). SnapKV's and TOVA's rules read the same queries at their own positions; a query's view of a
key turns with their distance under RoPE, and the future queries are further away. On SmolLM2's full cache it ranks
golden's future better than the block sum of the same queries (rank correlation 0.80 against 0.76;
docs/results/smollm2-135m/probe-sft-variants/ahead/). Needs a rotary model."""

from foresight.policies.base import LeastAttended, register


@register("lookahead")
class Lookahead(LeastAttended):
    stat, default_pool = "a32", "mean"
