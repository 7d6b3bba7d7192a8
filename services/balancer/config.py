"""Balancer settings, built once from CLI flags (the fields are the flags: shared/config.py `option`); the fields
without a flag are for tests and embedders."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.balancer.experts.role import EXPERTS
from services.balancer.experts.settings import ExpertsSettings
from services.balancer.policies import POLICIES, PolicySettings
from services.balancer.roles import ROLES
from shared.config import add_flags, from_args, nested, option

PLACEMENT = "placement (see services/balancer/policies/)"  # the --help section of the placement flags
EXPERT_PLACEMENT = "expert placement (see services/balancer/experts/)"
ROLE_NAMES = (*ROLES, EXPERTS)  # the routing roles, and expert placement (which routes no jobs: experts/role.py)


def roles(text: str) -> list[str]:
    names = [r.strip() for r in text.split(",") if r.strip()]
    if not names or any(r not in ROLE_NAMES for r in names):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(ROLE_NAMES)}, got {text!r}")
    return names


@dataclass(frozen=True)
class BalancerConfig:
    roles: tuple[str, ...] = option(
        ("prefill", "decode"), parse=roles, convert=tuple, help=f"comma-separated, of {','.join(ROLE_NAMES)}")
    worker_timeout_s: float = option(3.0, help="s without a heartbeat before a worker leaves the pool")
    route_wait_s: float = option(30.0, help="s a job waits for a worker before failing")
    concurrency: int = option(16, help="jobs routed at once per role")
    # a role's policy by name (POLICIES); None: the role's default (roles.py)
    prefill_policy: str | None = option(None, choices=sorted(POLICIES), group=PLACEMENT, help="default: least-cost")
    decode_policy: str | None = option(None, choices=sorted(POLICIES), group=PLACEMENT, help="default: affinity")
    policy: PolicySettings = nested(PolicySettings, PLACEMENT)
    affinity_ttl_s: float = option(
        300.0, group=PLACEMENT, help="s a finished turn's decode worker is remembered for the next turn")
    experts: ExpertsSettings = nested(ExpertsSettings, EXPERT_PLACEMENT)  # the experts role's
    retry_delay_s: float = 0.5  # a job with no worker now is nak'ed with this delay
    max_reroutes: int = 2  # a prefill job moved off lost workers this often, then failed
    assignment_ttl_s: float | None = None  # None: each role's own (roles.py)

    def __post_init__(self) -> None:
        unknown = [r for r in self.roles if r not in ROLE_NAMES]
        if unknown or not self.roles:
            raise ValueError(f"roles must be some of {sorted(ROLE_NAMES)}, got {list(self.roles)}")
        if self.worker_timeout_s <= 0 or self.route_wait_s < 0 or self.retry_delay_s <= 0 or self.concurrency < 1:
            raise ValueError("timeouts, delays and concurrency must be positive")
        if any(p not in POLICIES for p in self.policies().values()):
            raise ValueError(f"policies must be some of {sorted(POLICIES)}, got {self.policies()}")

    def policies(self) -> dict[str, str]:
        """role -> the policy chosen for it by flag (the roles not named keep their default)."""
        chosen = {"prefill": self.prefill_policy, "decode": self.decode_policy}
        return {role: name for role, name in chosen.items() if name}


def add_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, BalancerConfig)


def balancer_config(args: argparse.Namespace) -> BalancerConfig:
    return from_args(BalancerConfig, args)
