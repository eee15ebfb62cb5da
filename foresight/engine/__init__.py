"""The eviction engine: the bounded cache, the attention it registers, selection, teacher-forced rollout and generation."""
