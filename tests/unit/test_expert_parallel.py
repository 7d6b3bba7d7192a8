"""Expert parallelism (shared/engine/parallel/): placements and their transfers as pure code, then the whole
thing in real processes, gloo on 127.0.0.1 with 2 and 4 ranks, against the single-process engine (tests/ep_ranks.py
says what every rank runs and why the tolerance is 1e-5, not bitwise)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from shared.engine.parallel.placement import Placement
from shared.schemas.experts import ExpertPlan
from tests import ep_ranks, v4_checkpoints
from tests.ep_ranks import E, replicated

# --- placements (pure) -------------------------------------------------------------------------------------------

def test_even_placement_and_tables() -> None:
    p = Placement.even(layers=2, experts=8, ranks=4)
    assert p.slots_per_rank == 2 and p.local(0, 3) == [6, 7]
    slots, replicas = p.table(1, torch.device("cpu"))
    assert slots.tolist() == [[e] for e in range(8)] and replicas.tolist() == [1] * 8
    with pytest.raises(ValueError, match="split evenly"):
        Placement.even(1, 6, 4)


def test_replica_table_pads_with_the_first_slot() -> None:
    p = replicated(1, 2)  # rank 0: [0 1 2 3 0], rank 1: [4 5 6 7 1]
    slots, replicas = p.table(0, torch.device("cpu"))
    assert slots[0].tolist() == [0, 4] and slots[1].tolist() == [1, 9] and slots[2].tolist() == [2, 2]
    assert replicas.tolist() == [2, 2, 1, 1, 1, 1, 1, 1]


def test_transfers_move_only_what_a_rank_lacks() -> None:
    old = Placement.even(1, 8, 2)
    moves = old.transfers(replicated(1, 2))
    # rank 0's extra slot replicates expert 0, which it holds: a local copy; rank 1's gets expert 1 from rank 0
    assert [(m.slot, m.expert, m.src, m.dst) for m in moves] == [(9, 1, 0, 1)]
    back = replicated(1, 2).transfers(old)
    assert back == []  # every rank still holds what the even split gives it


def test_a_bad_plan_is_refused() -> None:
    plan = ExpertPlan("g", "m", 1, 1, 4, 2, 2, [[0, 1, 2, 2]], 0, 1, 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="every one of 4"):
        Placement.from_plan(plan)
    good = dataclasses.replace(plan, physical=[[3, 1, 2, 0]])
    assert Placement.from_plan(good).local(0, 1) == [2, 0]
    with pytest.raises(ValueError, match="another shape"):
        Placement.even(2, 4, 2).transfers(Placement.from_plan(good))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v4-ep")
    v4_checkpoints.build(path, "mixed")
    return path


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> dict[str, torch.Tensor]:
    return ep_ranks.reference(checkpoint, "cpu")


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_one_process(world: int, checkpoint: Path, reference: dict[str, torch.Tensor],
                                            tmp_path: Path) -> None:
    ep_ranks.check(ep_ranks.run(world, checkpoint, tmp_path, "cpu"), reference, tol=1e-5)


def test_engine_spreads_its_experts_over_spawned_ranks(checkpoint: Path, reference: dict[str, torch.Tensor]) -> None:
    """Engine(expert_parallel=2): rank 0 is the engine, one spawned process holds half the experts; greedy
    generation equals the one-process engine's, before and after a plan moved experts between the ranks."""
    from shared.engine.engine import Engine, EngineRequest, run_to_completion
    from shared.schemas.generate import SamplingParams

    from shared.engine.memory import held_bytes

    engine = Engine(str(checkpoint), kv_blocks=32, expert_parallel=2)
    try:
        assert engine.model.expert_parallel.local[0].w13.shape[0] == 4  # rank 0 holds experts 0-3 alone
        whole, routed = reference["weights"].tolist()
        assert held_bytes(engine.model) == whole - routed // 2  # and never loaded the others

        def generate(tag: str) -> dict[str, list[int]]:
            requests = [EngineRequest(f"{rid}-{tag}", p, SamplingParams(temperature=0.0, max_tokens=ep_ranks.MAX_NEW,
                                                                        ignore_eos=True),
                                      max_new_tokens=ep_ranks.MAX_NEW) for rid, p in ep_ranks.prompts().items()]
            return {rid.split("-")[0]: t for rid, t in run_to_completion(engine, requests).items()}

        want = {rid: reference[f"tokens/{rid}"].tolist() for rid in "abc"}
        assert generate("before") == want
        new = ep_ranks.shuffled(4, 2)
        plan = ExpertPlan("w", "m", 2, 4, E, 2, 4, [list(row) for row in new.physical], 0, 4, 1.0, 1.0, 0.0)
        assert engine.apply_expert_plan(plan) > 0  # rank 0 received experts it lacked
        assert engine.model.expert_parallel.placement.version == 2
        assert generate("after") == want
        for bad in (dataclasses.replace(plan, ranks=4, slots_per_rank=2),  # another group's shape
                    dataclasses.replace(plan, layers=3, physical=plan.physical[:3])):
            with pytest.raises(ValueError, match="this group runs 8, 2, 4"):
                engine.apply_expert_plan(bad)
        assert generate("refused") == want  # the ranks never heard of them
    finally:
        engine.close()


def test_engine_refuses_experts_that_do_not_split(checkpoint: Path) -> None:
    from shared.engine.engine import Engine

    with pytest.raises(ValueError, match="split evenly"):
        Engine(str(checkpoint), kv_blocks=8, expert_parallel=3)


def test_a_dense_model_has_no_experts_to_spread() -> None:
    from shared.engine.engine import Engine

    with pytest.raises(ValueError, match="no routed experts"):
        Engine("SmolLM2-135M-Instruct", kv_blocks=8, expert_parallel=2)



def test_the_fused_kernel_computes_a_ranks_slots(checkpoint: Path) -> None:
    """The GPU path's compute (kernels/moe.py over the rank's own slot stack, local slot ids, weight 1), here
    under the Triton interpreter on a world of one in this process: slots shuffled and replicated, so a slot id
    is not the expert id."""
    pytest.importorskip("triton")
    from shared.engine.engine import Engine
    from shared.engine.models.deepseek_v4.moe import moe
    from shared.engine.parallel.ep_moe import ExpertParallel
    from shared.engine.parallel.group import Group, GroupConfig

    model = Engine(str(checkpoint), kv_blocks=8).model
    s = model.spec
    x, ids = ep_ranks.inputs(model)
    group = Group(GroupConfig(0, 1, "127.0.0.1", ep_ranks.free_port(), torch.device("cpu")))
    try:
        perm = ep_ranks.shuffled(s.num_layers, 1).physical
        placement = Placement(E, 1, E + 2, tuple(row + (row[0], row[3]) for row in perm))
        ep = ExpertParallel(group, placement, [la.experts for la in model.layers], s.swiglu_limit, torch.float32,
                            triton=True)
        for i, layer in enumerate(model.layers):
            torch.testing.assert_close(ep.moe(s, i, layer, x, ids), moe(s, layer, x, ids), atol=1e-5, rtol=1e-5)
    finally:
        group.close()
