# kfp-pytorch: one image for pipeline steps, training workers (torchrun) and the KServe predictor.
#
# Build (needs network and a Docker engine; not built in this repository's CI):
#   docker build -t registry.example.com/kfp-pytorch:0.1.0 .
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 -t ...:0.1.0-cu124 .
# Entrypoints (set by the generated manifests, not by this image):
#   pipeline steps:    python3 -m kfp.dsl.executor_main ...      (KFP lightweight components)
#   training replicas: python -m torch.distributed.run -m kfp_pytorch.components.train_worker ...
#   predictor:         python -m kfp_pytorch.components.kserve_predictor --model_name NAME --model_uri /mnt/models
FROM python:3.11.10-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the chosen index (CPU by default: the CUDA wheels are several GB).
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/kfp-pytorch
COPY pyproject.toml README.md __init__.py __main__.py ./
COPY cli ./cli
COPY .ci/constraints.txt ./constraints.txt
COPY components ./components
COPY pipelines ./pipelines
COPY fairness_scheduler ./fairness_scheduler
COPY monitoring ./monitoring
# The releases the tests ran with (torch is not in the file: the line above chose it).
RUN pip install -c constraints.txt . && python -c "import kfp_pytorch.components.kserve_predictor, kfp_pytorch.components.train_worker"

# Non-root, as restricted Pod Security Standards require.
RUN useradd --uid 1000 --create-home kfp
USER 1000
WORKDIR /home/kfp
EXPOSE 8080
