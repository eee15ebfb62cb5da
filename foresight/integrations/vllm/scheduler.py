"""The plugin's scheduler side: KV blocks follow each request's physical length, not its logical one.

Installed on one vLLM ``Scheduler`` instance (:func:`install`):

* ``kv_cache_manager.allocate_slots`` first frees the tail blocks an eviction emptied (the worker compacted the kept
  pairs into the first blocks at the end of the previous step), then allocates for the physical length. Both sides
  derive it from the same :class:`~foresight.integrations.vllm.settings.Schedule`, so no message passes between them.
* admission (``reserve``, the default): a new request is scheduled only when the blocks its bounded cache can reach
  are free beside those the running requests can still claim, so no request is preempted for space (vLLM's own
  admission looks at the prompt alone and preempts when the cache runs out, which an evicted request cannot survive);
* ``_preempt_request``: vLLM resumes a preempted request by recomputing its tokens, which cannot restore a cache that
  was evicted. Such a request is finished with an error (``finish_reason="error"``) and a log line naming the cause;
  one preempted before its first eviction resumes normally.
"""

from __future__ import annotations

import logging
import types

from foresight.integrations.vllm.settings import PluginSettings, Schedule

logger = logging.getLogger("foresight.vllm")


class SchedulerPlugin:
    def __init__(self, scheduler, settings: PluginSettings):
        self.scheduler, self.settings = scheduler, settings
        manager = scheduler.kv_cache_manager
        managers = manager.coordinator.single_type_managers
        if len(managers) != 1:
            raise ValueError(f"foresight plugin: the model has {len(managers)} KV cache groups; the plugin runs "
                             "models whose layers are all full attention (one group)")
        self.kv_manager, self.blocks = manager, managers[0]
        self.block_size = self.blocks.block_size
        self.refused: set[str] = set()

    def schedule(self, request) -> Schedule:
        return Schedule.of(self.settings.eviction, request.num_prompt_tokens)

    def allocate_slots(self, original, request, num_new_tokens, *args, **kwargs):
        if request.request_id in self.refused:
            return None
        computed = request.num_computed_tokens
        if computed == 0 and self.settings.reserve and not self.fits(request):
            return None  # it waits until the running requests leave room for its whole bounded cache
        dropped = self.schedule(request).dropped(computed)
        if not dropped:
            return original(request, num_new_tokens, *args, **kwargs)
        physical = computed - dropped
        self.free_tail(request.request_id, -(-physical // self.block_size))
        request.num_computed_tokens = physical  # allocation counts the physical length
        try:
            return original(request, num_new_tokens, *args, **kwargs)
        finally:
            request.num_computed_tokens = computed

    def bound(self, request) -> int:
        """Blocks the request's cache can reach (its capacity, or a longer prompt, or its whole length if shorter)."""
        return -(-self.schedule(request).peak(getattr(request, "max_tokens", None)) // self.block_size)

    def fits(self, request) -> bool:
        """Whether the free blocks hold ``request``'s bounded cache beside what the running requests can still claim."""
        claims = 0
        for other in self.scheduler.running:
            if other.request_id != request.request_id:
                held = len(self.blocks.req_to_blocks.get(other.request_id, ()))
                claims += max(0, self.bound(other) - held)
        return self.kv_manager.block_pool.get_num_free_blocks() - claims >= self.bound(request)

    def free_tail(self, req_id: str, keep: int) -> None:
        blocks = self.blocks.req_to_blocks.get(req_id)
        if blocks is not None and len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            self.kv_manager.block_pool.free_blocks(reversed(tail))

    def preempt(self, original, request, *args, **kwargs):
        evicted = self.schedule(request).dropped(request.num_computed_tokens) > 0
        out = original(request, *args, **kwargs)
        if evicted:
            self.refused.add(request.request_id)
            logger.error("foresight plugin: request %s was preempted after its KV cache was evicted; vLLM resumes a "
                         "preempted request by recomputing its tokens, which cannot restore an evicted cache, so it "
                         "is finished with an error (give vLLM more KV cache space or fewer concurrent sequences)",
                         request.request_id)
        return out

    def update_from_output(self, original, *args, **kwargs):
        if self.refused:  # finished with FINISHED_ERROR by the scheduler's own error path
            self.scheduler.grammar_compile_error_reqs.update(
                r for r in self.refused if r in self.scheduler.requests)
            self.refused.clear()
        return original(*args, **kwargs)


def install(scheduler, settings: PluginSettings) -> SchedulerPlugin:
    plugin = SchedulerPlugin(scheduler, settings)
    manager = scheduler.kv_cache_manager
    allocate, preempt, update = manager.allocate_slots, scheduler._preempt_request, scheduler.update_from_output
    manager.allocate_slots = types.MethodType(lambda _, *a, **k: plugin.allocate_slots(allocate, *a, **k), manager)
    scheduler._preempt_request = types.MethodType(lambda _, *a, **k: plugin.preempt(preempt, *a, **k), scheduler)
    scheduler.update_from_output = types.MethodType(lambda _, *a, **k: plugin.update_from_output(update, *a, **k),
                                                    scheduler)
    scheduler.foresight = plugin
    return plugin
