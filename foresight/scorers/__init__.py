"""Learned scorers: ForesightKV's scorer bank, KVpop's scorers, and the checkpoint format both ship in."""
