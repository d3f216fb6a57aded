# The image `pretrain/cluster` runs (prefect.yaml): its flow pods (`prefect flow-run execute`, the
# work pool's command) and every stage Job's ranks (`python -m torch.distributed.run -m
# megatrain.train`, tasks/kubernetes.py). Build: `make image` (IMAGE=registry/megatrain:tag).
# The package is installed the way the Makefile installs it; on Linux x86_64 PyPI's torch wheel
# is the CUDA build the GPU nodes need.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    MEGATRAIN_ROOT=/opt/megatrain \
    PYTHONPATH=/opt/megatrain \
    PREFECT_SERVER_ANALYTICS_ENABLED=false

# git for Prefect's pull steps, a compiler for DeepSpeed's JIT ops.
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends git build-essential \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/megatrain
# Dependencies first (cached while only the code changes): the same steps as the Makefile's $(STAMP).
COPY pyproject.toml ./
RUN mkdir -p megatrain flows tasks \
 && touch megatrain/__init__.py flows/__init__.py tasks/__init__.py \
 && python -m pip install -q --upgrade pip setuptools wheel \
 && python -m pip install -q torch==2.13.0 \
 && python -m pip install -q --no-build-isolation -e '.[flows,s3,cluster]'

COPY megatrain ./megatrain
COPY flows ./flows
COPY tasks ./tasks
COPY configs ./configs
COPY infra/k8s ./infra/k8s
COPY prefect.yaml ./

# No ENTRYPOINT: the Kubernetes work pool passes `prefect flow-run execute` as the container's
# args, and the stage Jobs set their own command (bash -c "exec python -m torch.distributed.run ...").
CMD ["python", "-m", "megatrain.cli", "--help"]
