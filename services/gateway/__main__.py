import argparse

from services.gateway.config import add_args, gateway_config
from services.gateway.service import GatewayService, served_models
from shared.config import ServiceConfig
from shared.service import main


def build(config: ServiceConfig, args: argparse.Namespace) -> GatewayService:
    models = list(config.served_model_names) or served_models(config.model)
    return GatewayService(gateway_config(args), models)


if __name__ == "__main__":
    main("gateway", build, add_args)
