VENV ?= .venv
# make test-vllm VLLM_PEER=vllm-0.31: lora_guard.vllm on the vLLM release before
VLLM_PEER ?= vllm
BIN := $(VENV)/bin

.PHONY: bootstrap test test-fast test-studies test-clients test-vllm peers lint serve demo clean

bootstrap:
	@VENV=$(VENV) scripts/bootstrap.sh

## test: lint, then the whole suite (fast tests and the few slow ones that use the demo model)
test: lint
	$(BIN)/python -m pytest

## test-fast: the suite without the demo model
test-fast: bootstrap
	$(BIN)/python -m pytest -m "not slow and not clients and not study"

## test-studies: the few whole studies on real servers or a real fleet (the sweep command, the
## simulator against a real 2-replica fleet, load then soak), about 2 minutes
test-studies: bootstrap
	$(BIN)/python -m pytest -m study -rP

## peers: the field's tools, each in its own venv under $LORA_GUARD_HOME/peers (vLLM's CPU build
## and guidellm, about 3.5 and 1.5 GB; the first time takes minutes)
peers: bootstrap
	scripts/vllm_system_libs.sh
	$(BIN)/python -m lora_guard.bench.peer_env vllm guidellm

## test-clients: vLLM's `vllm bench serve` and guidellm against a real server of the demo model
test-clients: peers demo
	$(BIN)/python -m pytest -m clients -rP

## test-vllm: lora_guard.vllm inside vLLM's CPU build (its environment made as for the bench, then
## this checkout installed into it); four vLLM servers of a tiny model, about 5 minutes
test-vllm: bootstrap
	scripts/vllm_system_libs.sh
	$(BIN)/python -m lora_guard.bench.peer_env $(VLLM_PEER)
	VLLM_PEER=$(VLLM_PEER) $(BIN)/python -m pytest -m vllm -rP

lint: bootstrap
	$(BIN)/ruff check lora_guard tests integration hooks
	$(BIN)/ruff format --check lora_guard tests integration hooks
	$(BIN)/mypy

## demo: prepare the demo model, its 24 seeded adapters and 4 personas (idempotent)
demo: bootstrap
	$(BIN)/lora-guard prepare-demo

## serve: the demo model and its 28 adapters on http://127.0.0.1:8080 (prepares what is missing)
serve: demo
	$(BIN)/lora-guard serve

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
