"""Call a running `deepinfer up` (127.0.0.1:8000) the way a user does: the official openai and anthropic SDKs."""

import time

from anthropic import Anthropic
from openai import OpenAI

oa = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
model = oa.models.list().data[0].id
print("model:", model)
r = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=16)
print("chat:", r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens)
t = time.perf_counter()
first = None
n = 0
for chunk in oa.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to fifty."}],
                                        max_tokens=256, stream=True, temperature=0):
    if chunk.choices and chunk.choices[0].delta.content:
        first = first or time.perf_counter()
        n += 1
end = time.perf_counter()
print(f"stream: {n} chunks, TTFT {1e3 * (first - t):.0f} ms, {n / (end - first):.0f} chunks/s after the first")
c = oa.completions.create(model=model, prompt="The capital of France is", max_tokens=8)
print("completions:", c.choices[0].finish_reason, c.usage.completion_tokens)
a = Anthropic(base_url="http://127.0.0.1:8000", api_key="none")
m = a.messages.create(model=model, max_tokens=16, messages=[{"role": "user", "content": "Hi!"}])
print("anthropic:", m.stop_reason, m.usage.input_tokens, m.usage.output_tokens)
