# Every target creates .venv on first use and is idempotent.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
CONFIG ?= configs/tiny-cpu.yaml

.PHONY: install demo train test test-gpu serve clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# torch first, as the CPU wheel on local disk; a later range it satisfies installs nothing more
	$(PY) -m pip install -q torch==2.13.0
	# deepspeed's setup imports torch: build it against the torch just installed
	$(PY) -m pip install -q --no-build-isolation -e '.[flows,dev,s3]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m megatrain.cli train --config $(CONFIG)

train: demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not gpu"

test-gpu:
	python3 -m pytest -q -m gpu tests

clean:
	rm -rf runs data/shards
