"""The flags of `deepinfer up` and `deepinfer serve MODEL` (vLLM's spelling of the same thing).

Every flag has an environment default, DEEPINFER_<FLAG> (`--max-model-len` <- DEEPINFER_MAX_MODEL_LEN); a flag
on the command line wins. `python -m shared.launch.cli_up` prints the table of them (the README's).
The defaults that are also a service's come from that service's settings record (`default_of`: GatewayConfig,
RecipeConfig, WorkerConfig, ServiceConfig), so no default is written twice. Torch-free, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import os
import sys

from services.gateway.config import GatewayConfig
from services.recipe.config import RecipeConfig
from shared.config import DEFAULT_MAX_BATCH_TOKENS, ENV_PREFIX, GPU_BATCH_TOKENS, TRUE, HelpFormatter, ServiceConfig
from shared.config import default_of, model_names
from shared.nats_urls import server_urls
from shared.logs import LOG_FORMATS
from shared.worker.config import (KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS, SPECULATIVE_METHODS,
                                  SPECULATIVE_POLICIES, WorkerConfig)

DEVICE_SHARE = 0.9  # of one GPU, what its workers fill together by default; the rest: CUDA contexts, graphs


def env_name(action: argparse.Action) -> str:
    return ENV_PREFIX + action.dest.upper()


def parser(prog: str = "deepinfer up", *, positional_model: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run the whole mesh on this machine: nats-server and every service, the API on --host:--port. "
        "Every flag also reads an environment default, DEEPINFER_<FLAG> (e.g. DEEPINFER_PORT).",
        formatter_class=HelpFormatter,
    )
    if positional_model:
        p.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                       help="packaged model name, .gguf file or HF checkpoint dir (the same as --model)")
    api = p.add_argument_group("API")
    api.add_argument("--host", default=default_of(GatewayConfig, "host"), help="the gateway's address")
    api.add_argument("--port", type=int, default=default_of(GatewayConfig, "port"), help="the gateway's port")
    api.add_argument("--api-key", default=None, help="require this key from clients (Bearer or x-api-key)")
    api.add_argument("--client-idle-timeout", type=float, default=default_of(GatewayConfig, "client_idle_timeout_s"),
                     help="seconds a client connection may stay open with no request; then it is closed")
    api.add_argument("--client-header-timeout", type=float,
                     default=default_of(GatewayConfig, "client_header_timeout_s"),
                     help="seconds from a request's first byte to its last header; then the connection is closed")
    api.add_argument("--client-body-timeout", type=float, default=default_of(GatewayConfig, "client_body_timeout_s"),
                     help="seconds to read a request's whole body; then a 408 in the API's error JSON")
    model = p.add_argument_group("model")
    model.add_argument("--model", default=default_of(ServiceConfig, "model"),
                       help="packaged model name, .gguf file or HF checkpoint dir")
    model.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the name(s) clients use (the first in replies; env: comma-separated); default: the "
                            "model's own")
    model.add_argument("--max-model-len", type=int, default=None,
                       help="prompt + completion tokens a request may use; default: the model's context length")
    workers = p.add_argument_group("workers (prefill and decode)")
    workers.add_argument("--device", default=None, help="engine device; default: cuda when available, else cpu")
    workers.add_argument("--prefill-workers", type=int, default=1, help="prefill worker processes")
    workers.add_argument("--decode-workers", type=int, default=1, help="decode worker processes")
    workers.add_argument("--gpu-memory-utilization", type=float, default=None,
                         help="share of the GPU's total memory each worker may fill: weights, activations and KV "
                              f"pool (as vLLM's); default: {DEVICE_SHARE} split between the workers, which share one "
                              f"device ({DEVICE_SHARE / 2} each for one prefill and one decode worker)")
    workers.add_argument("--kv-blocks", type=int, default=None,
                         help="KV pool size in blocks per worker (overrides --gpu-memory-utilization); "
                              "default: from memory (1 GiB on a CPU)")
    workers.add_argument("--kv-arena-mib", type=int, default=None,
                         help="MiB of shared memory (/dev/shm) per worker arena: the KV store's and a prefill "
                              "worker's same-host hand-overs to decode (a prompt's KV larger goes over NATS); "
                              f"default: {default_of(WorkerConfig, 'kv_arena_mib')}")
    workers.add_argument("--max-num-seqs", "--max-running", dest="max_num_seqs", type=int,
                         default=default_of(WorkerConfig, "max_running"), help="requests a worker holds at once")
    workers.add_argument("--max-num-batched-tokens", "--max-batch-tokens", dest="max_num_batched_tokens", type=int,
                         default=None, help="tokens per engine step (chunked prefill); default: "
                         f"{DEFAULT_MAX_BATCH_TOKENS} on a CPU, on a GPU {GPU_BATCH_TOKENS['prefill']} for a prefill worker "
                         f"and {GPU_BATCH_TOKENS['decode']} for decode")
    workers.add_argument("--enforce-eager", action="store_true", default=default_of(WorkerConfig, "enforce_eager"),
                         help="never replay decode steps from CUDA graphs (vLLM's spelling); slower, for debugging")
    workers.add_argument("--deterministic", action="store_true", default=default_of(WorkerConfig, "deterministic"),
                         help="batch-invariant kernels on the GPU: a migrated request continues token-identically "
                              "in bf16 (Llama-family models; costs throughput: bench/deterministic.py)")
    workers.add_argument("--speculative-tokens", type=int, default=default_of(WorkerConfig, "speculative_tokens"),
                         help="most drafts verified per decode step (0 = off)")
    workers.add_argument("--speculative-method", choices=SPECULATIVE_METHODS,
                         default=default_of(WorkerConfig, "speculative_method"),
                         help="who drafts: mtp (the model's MTP layer) | ngram (prompt lookup, any model)")
    workers.add_argument("--speculative-policy", choices=SPECULATIVE_POLICIES,
                         default=default_of(WorkerConfig, "speculative_policy"),
                         help="drafts verified per request and step: fixed | adaptive")
    workers.add_argument("--quantization", choices=QUANTIZATIONS, default=default_of(WorkerConfig, "quantization"),
                         help="a quantized checkpoint's weights: auto (as shipped on a GPU: DeepSeek-V4's FP8 / FP4) "
                              "| bf16 (dequantized)")
    workers.add_argument("--load-format", choices=LOAD_FORMATS, default=default_of(WorkerConfig, "load_format"),
                         help="where the weights come from: auto (the checkpoint's files) | dummy (random weights "
                              "drawn on the device from config.json alone, the same in every worker: benchmarks of "
                              "models whose checkpoint is not on disk; DeepSeek-V4 and Llama directories)")
    workers.add_argument("--expert-parallel", "--expert-parallel-size", dest="expert_parallel", type=int,
                         default=default_of(WorkerConfig, "expert_parallel"),
                         help="ranks each DeepSeek-V4 worker spreads its routed experts over (processes it spawns: "
                              "gloo on a CPU, the next GPUs on CUDA); 1 = off")
    workers.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                         default=default_of(WorkerConfig, "kv_cache_dtype"),
                         help="KV cache storage: auto (the model's dtype) | bf16 | fp8 (e4m3 with scales: about twice "
                              "the tokens of context; DeepSeek-V4, Llama on the torch kernels)")
    load = p.add_argument_group("admission (the recipe refuses past these with a 429 and Retry-After)")
    load.add_argument("--max-queued-requests", type=int, default=default_of(RecipeConfig, "max_queued_requests"),
                      help="requests in flight per model (waiting or running) before new ones get a 429; 0 = unbounded")
    load.add_argument("--max-queued-tokens", type=int, default=default_of(RecipeConfig, "max_queued_tokens"),
                      help="prompt tokens in flight per model before new requests get a 429; 0 = unbounded")
    load.add_argument("--max-migrations", type=int, default=default_of(RecipeConfig, "max_migrations"),
                      help="times one request may resume on another worker after losing its worker (an exact "
                           "continuation from the tokens it streamed); then a 503. 0 = never")
    run = p.add_argument_group("running")
    run.add_argument("--state-dir", default=str(default_of(ServiceConfig, "state_dir")),
                     help="NATS, KV store and logs live here (one `up` at a time)")
    run.add_argument("--nats-url", default=None,
                     help="use this NATS server instead of starting one; several, comma-separated, for the members "
                          "of a NATS cluster (the services move to another when one fails)")
    run.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every service")
    run.add_argument("--log-format", choices=LOG_FORMATS, default=default_of(ServiceConfig, "log_format"),
                     help="the services' logs: text, or one JSON object per line")
    _env_defaults(p)
    return p


def _env_defaults(p: argparse.ArgumentParser) -> None:
    """A DEEPINFER_<FLAG> variable replaces the flag's default (argparse converts a string default with the flag's
    type, so DEEPINFER_PORT=9000 reads as the int 9000)."""
    for action in flag_actions(p):
        value = os.environ.get(env_name(action))
        if value is None or value == "":
            continue
        if isinstance(action, argparse._StoreTrueAction):  # a switch: "0" / "false" must not read as set
            value = value.lower() in TRUE
        action.default = value


def flag_actions(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.option_strings and a.dest != "help"]


def parse(argv: list[str] | None, prog: str = "deepinfer up", *, positional_model: bool = False
          ) -> argparse.Namespace:
    p = parser(prog, positional_model=positional_model)
    _check_environment(p)
    args = p.parse_args(argv)
    if getattr(args, "model_arg", None):
        args.model = args.model_arg
    try:
        args.served_model_name = list(model_names(args.served_model_name))
        _check_values(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def _check_environment(p: argparse.ArgumentParser) -> None:
    """A bad variable is named as such, not as a bad flag the user never typed."""
    for action in flag_actions(p):
        name, value = env_name(action), os.environ.get(env_name(action))
        if not value:
            continue
        if action.type is not None:
            try:
                action.type(value)
            except ValueError:
                p.error(f"{name}={value!r} is not a valid {action.option_strings[0]} value")
        if action.choices is not None and value not in action.choices:
            p.error(f"{name}={value!r}: {action.option_strings[0]} takes one of {', '.join(action.choices)}")


def _check_values(args: argparse.Namespace) -> None:
    lowest = {"--port": (args.port, 0), "--prefill-workers": (args.prefill_workers, 1),
              "--decode-workers": (args.decode_workers, 1), "--max-num-seqs": (args.max_num_seqs, 1),
              "--max-num-batched-tokens": (args.max_num_batched_tokens, 1),
              "--speculative-tokens": (args.speculative_tokens, 0), "--max-model-len": (args.max_model_len, 2),
              "--kv-blocks": (args.kv_blocks, 1),
              "--expert-parallel": (args.expert_parallel, 1), "--kv-arena-mib": (args.kv_arena_mib, 1),
              "--max-queued-requests": (args.max_queued_requests, 0),
              "--max-queued-tokens": (args.max_queued_tokens, 0), "--max-migrations": (args.max_migrations, 0)}
    for flag, (value, low) in lowest.items():
        if value is not None and value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    for flag in ("--client-idle-timeout", "--client-header-timeout", "--client-body-timeout"):
        if (value := getattr(args, flag[2:].replace("-", "_"))) <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    if args.nats_url is not None:
        server_urls(args.nats_url)
    if args.port > 65535:
        raise ValueError(f"--port must be at most 65535, got {args.port}")
    share, workers = args.gpu_memory_utilization, args.prefill_workers + args.decode_workers
    if share is not None and not 0 < share <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {share}")
    if share is not None and share * workers > 1 and on_gpu(args):
        raise ValueError(f"--gpu-memory-utilization {share} for each of {workers} workers on one GPU is "
                         f"{share * workers:g} of its memory; give each at most {1 / workers:.2f}")


def on_gpu(args: argparse.Namespace) -> bool:
    """The workers may run on a GPU (unset --device means cuda where there is one); all share that one device."""
    return args.device is None or args.device.startswith("cuda")


def worker_share(args: argparse.Namespace) -> float | None:
    """Each worker's --gpu-memory-utilization: the one given, else DEVICE_SHARE split evenly between the workers
    (they all run on the one device --device names); None on a CPU."""
    if not on_gpu(args):
        return None
    if args.gpu_memory_utilization is not None:
        return args.gpu_memory_utilization
    return round(DEVICE_SHARE / (args.prefill_workers + args.decode_workers), 4)


def env_table() -> str:
    """The flags and their variables as a Markdown table (defaults as written, before any environment)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    for key in saved:
        del os.environ[key]
    try:
        actions = flag_actions(parser())
    finally:
        os.environ.update(saved)
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for a in actions:
        default = "" if a.default is None else f"`{a.default}`"
        meaning = (a.help or "").replace("%%", "%").replace("|", "\\|")
        rows.append(f"| `{'`, `'.join(a.option_strings)}` | `{env_name(a)}` | {default} | {meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(env_table())
    sys.exit(0)
