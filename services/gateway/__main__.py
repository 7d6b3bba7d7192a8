import argparse

from services.gateway.config import add_args, gateway_config
from services.gateway.service import GatewayService, served_models
from shared.config import ServiceConfig
from shared.service import main


def build(config: ServiceConfig, args: argparse.Namespace) -> GatewayService:
    return GatewayService(gateway_config(args), served_models(config.model))


if __name__ == "__main__":
    main("gateway", build, add_args)
