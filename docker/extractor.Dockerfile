# The GPU extractor: hsx on vLLM's official image, whose vLLM, torch and CUDA stack stay
# exactly as shipped. Build from the repository root:
#   docker build -f docker/extractor.Dockerfile -t hsx-extractor .
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

# Every package the image already has is frozen as a constraint, so installing hsx adds
# only what is missing (confluent-kafka, zstandard, ...) and never replaces vLLM or torch.
# The base image installs its packages with uv; so do we.
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
RUN uv pip list --system --format=freeze > /tmp/image-packages.txt \
    && uv pip install --system --no-cache --constraint /tmp/image-packages.txt . \
    && rm -rf /src /tmp/image-packages.txt

# Non-root; vLLM, torch and triton write their caches under $HOME (a volume in Kubernetes).
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/hsx hsx
USER 10001
WORKDIR /home/hsx
ENV HOME=/home/hsx \
    HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1
EXPOSE 8080
ENTRYPOINT ["hsx", "extract"]
CMD ["--help"]
