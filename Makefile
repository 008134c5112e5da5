# The two commands a newcomer needs (both create/use the local venv in .venv):
#   make demo   — runs the main job: `fitgraph inspect gpt2` on CPU (small config)
#   make test   — runs the test suite (the default, fast tier; CI runs this)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-slow test-gpu lint clean

$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,hf,lightning]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	mkdir -p out
	$(BIN)/fitgraph inspect gpt2 --plot out/gpt2-memory.png

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q -p no:cacheprovider --doctest-modules src tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m slow tests

# the GPU tier (needs CUDA; every test skips without it)
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_gpu.py
	$(BIN)/python -m pytest -q -p no:cacheprovider -k cuda tests/test_meter.py tests/test_offload.py

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache
