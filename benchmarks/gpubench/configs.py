"""The named model shapes (Qwen3 configs, and a tiny one for CPU), the settings of one run (:class:`BenchSettings`),
and building a shape with random weights directly on a device."""

from __future__ import annotations

import dataclasses

import torch

from foresight.config.eviction import EvictionSettings

QWEN3_VOCAB = 151936
SHAPES = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=QWEN3_VOCAB, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=QWEN3_VOCAB, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=QWEN3_VOCAB, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """What one run measures (the child processes get it whole, as JSON)."""

    device: str = "cuda"
    shape: str = "qwen3-4b"
    budget: int = 2048  # B
    interval: int = 128  # L
    lengths: tuple[int, ...] = (8192, 16384, 32768)
    group: int = 8  # GRPO's trajectories per trace
    temperature: float = 0.02  # the Top-2L sampler's, in the group row
    batches: tuple[int, ...] = (1, 16, 64, 128)  # decoding
    new_tokens: int = 64  # decoding steps timed per batch
    memory_prompt: int = 4096
    memory_batch: int = 16
    fit_cap: int = 512
    launch_chunks: int = 8  # chunks past the budget in the profiled rollout
    repeat: int = 2  # best of
    seed: int = 0

    @property
    def middle(self) -> int:
        return self.lengths[(len(self.lengths) - 1) // 2]

    @property
    def eviction(self) -> EvictionSettings:
        return EvictionSettings(budget=self.budget, interval=self.interval)

    @classmethod
    def defaults(cls, device: str) -> "BenchSettings":
        if device == "cuda":
            return cls()
        return cls(device=device, shape="tiny", budget=64, interval=16, lengths=(256, 512), batches=(1, 4), new_tokens=8,
                   memory_prompt=256, memory_batch=2)

    def check(self) -> None:
        """Refuse settings that cannot be measured, with a message that names the problem."""
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; known: {', '.join(SHAPES)}")
        self.eviction.validate()
        first = self.budget + self.interval
        for name, n in [("length", S) for S in self.lengths] + [("--memory-prompt", self.memory_prompt)]:
            if n <= first:
                raise ValueError(f"{name} {n} must exceed B + L = {first} (no eviction happens before that)")
        for name in ("group", "new_tokens", "memory_batch", "fit_cap", "launch_chunks", "repeat"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.lengths or not self.batches or min(self.batches) < 1:
            raise ValueError(f"need at least one length and batch sizes >= 1, got {self.lengths} and {self.batches}")


def shape_config(name: str):
    """The transformers config of a named shape (no model is built)."""
    from transformers import Qwen3Config

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return Qwen3Config(**SHAPES[name], max_position_embeddings=40960)


def build_model(s: BenchSettings):
    """The shape with random weights, directly on the device (bf16 on CUDA, fp32 on CPU), with the project's attention."""
    from transformers import AutoModelForCausalLM

    from foresight.engine.attention import use_foresight_attention

    dev = torch.device(s.device)
    torch.manual_seed(s.seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(shape_config(s.shape),
                                                 dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return use_foresight_attention(model.eval())

