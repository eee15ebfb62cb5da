"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks"):
keep the first ``sinks`` tokens (attention sinks) and the most recent tokens; evict the oldest others.

Rule: eviction score = -(token index), so the oldest non-protected pairs go first. The sinks themselves are
protected by the cache (``cache.sinks``; the eval harness sets 4, as in the paper and R-KV's code)."""

from foresight.policies.base import Policy, register


@register("streamingllm")
class StreamingLLM(Policy):
    reads = frozenset()

    def score(self, view):
        return -view.token.float()
