"""Is it up: the launcher's (and tests') health probe of every service, on `health.<service>.<instance>`, and the
presence that the services which are not workers announce to the gateway, on `services.presence` (workers say
it with their heartbeats: workers.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Presence:
    """A service that is not a worker saying it is up, on `services.presence` every second (shared/presence.py):
    the gateway's readiness (/health) needs a recipe for each model it serves, and a balancer."""

    service: str  # "recipe" | "balancer"
    instance: str
    models: list[str] = field(default_factory=list)  # the models it serves ([] for the balancer: any)
    sent_at: float = 0.0
    # a served name that is an alias (--served-model-name) -> the name the workers serve the model under
    aliases: dict[str, str] = field(default_factory=dict)
    boot: str = ""  # this process (random, per start): one restarted under the same instance name is another


@dataclass(frozen=True)
class HealthRequest:
    pass


@dataclass(frozen=True)
class HealthReply:
    service: str
    instance: str
    ready: bool
    detail: str = ""
