"""The attention shape of a transformers model config (its text part, for multimodal configs)."""

from __future__ import annotations

import dataclasses


def text_config(config):
    """The text model's config (``get_text_config()`` where the config has one, e.g. multimodal models)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    num_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.q_heads // self.kv_heads

    @classmethod
    def of(cls, config) -> "AttentionShape":
        c = text_config(config)
        q = c.num_attention_heads
        return cls(c.num_hidden_layers, q, getattr(c, "num_key_value_heads", None) or q,
                   getattr(c, "head_dim", None) or c.hidden_size // q)
