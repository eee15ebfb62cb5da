"""GRPO (ForesightKV §3.3): eviction as an MDP refined with clipped GRPO and a KL to the SFT scorers."""
