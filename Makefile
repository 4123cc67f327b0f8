VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: bootstrap test test-fast lint serve demo clean

bootstrap:
	@VENV=$(VENV) scripts/bootstrap.sh

## test: lint, then the whole suite (fast tests and the few slow ones that use the demo model)
test: lint
	$(BIN)/python -m pytest

## test-fast: the suite without the demo model
test-fast: bootstrap
	$(BIN)/python -m pytest -m "not slow"

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
