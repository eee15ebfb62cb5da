"""The bounded KV cache and its parts: slots, storage, chunk plans, attention over slots and its statistics,
whole heads, per-layer budgets, forking, the full cache and RoPE shifts."""
