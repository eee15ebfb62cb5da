"""Scorer training: shared run plumbing, SFT (golden ranking), GRPO (``grpo/``) and KVpop's trainer."""
