"""foresight: learned KV-cache eviction scorers (ForesightKV) for frozen LLMs."""

__version__ = "0.1.0"
