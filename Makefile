# Every target creates .venv on first use and is idempotent.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
CONFIG ?= configs/tiny-cpu.yaml
IMAGE  ?= megatrain:latest

.PHONY: install services demo demo-gpu train test check test-gpu serve stop image clean
# Prefect's temporary local server (SQLite) starts slowly on 2 cores.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 90
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# torch first, as the CPU wheel on local disk; a later range it satisfies installs nothing more
	$(PY) -m pip install -q torch==2.13.0
	# deepspeed's setup imports torch: build it against the torch just installed
	$(PY) -m pip install -q --no-build-isolation -e '.[flows,dev,s3]'
	touch $(STAMP)

install: $(STAMP)

# What the tests start themselves (real servers and a real browser, on loopback): redis-server
# for the Redis store and lease tests, Debian's chromium for the Prefect UI picture test.
services:
	scripts/install-services.sh

# The main job: the `pretrain` flow on the local campaign (two stages, injected faults), a new
# campaign id per run so every demo trains from scratch. One screen of output; every rank line
# is in runs/campaigns/<id>/<stage>/logs/ (--verbose shows them here too).
demo: $(STAMP)
	$(PY) -m flows.pretrain configs/campaign-local.yaml id=demo-$$(date +%Y%m%d-%H%M%S)

# The same on this machine's GPUs (configs/campaign-gpu.yaml: the 1.3B GPT, one rank per visible GPU,
# the same two faults; it stops at once on a machine without CUDA). The console adds MFU.
demo-gpu: $(STAMP)
	$(PY) -m flows.pretrain configs/campaign-gpu.yaml id=gpu-demo-$$(date +%Y%m%d-%H%M%S)

# One plain training run of a recipe, no Prefect.
train: $(STAMP)
	$(PY) -m megatrain.cli train --config $(CONFIG)

serve: $(STAMP)
	VENV_BIN=$(VENV)/bin scripts/serve.sh

stop:
	scripts/serve.sh stop

# The image `pretrain/cluster` runs (then: docker push $(IMAGE); MEGATRAIN_IMAGE=$(IMAGE) make serve).
image:
	docker build -t $(IMAGE) .

# The whole suite (the README's command; CI runs it): every test but the GPU ones, whole test
# modules on JOBS workers, longest modules first (tests/conftest.py, tests/module_seconds.json).
# 3 on this project's 2-core CI machines: with 2, the cores sat ~15% idle while tests waited on
# servers, timeouts and subprocess start-ups; 3 keeps them busy (~7% idle; measured 15:50 -> 13:42,
# 1498 passed both ways). It ends with the 25 slowest tests: what to look at first when the suite
# outgrows its time.
JOBS ?= 3
PYTEST := $(PY) -m pytest -q -n $(JOBS) --dist loadfile

test: $(STAMP) services
	$(PYTEST) -m "not gpu" --durations=25

# The inner loop (under 3 minutes on 2 cores): the unit tests and one end-to-end flow (marked
# `check`); the multi-process and end-to-end tests (`slow`) wait for make test.
check: $(STAMP) services
	$(PYTEST) -m "check or (not gpu and not slow)"

test-gpu:
	python3 -m pytest -q -m gpu tests

clean:
	rm -rf runs data/shards
