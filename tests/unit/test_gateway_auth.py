"""API keys: where they are read from and how they become a tenant; the gateway's flags."""

from __future__ import annotations

import argparse
import pytest

from services.gateway.auth import authorized, presented_key, tenant_of
from services.gateway.config import GatewayConfig, add_args, gateway_config


def test_presented_key_from_either_header() -> None:
    assert presented_key({"Authorization": "Bearer sk-1"}) == "sk-1"
    assert presented_key({"Authorization": "bearer  sk-1 "}) == "sk-1"
    assert presented_key({"x-api-key": "ak-2"}) == "ak-2"
    assert presented_key({"Authorization": "Basic abc", "x-api-key": "ak-2"}) == "ak-2"
    assert presented_key({}) == ""


def test_tenant_is_a_hash_never_the_key() -> None:
    assert tenant_of("") == ""
    tenant = tenant_of("sk-secret")
    assert "sk-secret" not in tenant and len(tenant) == 32
    assert tenant == tenant_of("sk-secret") != tenant_of("sk-other")


def test_authorized() -> None:
    assert authorized("", None) and authorized("anything", None)
    assert authorized("k", "k")
    assert not authorized("", "k") and not authorized("K", "k")


def test_config_from_args_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    add_args(parser)
    config = gateway_config(parser.parse_args(["--port", "0", "--event-timeout", "5"]))
    assert config == GatewayConfig(port=0, api_key="from-env", event_timeout_s=5.0)
    with pytest.raises(ValueError):
        GatewayConfig(port=70000)
    with pytest.raises(ValueError):
        GatewayConfig(api_key="")
    with pytest.raises(ValueError):
        GatewayConfig(event_timeout_s=0)
