"""The `deepinfer` console script: `deepinfer up` (the whole mesh) and `deepinfer generate` (offline engine)."""

from __future__ import annotations

import sys

USAGE = """usage: deepinfer {up,generate} [options]

  up        start nats-server and every service, serve the API on 127.0.0.1:8000
  generate  run the engine in this process (no mesh) and print the generated text

`deepinfer COMMAND --help` for the options of each."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "up":
        from shared.launcher import main as up

        return up(rest)
    if command == "generate":
        from shared.cli_generate import main as generate

        return generate(rest)
    print(f"deepinfer: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
