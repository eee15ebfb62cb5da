"""KVpop (arXiv 2607.05061) under foresight's harness: future-attention target and its teacher policy
(:mod:`.target`), decayed running top-k (:mod:`.topk`), scorers and their cache policy (:mod:`.scorers`),
boundary-loss training (:mod:`.train`, ``foresight sft --set sft.objective=kvpop``). The LLM stays frozen (KVpop's
distillation of the base model is out of scope)."""
