"""`python -m services.balancer [--roles prefill,decode] [--worker-timeout S] [--route-wait S]
[--prefill-policy least-cost|round-robin|random] [--decode-policy affinity|most-free-blocks] [weights...]`"""

from __future__ import annotations

import argparse

from services.balancer.policies import POLICIES, PolicySettings
from services.balancer.roles import ROLES
from services.balancer.service import BalancerService
from shared.config import ServiceConfig
from shared.service import main

DEFAULTS = PolicySettings()


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
    policy = parser.add_argument_group("placement (see services/balancer/policies/)")
    policy.add_argument("--prefill-policy", choices=sorted(POLICIES), default=None, help="default: least-cost")
    policy.add_argument("--decode-policy", choices=sorted(POLICIES), default=None, help="default: affinity")
    policy.add_argument("--overlap-weight", type=float, default=DEFAULTS.overlap_weight,
                        help="worth of a cached prompt token against a queued one (0 ignores caches)")
    policy.add_argument("--ram-weight", type=float, default=DEFAULTS.ram_weight,
                        help="cost of loading a block from the store's RAM tier, as a fraction of computing it")
    policy.add_argument("--lmdb-weight", type=float, default=DEFAULTS.lmdb_weight, help="the same, LMDB tier")
    policy.add_argument("--ssd-weight", type=float, default=DEFAULTS.ssd_weight, help="the same, SSD tier")
    policy.add_argument("--seed", type=int, default=None, help="seed of the random policy")
    policy.add_argument("--affinity-ttl", type=float, default=300.0,
                        help="s a finished turn's decode worker is remembered for the next turn")


def build(_: ServiceConfig, args: argparse.Namespace) -> BalancerService:
    chosen = {"prefill": args.prefill_policy, "decode": args.decode_policy}
    settings = PolicySettings(args.overlap_weight, args.ram_weight, args.lmdb_weight, args.ssd_weight, args.seed)
    return BalancerService(
        args.roles,
        worker_timeout_s=args.worker_timeout,
        route_wait_s=args.route_wait,
        concurrency=args.concurrency,
        policies={role: name for role, name in chosen.items() if name},
        policy_settings=settings,
        affinity_ttl_s=args.affinity_ttl,
    )


if __name__ == "__main__":
    main("balancer", build, add_args)
