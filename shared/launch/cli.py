"""The `deepinfer` console script: `deepinfer up` / `deepinfer serve MODEL` (the whole mesh) and
`deepinfer generate` (offline engine). Each subcommand imports only what it needs, so `--help` answers at once."""

from __future__ import annotations

import sys

from shared.version import VERSION

USAGE = """usage: deepinfer [--version] {up,serve,generate} [options]

  up              start nats-server and every service, serve the API on 127.0.0.1:8000
  serve [MODEL]   the same, vLLM's spelling: the model as an argument (`deepinfer serve ./my-model --port 8080`)
  generate        run the engine in this process (no mesh) and print the generated text

`deepinfer COMMAND --help` for the options of each (every option of up/serve also reads DEEPINFER_<OPTION>)."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"deepinfer {VERSION}")
        return 0
    command, rest = argv[0], argv[1:]
    if command in ("up", "serve"):
        from shared.launch.cli_up import parse

        args = parse(rest, f"deepinfer {command}", positional_model=command == "serve")  # --help: no bus import
        from shared.launch.launcher import run

        return run(args)
    if command == "generate":
        from shared.worker.generate import main as generate

        return generate(rest)
    print(f"deepinfer: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
