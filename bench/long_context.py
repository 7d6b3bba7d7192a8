"""The seed's workload through the running mesh: long prompts, mostly cached, on a DeepSeek-V4 model.

    python bench/long_context.py --build flash --layers 8 --experts 32 --prompt-tokens 77000 \
        --out bench/results/<date>-long-context-h200.md          # on the GPU machine
    python bench/long_context.py --build tiny --prompt-tokens 3000  # a CPU smoke run (minutes)
    python bench/long_context.py --build flash --layers 43 --experts 8 --load-format dummy --prompt-tokens 77000

Starts `deepinfer up --model DIR` (one prefill and one decode worker, the kvcache service with its RAM and SSD
tiers) on a free port and drives it over HTTP with streamed completions of raw token ids (greedy, ignore_eos),
so every prompt has exactly the length asked for. One conversation, as the seed's traffic is: each follow-up
turn's prompt is the previous prompt, its answer (its ids come back through logprobs spelled as ids, vLLM's
return_tokens_as_token_ids) and a new user turn of (1 - cached) x prompt-tokens, so 96 % of a 77K follow-up is
cached: the previous turn's full blocks and the short-term snapshot decode saved at its end. Per path, the time
to the first token (TTFT) and the prompt's cached tokens as the mesh reports them:

  cold                  the first turn (prompt-tokens less a new turn and an answer), nobody has seen it
  follow-up: own cache  the next turn: the prefill worker's own prefix cache + the snapshot
  follow-up: RAM tier   the next, after the prefill worker is killed (the launcher restarts it): the blocks from
                        the kvcache service's RAM tier
  follow-up: SSD tier   the next, after the kvcache service is killed too: the blocks from its SSD tier, the
                        snapshot from its short-term LMDB tier
  branch: replay        another branch off the first turn, sharing its full blocks up to a point with no
                        snapshot: the rings are rebuilt by the bounded replay (layers x (window - 1) tokens),
                        never the whole prompt
and decode tokens/s per stream with `streams` follow-up turns of the conversation streaming at once.

--build tiny is tests/v4_checkpoints' served checkpoint (4K context); --build flash is transformers'
DeepseekV4Config defaults (V4-Flash's widths and layer schedule) cut to --layers layers and --experts routed
experts, random bf16 weights made on the GPU and saved once under --work (about 2.2 GB per layer at 32
experts). With --load-format dummy only the model's config.json is written (a directory named ...-dummy, so
its served name says so) and the workers draw random weights themselves (`deepinfer up --load-format dummy`):
the 43-layer model, whose checkpoint would not fit the GPU machine's disk (~78 GiB at 32 experts), runs as
`--build flash --layers 43 --experts 8 --load-format dummy` (~30 GiB of bf16 weights per worker: the prefill
and the decode worker each hold a copy on the one GPU). Ratios between paths matter more than absolute times
on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.mesh import Mesh, pids_mentioning, start_mesh  # noqa: E402

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# --- the model directory ----------------------------------------------------------------------------------------


def flash_config(layers: int, experts: int, context: int):
    """V4-Flash's widths and layer schedule (transformers' defaults), `layers` deep with `experts` routed experts."""
    from transformers import DeepseekV4Config

    base = DeepseekV4Config()
    return DeepseekV4Config(
        num_hidden_layers=layers, layer_types=base.layer_types[:layers], mlp_layer_types=base.mlp_layer_types[:layers],
        n_routed_experts=experts, max_position_embeddings=context, torch_dtype="bfloat16",
    )


def build_flash(root: Path, layers: int, experts: int, context: int) -> Path:
    """flash_config's model with random weights at init scale; sinks, biases and the hash table drawn as
    tests/v4_checkpoints does."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    path = root / f"DeepSeek-V4-Flash-{layers}L-{experts}E"
    if (path / "config.json").exists():
        return path
    config = flash_config(layers, experts, context)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV4ForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                tensor.normal_()
            elif name.endswith((".base", "hc_base")):
                tensor.normal_(std=0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(std=0.1)
            elif name.endswith("tid2eid"):
                k = config.num_experts_per_tok
                buf.copy_(torch.stack([torch.randperm(experts, device=device)[:k] for _ in range(buf.shape[0])]))
    model.save_pretrained(path, max_shard_size="4GB")
    del model
    if device == "cuda":  # the workers size their KV pools from what is free: give back what building took
        torch.cuda.empty_cache()
    return path


def build_tiny(root: Path) -> Path:
    from tests import v4_checkpoints

    return v4_checkpoints.build_served(root)


def write_config(root: Path, build: str, layers: int, experts: int, context: int) -> Path:
    """--load-format dummy: the model directory is its config.json alone (the packaged V4 tokenizer serves it),
    under a name that says the weights are dummy (the served name, so no result table passes for a real one).
    `context`: the flash model's (the tiny one has its own 4K)."""
    from tests import v4_checkpoints

    if build == "flash":
        config, name = flash_config(layers, experts, context), f"DeepSeek-V4-Flash-{layers}L-{experts}E"
    else:
        config, name = v4_checkpoints.served_config(), v4_checkpoints.SERVED_NAME
    path = root / f"{name}-dummy"
    config.save_pretrained(path)  # config.json only: no weights, nothing else the stack reads
    return path


# --- the client -------------------------------------------------------------------------------------------------


@dataclass
class Turn:
    ttft: float
    total: float
    tokens: int
    cached: int
    prompt: int
    answer: list[int]  # the generated ids (logprobs spelled as ids): the next turn's prompt carries them

    @property
    def decode_rate(self) -> float:
        return (self.tokens - 1) / (self.total - self.ttft) if self.tokens > 1 and self.total > self.ttft else 0.0


async def complete(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int
                   ) -> Turn:
    """One streamed completion of raw ids, greedy; its answer's ids come back through logprobs spelled as ids
    (vLLM's return_tokens_as_token_ids)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.monotonic()
    first = None
    tokens = cached = prompt_tokens = 0
    answer: list[int] = []
    async with session.post(url + "/v1/completions", data=orjson.dumps(body),
                            headers={"content-type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text") is not None:
                first = first or time.monotonic()
                tokens += 1
                lps = event["choices"][0].get("logprobs") or {}
                answer += [int(t.removeprefix("token_id:")) for t in lps.get("tokens", [])]
            usage = event.get("usage")
            if usage:
                tokens = usage.get("completion_tokens", tokens)
                prompt_tokens = usage.get("prompt_tokens", 0)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    done = time.monotonic()
    if len(answer) != tokens:  # ids after the answer's last text (control tokens) are not reported
        log(f"warning: {len(answer)} of the answer's {tokens} ids came back: the next turn will miss its snapshot")
    return Turn((first or done) - started, done - started, tokens, cached, prompt_tokens, answer)


def settled(mesh: Mesh, timeout: float = 120.0) -> None:
    """Wait until the prefill worker has stored every prompt it computed (its log's "stored" lines): a kill
    measures the tiers behind it, not the loss of the stores still in flight."""
    logfile = mesh.state_dir / "logs" / "prefill-0.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = logfile.read_text(errors="replace") if logfile.exists() else ""
        if text.count(": stored ") >= text.count(" prompt tokens, "):
            return
        time.sleep(0.2)
    log("warning: the prefill worker's stores did not settle")


def kill(mesh: Mesh, service: str) -> None:
    """SIGKILL one service of the mesh (the launcher restarts it), then wait for its new process to load."""
    settled(mesh)
    marker = f"services.{service}"
    old = [p for p in pids_mentioning(str(mesh.state_dir)) if marker in Path(f"/proc/{p}/cmdline").read_text()]
    logfile = mesh.state_dir / "logs" / f"{service}-0.log"
    offset = logfile.stat().st_size if logfile.exists() else 0
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        time.sleep(0.5)
        text = logfile.read_text(errors="replace")[offset:] if logfile.exists() else ""
        if service in ("prefill", "decode") and "loaded " in text:
            break
        if service not in ("prefill", "decode") and text:
            break
    time.sleep(4.0)  # heartbeats: the balancer sees the new worker (and forgets the old one)
    log(f"{service} killed and restarted")


async def wait_ready(url: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError("mesh not ready")


async def drive(args: argparse.Namespace, mesh: Mesh, model: str, block: int) -> dict[str, list[Turn]]:
    """The conversation's turns: each follow-up's prompt is the previous prompt, its answer and a new user turn
    (`1 - cached` of `prompt-tokens`), so its cached part is the previous turn's end: the full blocks and the
    short-term snapshot decode saved there."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, 100000) for _ in range(n)]

    n = args.prompt_tokens
    new = max(1, round(n * (1 - args.cached)))
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    results: dict[str, list[Turn]] = {}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(name: str, prompt: list[int]) -> list[int]:
            """The turn's prompt followed by its answer (what the next turn starts with)."""
            turn = await complete(session, mesh.base_url, model, prompt, args.max_tokens)
            results.setdefault(name, []).append(turn)
            log(f"{name}: TTFT {turn.ttft * 1e3:,.0f} ms, {turn.cached:,} of {turn.prompt:,} cached, "
                f"{turn.decode_rate:.1f} tok/s")
            return prompt + turn.answer

        await one("warm-up (short)", tokens(block * 2))
        for _ in range(args.rounds):
            # the first turn: 77K tokens less the follow-up's new turn and this answer, nobody has seen them
            history = await one("cold", tokens(n - new - args.max_tokens))
            shared = list(history)
            history = await one("follow-up: own cache", history + tokens(new))
            await asyncio.to_thread(kill, mesh, "prefill")
            await wait_ready(mesh.base_url)
            history = await one("follow-up: RAM tier", history + tokens(new))
            await asyncio.to_thread(kill, mesh, "kvcache")
            await asyncio.to_thread(kill, mesh, "prefill")
            await wait_ready(mesh.base_url)
            history = await one("follow-up: SSD tier", history + tokens(new))
            # another branch off the first turn: its full blocks up to a point where no snapshot was taken,
            # so the rings come from the bounded replay
            cut = (len(shared) // block - 1) * block
            await one("branch: replay", shared[:cut] + tokens(new))
        turns = await asyncio.gather(*(complete(session, mesh.base_url, model, history + tokens(new),
                                                args.max_tokens) for _ in range(args.streams)))
        results[f"{args.streams} streams (follow-ups)"] = list(turns)
        log(f"{args.streams} streams: " + ", ".join(f"{t.decode_rate:.1f}" for t in turns) + " tok/s per stream")
    return results


TIMING_LINES = (" prompt tokens, ", ": stored ", ": prompt KV ", "captured ", "warmed up ", "loaded ")


def worker_timings(mesh: Mesh) -> list[str]:
    """The workers' own timing lines (prefill: restore / compute / store per prompt; decode: KV pull, first step
    and tokens per request; load and graph capture), in the order each worker logged them: where a path's TTFT
    goes."""
    lines = []
    for logfile in sorted((mesh.state_dir / "logs").glob("*.log")):
        if not logfile.name.startswith(("prefill", "decode")):
            continue
        for line in logfile.read_text(errors="replace").splitlines():
            if any(k in line for k in TIMING_LINES):
                parts = line.split(" ", 5)  # date, time, service, level, logger, message
                lines.append(f"{parts[1]} {logfile.stem}: {parts[5]}" if len(parts) == 6 else line.strip())
    return lines


def table(args: argparse.Namespace, results: dict[str, list[Turn]], model_dir: Path, wall: float) -> str:
    hw = platform.processor() or platform.machine()
    try:
        import torch

        if torch.cuda.is_available():
            hw = f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
    except ImportError:
        pass
    lines = [
        f"# Long, mostly cached prompts through the mesh ({datetime.date.today()})", "",
        f"Hardware: {hw}, {os.cpu_count()} CPUs. Model: `{model_dir.name}`. Prompt {args.prompt_tokens:,} tokens, "
        f"{args.cached:.0%} of each follow-up turn cached; {args.max_tokens} output tokens; {args.rounds} round(s); "
        f"wall {wall:.0f} s. Command: `python bench/long_context.py {' '.join(sys.argv[1:])}`", "",
        "| path | TTFT p50 (ms) | cached / prompt tokens | decode tok/s per stream |", "|---|---|---|---|",
    ]
    for name, turns in results.items():
        if name.startswith("warm-up"):
            continue
        ttft = statistics.median(t.ttft for t in turns) * 1e3
        rate = statistics.median(t.decode_rate for t in turns)
        cached = f"{turns[0].cached:,} / {turns[0].prompt:,}"
        lines.append(f"| {name} | {ttft:,.0f} | {cached} | {rate:.1f} |")
    lines += ["", "Targets (issue 12, 43 layers on one H200): follow-up turn <= 400 ms TTFT, cold 77K <= 6 s; "
              "DeepSeek reports 230 tok/s per stream."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a V4 checkpoint directory (else --build)")
    p.add_argument("--build", choices=("tiny", "flash"), default="tiny")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: write only --build's config.json; the workers draw random weights (no checkpoint)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "deepinfer-long-context")
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--cached", type=float, default=0.96)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take")
    p.add_argument("--up", nargs=argparse.REMAINDER, default=[], help="more `deepinfer up` flags (last)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    # the last turns: the first prompt, three follow-ups' new turns and four answers, then one more
    context = round(args.prompt_tokens * (1 + 4 * (1 - args.cached))) + 5 * args.max_tokens + 1024
    if args.model:
        model_dir = args.model
    elif args.load_format == "dummy":
        model_dir = write_config(args.work, args.build, args.layers, args.experts, max(context, 131072))
    elif args.build == "flash":
        log(f"building a V4-Flash-width checkpoint: {args.layers} layers, {args.experts} experts")
        model_dir = build_flash(args.work, args.layers, args.experts, max(context, 131072))
    else:
        model_dir = build_tiny(args.work)
    log(f"model {model_dir}")
    state = Path(tempfile.mkdtemp(prefix="long-context-", dir=args.work))
    dummy = ["--load-format", "dummy"] if args.load_format == "dummy" else []
    mesh = start_mesh(state, "--model", str(model_dir), "--max-model-len", str(context), *dummy, *args.up,
                      timeout=1200)
    started = time.monotonic()
    try:
        block = int(orjson.loads((model_dir / "config.json").read_text()).get("compress_rates", {})
                    .get("heavily_compressed_attention", 128))
        results = asyncio.run(drive(args, mesh, model_dir.name, block))
        timings = worker_timings(mesh)
    finally:
        mesh.stop()
    text = table(args, results, model_dir, time.monotonic() - started)
    text += "\n## The workers' timing lines\n\n```\n" + "\n".join(timings) + "\n```\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
