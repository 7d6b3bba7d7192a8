"""Settings records and their flags (shared/config.py): a field is written once, with its default, type and help;
argparse, the environment and `deepinfer up` all read it from there."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.balancer.config import BalancerConfig, balancer_config
from services.balancer.config import add_args as add_balancer_args
from services.balancer.policies import PolicySettings
from services.gateway.config import GatewayConfig, gateway_config
from services.gateway.config import add_args as add_gateway_args
from services.kvcache import config as kvcache_config
from services.recipe.config import RecipeConfig, recipe_config
from services.recipe.config import add_args as add_recipe_args
from shared.config import ServiceConfig, add_common_args, add_flags, common_config, from_args, nested, option
from shared.launch import cli_up
from shared.worker.config import KV_TRANSPORTS, WorkerConfig, add_worker_args, worker_config


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("DEEPINFER_")]:
        monkeypatch.delenv(key)


@dataclass(frozen=True)
class Inner:
    weight: float = option(0.5, help="a weight")


@dataclass(frozen=True)
class Sample:
    wait_s: float = option(2.0, help="seconds")  # --wait: the unit suffix is not part of the flag
    count: int | None = option(None, flag="--count", aliases=("--num",), env=True)
    name: str = option("x", env="SAMPLE_NAME", choices=("x", "y"))
    loud: bool = option(False, env=True)
    path: Path = option(Path("p"), convert=Path)
    inner: Inner = nested(Inner, "inner things")
    hidden: int = 7  # not a flag


def parse(cls: type, argv: list[str], **defaults: object) -> object:
    parser = argparse.ArgumentParser()
    add_flags(parser, cls, **defaults)
    return from_args(cls, parser.parse_args(argv))


def test_a_record_parses_from_its_own_defaults_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse(Sample, []) == Sample()
    parsed = parse(Sample, ["--wait", "3", "--num", "4", "--name", "y", "--loud", "--path", "q", "--weight", "1"])
    assert parsed == Sample(3.0, 4, "y", True, Path("q"), Inner(1.0))
    assert parse(Sample, [], wait_s=9.0) == Sample(wait_s=9.0)  # a default given by the caller (e.g. per service)
    monkeypatch.setenv("DEEPINFER_COUNT", "12")  # env=True: DEEPINFER_<FLAG>, parsed by the flag's type
    monkeypatch.setenv("SAMPLE_NAME", "y")  # env="...": that variable
    monkeypatch.setenv("DEEPINFER_LOUD", "true")
    assert parse(Sample, []) == Sample(count=12, name="y", loud=True)
    assert parse(Sample, ["--count", "1"]) == Sample(count=1, name="y", loud=True)  # the command line wins
    monkeypatch.setenv("DEEPINFER_COUNT", "")  # empty = unset
    monkeypatch.setenv("DEEPINFER_LOUD", "0")
    assert parse(Sample, []) == Sample(name="y")
    monkeypatch.setenv("DEEPINFER_COUNT", "many")
    with pytest.raises(SystemExit):  # argparse names the flag, as for a bad value typed
        parse(Sample, [])
    parser = argparse.ArgumentParser()
    add_flags(parser, Sample)
    assert [g.title for g in parser._action_groups][-1] == "inner things"


def test_each_service_parses_to_its_records_defaults(tmp_path: Path) -> None:
    def parser(add: object) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser()
        add_common_args(p, "svc")
        add(p)  # type: ignore[operator]
        return p

    args = parser(add_gateway_args).parse_args([])
    assert gateway_config(args) == GatewayConfig()
    assert common_config(args) == ServiceConfig(instance=args.instance)
    assert args.instance.startswith("svc-")
    assert balancer_config(parser(add_balancer_args).parse_args([])) == BalancerConfig()
    assert recipe_config(parser(add_recipe_args).parse_args([])) == RecipeConfig()
    kv = parser(kvcache_config.add_args).parse_args(["--state-dir", str(tmp_path)])
    assert kvcache_config.from_args(common_config(kv), kv) == kvcache_config.KvCacheConfig(
        tmp_path / "kvcache", instance=kv.instance)
    assert worker_config(parser(add_worker_args).parse_args(["--device", "cpu"])) == WorkerConfig("cpu")
    balancer = parser(add_balancer_args).parse_args(["--roles", "decode", "--decode-policy", "most-free-blocks",
                                                     "--ssd-weight", "0.5", "--seed", "3"])
    assert balancer_config(balancer) == BalancerConfig(("decode",), decode_policy="most-free-blocks",
                                                       policy=PolicySettings(ssd_weight=0.5, seed=3))


def test_up_takes_its_defaults_from_the_service_records() -> None:
    args = cli_up.parse([])
    gateway, recipe = GatewayConfig(), RecipeConfig()
    assert (args.host, args.port) == (gateway.host, gateway.port)
    assert (args.client_idle_timeout, args.client_header_timeout, args.client_body_timeout) == (
        gateway.client_idle_timeout_s, gateway.client_header_timeout_s, gateway.client_body_timeout_s)
    assert (args.max_queued_requests, args.max_queued_tokens) == (recipe.max_queued_requests, recipe.max_queued_tokens)
    worker = WorkerConfig("cpu")
    assert (args.max_num_seqs, args.speculative_tokens) == (worker.max_running, worker.speculative_tokens)
    common = ServiceConfig()
    assert (args.model, Path(args.state_dir), args.log_format) == (common.model, common.state_dir, common.log_format)


def test_the_kv_transports_in_help_are_the_registered_ones() -> None:
    from shared.worker.kvclient import TRANSPORTS

    assert KV_TRANSPORTS.split(" | ") == list(TRANSPORTS)


def test_bad_records_are_refused() -> None:
    with pytest.raises(ValueError, match="--response-ttl must be positive"):
        RecipeConfig(response_ttl_s=0)
    with pytest.raises(ValueError, match="admission limits"):
        RecipeConfig(max_queued_tokens=-1)
    with pytest.raises(ValueError, match="timeouts, delays and concurrency"):
        BalancerConfig(concurrency=0)
    with pytest.raises(ValueError, match="--kv-transport"):
        WorkerConfig("cpu", kv_transport="carrier-pigeon")
