"""Expert parallelism (shared/engine/parallel/) in real processes: gloo on 127.0.0.1, 2 and 4 ranks, a tiny random
DeepSeek-V4 checkpoint (4 layers, one hash-routed, 8 experts, top 2, a shared expert), fp32.

One spawn per world size runs every case; each rank writes its results and the parent compares them with the
single-process engine: every MoE layer's output for the rank's rows (even routing; routing skewed onto rank 0's
experts so other ranks get no pairs, and a rank with no rows at all; hot experts replicated; after new placements
were applied by moving weights between ranks), then greedy generation of three sequences under data-parallel
attention with a placement switched mid-generation.

Tolerance: 1e-5 on the layer outputs, not bitwise: the single-process path sums a row's k expert outputs by
index_add_ in expert order (or a bmm gather at decode sizes), the exchange sums them in float32 in choice order.
The generated tokens are compared exactly."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.models.deepseek_v4.moe import moe
from shared.engine.models.deepseek_v4.weights import Layer
from shared.engine.parallel.placement import Placement
from shared.schemas.experts import ExpertPlan
from shared.schemas.generate import SamplingParams
from tests import v4_checkpoints

E, T = 8, 24  # the checkpoint's experts; rows of the layer cases
SPLITS = {2: {"even": [10, 14], "one-idle": [24, 0]}, 4: {"even": [3, 7, 9, 5], "one-idle": [5, 0, 19, 0]}}
MAX_NEW = 5
PLACEMENT_AT = 2  # the decode step before which generation switches placement


# --- placements (pure) -------------------------------------------------------------------------------------------

def _replicated(layers: int, world: int) -> Placement:
    """Each rank: its even block plus one slot replicating a hot expert (0 or 1, the skewed routing's)."""
    per = E // world
    rows = tuple(tuple(x for r in range(world) for x in [*range(r * per, (r + 1) * per), r % 2])
                 for _ in range(layers))
    return Placement(E, world, per + 1, rows, version=1)


def _shuffled(layers: int, world: int) -> Placement:
    """No replicas, every layer a different permutation: most experts change rank."""
    g = torch.Generator().manual_seed(layers)
    return Placement(E, world, E // world, tuple(tuple(torch.randperm(E, generator=g).tolist())
                                                 for _ in range(layers)), version=2)


def test_even_placement_and_tables() -> None:
    p = Placement.even(layers=2, experts=8, ranks=4)
    assert p.slots_per_rank == 2 and p.local(0, 3) == [6, 7]
    slots, replicas = p.table(1, torch.device("cpu"))
    assert slots.tolist() == [[e] for e in range(8)] and replicas.tolist() == [1] * 8
    with pytest.raises(ValueError, match="split evenly"):
        Placement.even(1, 6, 4)


def test_replica_table_pads_with_the_first_slot() -> None:
    p = _replicated(1, 2)  # rank 0: [0 1 2 3 0], rank 1: [4 5 6 7 1]
    slots, replicas = p.table(0, torch.device("cpu"))
    assert slots[0].tolist() == [0, 4] and slots[1].tolist() == [1, 9] and slots[2].tolist() == [2, 2]
    assert replicas.tolist() == [2, 2, 1, 1, 1, 1, 1, 1]


def test_transfers_move_only_what_a_rank_lacks() -> None:
    old = Placement.even(1, 8, 2)
    moves = old.transfers(_replicated(1, 2))
    # rank 0's extra slot replicates expert 0, which it holds: a local copy; rank 1's gets expert 1 from rank 0
    assert [(m.slot, m.expert, m.src, m.dst) for m in moves] == [(9, 1, 0, 1)]
    back = _replicated(1, 2).transfers(old)
    assert back == []  # every rank still holds what the even split gives it


def test_a_bad_plan_is_refused() -> None:
    plan = ExpertPlan("g", "m", 1, 1, 4, 2, 2, [[0, 1, 2, 2]], 0, 1, 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="every one of 4"):
        Placement.from_plan(plan)
    good = dataclasses.replace(plan, physical=[[3, 1, 2, 0]])
    assert Placement.from_plan(good).local(0, 1) == [2, 0]
    with pytest.raises(ValueError, match="another shape"):
        Placement.even(2, 4, 2).transfers(Placement.from_plan(good))


# --- the ranks ---------------------------------------------------------------------------------------------------

def _skew(layer: Layer) -> Layer:
    """Every row routed to experts 0 and 1 (rank 0's under the even split): by a huge bias, or a hash table."""
    if layer.tid2eid is not None:
        return dataclasses.replace(layer, tid2eid=torch.tensor([0, 1]).expand_as(layer.tid2eid).contiguous())
    bias = layer.gate_bias.clone()
    bias[:2] += 1e4
    return dataclasses.replace(layer, gate_bias=bias)


def _inputs(model) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return (torch.randn(T, model.spec.hidden_size, generator=g),
            torch.randint(0, model.spec.vocab_size, (T,), generator=g))


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(11)
    return {rid: torch.randint(0, 512, (n,), generator=g).tolist() for rid, n in (("a", 13), ("b", 20), ("c", 7))}


def _rank_main(rank: int, world: int, port: int, checkpoint: str, out: str) -> None:
    from shared.engine.parallel.dp import PlacementPlan, RankRunner, generate
    from shared.engine.parallel.ep_moe import ExpertParallel
    from shared.engine.parallel.group import Group, GroupConfig

    torch.set_num_threads(1)
    group = Group(GroupConfig(rank, world, "127.0.0.1", port, torch.device("cpu")))
    engine = Engine(checkpoint, kv_blocks=16)
    model, s = engine.model, engine.model.spec
    x, ids = _inputs(model)
    full = [layer.experts for layer in model.layers]
    results: dict[str, torch.Tensor] = {}

    def layers_case(name: str, ep: ExpertParallel, split: str, skew: bool) -> None:
        a = sum(SPLITS[world][split][:rank])
        b = a + SPLITS[world][split][rank]
        for i, layer in enumerate(model.layers):
            layer = _skew(layer) if skew else layer
            results[f"{name}/{i}"] = ep.moe(s, i, layer, x[a:b], ids[a:b])

    def fresh(p: Placement) -> ExpertParallel:
        return ExpertParallel(group, p, full, s.swiglu_limit, torch.float32)

    layers_case("even", fresh(Placement.even(s.num_layers, E, world)), "even", skew=False)
    layers_case("skew", fresh(Placement.even(s.num_layers, E, world)), "one-idle", skew=True)
    layers_case("replicas", fresh(_replicated(s.num_layers, world)), "even", skew=True)
    ep = fresh(Placement.even(s.num_layers, E, world))
    moved = ep.apply(_replicated(s.num_layers, world))
    layers_case("applied-replicas", ep, "even", skew=True)
    moved += ep.apply(_shuffled(s.num_layers, world))
    layers_case("applied-shuffled", ep, "one-idle", skew=False)
    results["moved"] = torch.tensor(moved)

    # the whole model: data-parallel attention, a placement switched between two decode steps
    engine = Engine(checkpoint, kv_blocks=32)
    ExpertParallel(group, Placement.even(s.num_layers, E, world), [la.experts for la in engine.model.layers],
                   s.swiglu_limit, torch.float32).attach(engine.model)
    runner = RankRunner(engine.model, engine.kv, group)
    if rank == 0:
        new = _shuffled(s.num_layers, world)
        plan = PlacementPlan(new.version, new.slots_per_rank, [list(row) for row in new.physical])
        tokens = generate(runner, _prompts(), MAX_NEW, 32, {PLACEMENT_AT: plan})
        results |= {f"tokens/{rid}": torch.tensor(t) for rid, t in tokens.items()}
    else:
        runner.follow()
    results["experts-held"] = torch.tensor([engine.model.layers[0].experts.w13.shape[0],
                                            engine.model.expert_parallel.local[0].w13.shape[0]])
    torch.save(results, Path(out) / f"rank{rank}.pt")
    group.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v4-ep")
    v4_checkpoints.build(path, "mixed")
    return path


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The single-process engine: every layer's MoE over all T rows, and greedy generation."""
    model = Engine(str(checkpoint), kv_blocks=16).model
    x, ids = _inputs(model)
    out = {}
    for i, layer in enumerate(model.layers):
        out[f"plain/{i}"] = moe(model.spec, layer, x, ids)
        out[f"skewed/{i}"] = moe(model.spec, _skew(layer), x, ids)
    engine = Engine(str(checkpoint), kv_blocks=32)
    requests = [EngineRequest(rid, p, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                              max_new_tokens=MAX_NEW) for rid, p in _prompts().items()]
    out |= {f"tokens/{rid}": torch.tensor(t) for rid, t in run_to_completion(engine, requests).items()}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_one_process(world: int, checkpoint: Path, reference: dict[str, torch.Tensor],
                                            tmp_path: Path) -> None:
    mp.start_processes(_rank_main, args=(world, _free_port(), str(checkpoint), str(tmp_path)), nprocs=world,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    cases = {"even": ("plain", "even"), "skew": ("skewed", "one-idle"), "replicas": ("skewed", "even"),
             "applied-replicas": ("skewed", "even"), "applied-shuffled": ("plain", "one-idle")}
    for case, (ref, split) in cases.items():
        for i in range(4):
            got = torch.cat([ranks[r][f"{case}/{i}"] for r in range(world)])
            assert got.shape == (T, 64)
            torch.testing.assert_close(got, reference[f"{ref}/{i}"], atol=1e-5, rtol=1e-5, msg=f"{case} layer {i}")
    assert all(int(ranks[r]["moved"]) > 0 for r in range(world))  # the shuffle moved weights into every rank
    for rid in "abc":
        assert len(reference[f"tokens/{rid}"]) == MAX_NEW
        assert ranks[0][f"tokens/{rid}"].tolist() == reference[f"tokens/{rid}"].tolist(), rid
    # the model's own stacks were let go; the rank holds its slots' experts alone
    assert all(ranks[r]["experts-held"].tolist() == [0, E // world] for r in range(world))
