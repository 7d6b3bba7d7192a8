"""`python -m services.balancer [--roles prefill,decode] [--worker-timeout S] [--route-wait S]`"""

from __future__ import annotations

import argparse

from services.balancer.roles import ROLES
from services.balancer.service import BalancerService
from shared.config import ServiceConfig
from shared.service import main


def roles(text: str) -> list[str]:
    names = [r.strip() for r in text.split(",") if r.strip()]
    if not names or any(r not in ROLES for r in names):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(ROLES)}, got {text!r}")
    return names


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--roles", type=roles, default="prefill,decode", help=f"comma-separated, of {','.join(ROLES)}")
    parser.add_argument(
        "--worker-timeout", type=float, default=3.0, help="s without a heartbeat before a worker leaves the pool"
    )
    parser.add_argument("--route-wait", type=float, default=30.0, help="s a job waits for a worker before failing")
    parser.add_argument("--concurrency", type=int, default=16, help="jobs routed at once per role")


def build(_: ServiceConfig, args: argparse.Namespace) -> BalancerService:
    return BalancerService(
        args.roles, worker_timeout_s=args.worker_timeout, route_wait_s=args.route_wait, concurrency=args.concurrency
    )


if __name__ == "__main__":
    main("balancer", build, add_args)
