"""What scorers learn from: golden eviction (block-pooled future attention), golden-loss pooling, the GRPO reward
and KVpop's future-attention target."""
