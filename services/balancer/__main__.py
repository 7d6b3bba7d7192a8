"""`python -m services.balancer [--roles prefill,decode[,experts]] [--worker-timeout S] [--route-wait S]
[--prefill-policy least-cost|round-robin|random] [--decode-policy affinity|most-free-blocks] [weights...]`"""

from __future__ import annotations

import argparse

from services.balancer.config import add_args, balancer_config
from services.balancer.service import BalancerService
from shared.config import ServiceConfig
from shared.service import main


def build(_: ServiceConfig, args: argparse.Namespace) -> BalancerService:
    return BalancerService(balancer_config(args))


if __name__ == "__main__":
    main("balancer", build, add_args)
