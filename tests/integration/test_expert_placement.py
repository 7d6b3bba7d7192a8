"""Expert placement: what a tiny random DeepSeek-V4 counts equals a bincount of the experts transformers' reference
routers choose for the same tokens (hash-routed layers included); and over a real nats-server, a worker's engine
reports those counts in windows on experts.load, the balancer's experts role plans each worker group from them
and publishes on experts.plan, and the single-GPU worker logs and ignores its group's plan. A multi-rank group
(reported here by the test, as such a worker will) gets a real placement whose moves are counted from the
initial one."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from services.balancer.config import BalancerConfig
from services.balancer.experts.settings import ExpertsSettings
from services.balancer.service import BalancerService
from shared import subjects
from shared.bus import Envelope
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.schemas.experts import ExpertLoad, ExpertPlan
from shared.schemas.generate import SamplingParams
from shared.worker.expert_counts import ExpertCounts
from tests import v4_checkpoints
from tests.integration.buses import connect, until

MODEL = "tiny-v4"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("v4-eplb")
    return path, v4_checkpoints.build(path, "mixed")


@pytest.fixture(scope="module")
def checkpoint(built) -> Path:
    return built[0]


@torch.no_grad()
def reference_counts(reference, ids: list[int]) -> torch.Tensor:
    """(layers, experts): each reference router's chosen experts over `ids`, bincounted."""
    config = reference.config
    chosen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: chosen.append(out[2].flatten()))
             for layer in reference.model.layers]
    try:
        reference(torch.tensor([ids]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(chosen) == config.num_hidden_layers
    return torch.stack([torch.bincount(c, minlength=config.n_routed_experts) for c in chosen])


def test_counts_equal_a_bincount_of_the_reference_routers_choices(built) -> None:
    path, reference = built
    engine = Engine(str(path), kv_blocks=64, max_batch_tokens=16)  # three prefill chunks
    counts = engine.expert_counts()
    assert counts is not None and not counts.any()
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    request = EngineRequest("a", ids, SamplingParams(temperature=0.0, max_tokens=1), max_new_tokens=1)
    run_to_completion(engine, [request])  # the prompt's rows, and no decode step (one token, sampled from them)
    assert torch.equal(engine.expert_counts(), reference_counts(reference, ids))
    assert not counts.any()  # what was read is a copy, not the live buffer
    ex = engine.model.layers[0].experts
    assert engine.expert_bytes * engine.model.spec.num_experts == ex.w13.nbytes + ex.w2.nbytes


async def test_counts_reach_the_balancer_and_plans_come_back(nats_url: str, checkpoint: Path) -> None:
    settings = ExpertsSettings(experts_period_s=600.0, experts_min_gain=0.0)
    balancer = BalancerService(BalancerConfig(roles=("experts",), experts=settings))
    engine = AsyncEngine(Engine(str(checkpoint), kv_blocks=64, max_batch_tokens=16))
    worker = ExpertCounts(engine, "w1", "decode", MODEL, interval_s=0.2)
    balancer_bus, worker_bus, side = [await connect(nats_url, n) for n in ("balancer", "worker", "side")]
    loads: list[ExpertLoad] = []
    plans: dict[str, ExpertPlan] = {}

    async def on_load(load: ExpertLoad, _: Envelope) -> None:
        loads.append(load)

    async def on_plan(plan: ExpertPlan, _: Envelope) -> None:
        plans[plan.group] = plan

    await side.subscribe(subjects.EXPERT_LOAD, ExpertLoad, on_load)
    await side.subscribe(subjects.EXPERT_PLAN, ExpertPlan, on_plan)
    try:
        await balancer.start(balancer_bus)
        engine.start()
        await worker.start(worker_bus)
        request = EngineRequest("a", list(range(7, 47)), SamplingParams(temperature=0.0, max_tokens=6),
                                max_new_tokens=6)
        async for _ in engine.generate(request):
            pass
        routed = await engine.expert_counts()
        assert routed is not None and int(routed.sum()) > 0

        def reported() -> list[int]:
            return [sum(c) for c in zip(*(load.counts for load in loads if load.group == "w1"))]

        # the windows add up to everything the engine routed, expert by expert
        await until(lambda: reported() == routed.flatten().tolist(), 10.0, "the windows to cover the run")
        assert {(x.layers, x.experts, x.expert_bytes > 0) for x in loads} == {(4, 8, True)}

        # the balancer plans the single-GPU group at once (its first plan), and the worker ignores it
        await until(lambda: worker.stats["plans_ignored"] == 1, 10.0, "w1's plan to be ignored")
        assert plans["w1"].ranks == 1 and plans["w1"].physical == [list(range(8))] * 4
        health = worker.health()
        assert health["pairs"] == int(routed.sum()) and health["expert_skew_max"] >= health["expert_skew_mean"] >= 1

        # a group of 2 nodes x 2 GPUs with 4 redundant slots, loaded like the worker's run
        total = [sum(c) for c in zip(*(load.counts for load in loads))]
        g4 = ExpertLoad(worker_id="m", role="decode", model=MODEL, group="g4", layers=4, experts=8, counts=total,
                        window_s=1.0, sent_at=0.0, nodes=2, ranks_per_node=2, redundant_slots=4, expert_bytes=1000)
        await side.publish(subjects.EXPERT_LOAD, g4)
        await until(lambda: "g4" in plans, 10.0, "g4's plan")
        plan = plans["g4"]
        assert (plan.version, plan.ranks, plan.slots_per_rank) == (1, 4, 3)
        assert plan.imbalance_after <= plan.imbalance_before
        start = [e % 8 for e in range(12)]  # the initial placement, expert e in slot e, then copies of 0..3
        copies = 0
        for layer in plan.physical:
            assert set(layer) == set(range(8))
            for r in range(4):
                copies += sum((Counter(layer[3 * r : 3 * r + 3]) - Counter(start[3 * r : 3 * r + 3])).values())
        assert plan.moved_bytes == copies * 1000
        ok, detail = balancer.health()
        assert ok and json.loads(detail)["experts_plans"] == 2
    finally:
        await worker.stop()
        await engine.stop()
        await balancer.stop()
        for bus in (balancer_bus, worker_bus, side):
            await bus.drain()


async def test_an_expert_parallel_worker_applies_its_plans(nats_url: str, checkpoint: Path) -> None:
    """A worker over 2 ranks (Engine(expert_parallel=2): one spawned gloo process) reports its group as 2 GPUs,
    gets a plan from the balancer, applies it between two steps, reports its version, and generates the same
    tokens under it as before."""
    settings = ExpertsSettings(experts_period_s=600.0, experts_min_gain=0.0)
    balancer = BalancerService(BalancerConfig(roles=("experts",), experts=settings))
    engine = AsyncEngine(Engine(str(checkpoint), kv_blocks=64, max_batch_tokens=16, expert_parallel=2))
    worker = ExpertCounts(engine, "w2", "decode", MODEL, interval_s=0.2)
    balancer_bus, worker_bus, side = [await connect(nats_url, n) for n in ("balancer", "worker", "side")]
    loads: list[ExpertLoad] = []
    plans: list[ExpertPlan] = []

    async def on_load(load: ExpertLoad, _: Envelope) -> None:
        loads.append(load)

    async def on_plan(plan: ExpertPlan, _: Envelope) -> None:
        plans.append(plan)

    async def generate(rid: str) -> list[int]:
        request = EngineRequest(rid, list(range(7, 47)), SamplingParams(temperature=0.0, max_tokens=6,
                                                                        ignore_eos=True), max_new_tokens=6)
        return [t for out in [o async for o in engine.generate(request)] for t in out.token_ids]

    await side.subscribe(subjects.EXPERT_LOAD, ExpertLoad, on_load)
    await side.subscribe(subjects.EXPERT_PLAN, ExpertPlan, on_plan)
    try:
        await balancer.start(balancer_bus)
        engine.start()
        await worker.start(worker_bus)
        before = await generate("a")
        await until(lambda: worker.stats["plans_applied"] == 1, 20.0, "w2's plan to be applied")
        plan = plans[0]
        assert (plan.group, plan.version, plan.ranks, plan.slots_per_rank) == ("w2", 1, 2, 4)
        ep = engine.engine.model.expert_parallel
        assert ep.placement.physical == tuple(tuple(row) for row in plan.physical)
        assert (await generate("b")) == before
        await until(lambda: any(x.plan_version == 1 for x in loads), 10.0, "a window under plan 1")
        assert {(x.ranks_per_node, x.nodes) for x in loads} == {(2, 1)}
        assert worker.stats["plans_ignored"] == 0
    finally:
        await worker.stop()
        await engine.stop()
        await balancer.stop()
        for bus in (balancer_bus, worker_bus, side):
            await bus.drain()
