"""``make bench-gpu``: speed and memory of the eviction engine on a GPU, at the shapes of real models,
with random weights built from transformers configs (no download; speed does not depend on weight values).

Rows, each in a process of its own (``python -m benchmarks.gpubench --row NAME``, which prints one JSON line per
measurement; the parent collects them), so that one row's memory never affects another's:

* ``rollout``   teacher-forced rollout (H2O, budget B, interval L) versus one dense forward of the same tokens, single
  sequence, at every length; StreamingLLM and the learned scorers at the middle length; each also with its chunks
  recorded once and replayed (``graph``: CUDA graphs; ``torch.fx`` on CPU, :mod:`foresight.engine.recorded`);
* ``group``     GRPO's group: G rows of one trace, learned scorers with the Top-2L sampler, versus a dense pass over G rows
  (eager and ``graph``);
* ``golden``    golden labels (blockwise future attention, :mod:`foresight.targets.golden`) versus one dense forward;
* ``decode``    ms/token and tokens/s of :func:`foresight.engine.generate.generate` after a prompt of the middle length, full
  cache versus H2O, StreamingLLM and learned, at growing batch sizes (a policy stops at its first out-of-memory), the
  bounded ones also with the decoding step recorded once and replayed (``graph``: a CUDA graph; ``torch.fx`` on CPU);
* ``memory``    prefill peak memory above the weights (``torch.cuda.max_memory_allocated``) of a batch of prompts, H2O
  versus learned (full cache for reference); on CPU the largest transient tensor (:mod:`benchmarks.opcount`) instead;
* ``fit``       the largest bounded (H2O) batch whose prefill fits, doubling from the memory row's batch (CUDA only);
* ``launches``  CUDA kernels per chunk per layer of an H2O rollout (``torch.profiler``) versus a plain chunked forward;
  on CPU :mod:`benchmarks.opcount`'s aten operations per chunk per layer instead.

Every timing follows a warm-up on a short input (CUDA synchronised) and is the best of ``--repeat``; a rollout and its
dense pass are measured alternately. ``--time-budget`` seconds (default 480) bound the whole run: later rows, and later
measurements inside a row, are recorded as skipped. Writes ``OUT/gpubench.json`` and ``OUT/gpubench.md`` (rewritten after every
row, so a killed run keeps what it measured) and prints the table::

    make bench-gpu                                            # --device cuda --shape qwen3-4b --out bench-gpu
    python -m benchmarks.gpubench --device cpu --shape tiny    # a smoke run on CPU (under a minute)
    python -m benchmarks.gpubench --shape qwen3-8b --lengths 8192 --rows rollout,decode --time-budget 300

Shapes: ``qwen3-1.7b``, ``qwen3-4b``, ``qwen3-8b`` (bf16 on CUDA) and ``tiny`` (fp32 on CPU). Defaults on CUDA: B=2048,
L=128, lengths 8k/16k/32k, decoding batches 1/16/64/128 with 64 new tokens, memory at 4,096 tokens × 16; on CPU:
B=64, L=16, lengths 256/512, batches 1/4 with 8 new tokens, memory at 256 tokens × 2.
"""
