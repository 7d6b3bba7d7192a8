"""What every rank of an expert-parallel test runs, and what the parent compares it with (tests/unit/
test_expert_parallel.py on CPU processes with gloo, tests/gpu/test_expert_parallel_gpu.py on GPUs with NCCL).

A tiny random DeepSeek-V4 checkpoint (v4_checkpoints "mixed": 4 layers, one hash-routed, 8 experts, top 2, a
shared expert), fp32. Each rank writes its results; the parent compares them with the single-process engine:
every MoE layer's output for the rank's rows (even routing; routing skewed onto rank 0's experts so other ranks
get no pairs, and a rank with no rows at all; hot experts replicated; after new placements were applied by moving
weights between ranks), then greedy generation of three sequences under data-parallel attention, with a placement
switched between two decode steps (with 4 ranks one rank holds no sequence and joins every exchange idle).

Tolerance: 1e-5 on the layer outputs, not bitwise: the single-process path sums a row's k expert outputs by
index_add_ in expert order (or a bmm gather at decode sizes), the exchange sums them in float32 in choice order.
The generated tokens are compared exactly."""

from __future__ import annotations

import dataclasses
import multiprocessing
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp

from shared.engine.engine import Engine, EngineRequest, run_to_completion
from shared.engine.memory import held_bytes
from shared.engine.models.deepseek_v4.moe import moe
from shared.engine.models.deepseek_v4.weights import Layer
from shared.engine.parallel.placement import Placement
from shared.schemas.generate import SamplingParams

E, T, D = 8, 24, 64  # the checkpoint's experts and width; rows of the layer cases
# rows of each rank, per world size: "one-idle" leaves a rank with no rows at all
SPLITS = {1: {"even": [24], "one-idle": [24]}, 2: {"even": [10, 14], "one-idle": [24, 0]},
          4: {"even": [3, 7, 9, 5], "one-idle": [5, 0, 19, 0]}}
MAX_NEW = 5
PLACEMENT_AT = 2  # the decode step before which generation switches placement
# layer case -> (the reference it equals, the rows' split over the ranks)
CASES = {"even": ("plain", "even"), "skew": ("skewed", "one-idle"), "replicas": ("skewed", "even"),
         "applied-replicas": ("skewed", "even"), "applied-shuffled": ("plain", "one-idle")}


def replicated(layers: int, world: int) -> Placement:
    """Each rank: its even block plus one slot replicating a hot expert (0 or 1, the skewed routing's)."""
    per = E // world
    rows = tuple(tuple(x for r in range(world) for x in [*range(r * per, (r + 1) * per), r % 2])
                 for _ in range(layers))
    return Placement(E, world, per + 1, rows, version=1)


def shuffled(layers: int, world: int) -> Placement:
    """No replicas, every layer a different permutation: most experts change rank."""
    g = torch.Generator().manual_seed(layers)
    return Placement(E, world, E // world, tuple(tuple(torch.randperm(E, generator=g).tolist())
                                                 for _ in range(layers)), version=2)


def skew(layer: Layer) -> Layer:
    """Every row routed to experts 0 and 1 (rank 0's under the even split): by a huge bias, or a hash table."""
    if layer.tid2eid is not None:
        table = torch.tensor([0, 1], device=layer.tid2eid.device).expand_as(layer.tid2eid).contiguous()
        return dataclasses.replace(layer, tid2eid=table)
    bias = layer.gate_bias.clone()
    bias[:2] += 1e4
    return dataclasses.replace(layer, gate_bias=bias)


def inputs(model) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, model.spec.hidden_size, generator=g)
    ids = torch.randint(0, model.spec.vocab_size, (T,), generator=g)
    return x.to(model.device), ids.to(model.device)


def prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(11)
    return {rid: torch.randint(0, 512, (n,), generator=g).tolist() for rid, n in (("a", 13), ("b", 20), ("c", 7))}


def engine(checkpoint: str, device: str, kv_blocks: int) -> Engine:
    return Engine(checkpoint, device=device, dtype=torch.float32, kv_blocks=kv_blocks, cuda_graphs=False)


def rank_main(rank: int, world: int, port: int, checkpoint: str, out: str, device_kind: str) -> None:
    from shared.engine.parallel.dp import PlacementPlan, RankRunner, generate
    from shared.engine.parallel.ep_moe import ExpertParallel
    from shared.engine.parallel.group import Group, GroupConfig

    device = "cpu" if device_kind == "cpu" else f"cuda:{rank}"
    torch.set_num_threads(1)
    group = Group(GroupConfig(rank, world, "127.0.0.1", port, torch.device(device)))
    model = engine(checkpoint, device, 16).model
    s = model.spec
    x, ids = inputs(model)
    full = [layer.experts for layer in model.layers]
    results: dict[str, torch.Tensor] = {}

    def layers_case(name: str, ep: ExpertParallel, split: str, skewed: bool) -> None:
        a = sum(SPLITS[world][split][:rank])
        b = a + SPLITS[world][split][rank]
        for i, layer in enumerate(model.layers):
            results[f"{name}/{i}"] = ep.moe(s, i, skew(layer) if skewed else layer, x[a:b], ids[a:b]).cpu()

    def fresh(p: Placement) -> ExpertParallel:
        return ExpertParallel(group, p, full, s.swiglu_limit, torch.float32, model.triton)

    layers_case("even", fresh(Placement.even(s.num_layers, E, world)), "even", skewed=False)
    layers_case("skew", fresh(Placement.even(s.num_layers, E, world)), "one-idle", skewed=True)
    layers_case("replicas", fresh(replicated(s.num_layers, world)), "even", skewed=True)
    ep = fresh(Placement.even(s.num_layers, E, world))
    moved = ep.apply(replicated(s.num_layers, world))
    layers_case("applied-replicas", ep, "even", skewed=True)
    moved += ep.apply(shuffled(s.num_layers, world))
    layers_case("applied-shuffled", ep, "one-idle", skewed=False)
    results["moved"] = torch.tensor(moved)

    # the whole model: data-parallel attention, a placement switched between two decode steps
    whole = engine(checkpoint, device, 32)
    ExpertParallel(group, Placement.even(s.num_layers, E, world), [la.experts for la in whole.model.layers],
                   s.swiglu_limit, torch.float32, whole.model.triton).attach(whole.model)
    runner = RankRunner(whole.model, whole.kv, group)
    if rank == 0:
        new = shuffled(s.num_layers, world)
        plan = PlacementPlan(new.version, new.slots_per_rank, [list(row) for row in new.physical])
        tokens = generate(runner, prompts(), MAX_NEW, 32, {PLACEMENT_AT: plan})
        results |= {f"tokens/{rid}": torch.tensor(t) for rid, t in tokens.items()}
    else:
        runner.follow()
    ep = whole.model.expert_parallel
    results["held"] = torch.tensor([whole.model.layers[0].experts.w13.shape[0], ep.local[0].w13.shape[0],
                                    ep.placement.version, held_bytes(whole.model)])
    torch.save(results, Path(out) / f"rank{rank}.pt")
    group.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(world: int, checkpoint: Path, out: Path, device_kind: str) -> list[dict[str, torch.Tensor]]:
    """Every rank in its own process; a rank that raises fails the call. On a CPU the ranks come from a fork
    server that imported torch and the engine once (~5 s of CPU a rank saved, and no fork of pytest's threads);
    CUDA needs spawn."""
    if device_kind == "cpu":
        multiprocessing.set_forkserver_preload([__name__])
    mp.start_processes(rank_main, args=(world, free_port(), str(checkpoint), str(out), device_kind), nprocs=world,
                       start_method="forkserver" if device_kind == "cpu" else "spawn")
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def reference(checkpoint: Path, device: str) -> dict[str, torch.Tensor]:
    """The single-process engine: every layer's MoE over all T rows, and greedy generation."""
    model = engine(str(checkpoint), device, 16).model
    x, ids = inputs(model)
    routed = sum(layer.experts.w13.nbytes + layer.experts.w2.nbytes for layer in model.layers)
    out = {"weights": torch.tensor([held_bytes(model), routed])}
    for i, layer in enumerate(model.layers):
        out[f"plain/{i}"] = moe(model.spec, layer, x, ids, model.triton).cpu()
        out[f"skewed/{i}"] = moe(model.spec, skew(layer), x, ids, model.triton).cpu()
    requests = [EngineRequest(rid, p, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                              max_new_tokens=MAX_NEW) for rid, p in prompts().items()]
    got = run_to_completion(engine(str(checkpoint), device, 32), requests)
    return out | {f"tokens/{rid}": torch.tensor(t) for rid, t in got.items()}


def check(ranks: list[dict[str, torch.Tensor]], want: dict[str, torch.Tensor], tol: float) -> None:
    world = len(ranks)
    for case, (ref, _) in CASES.items():
        for i in range(4):
            got = torch.cat([ranks[r][f"{case}/{i}"] for r in range(world)])
            assert got.shape == (T, D)
            torch.testing.assert_close(got, want[f"{ref}/{i}"], atol=tol, rtol=tol, msg=f"{case}, layer {i}")
    assert world == 1 or all(int(ranks[r]["moved"]) > 0 for r in range(world))  # the shuffle moved weights in
    for rid in "abc":
        assert len(want[f"tokens/{rid}"]) == MAX_NEW
        assert ranks[0][f"tokens/{rid}"].tolist() == want[f"tokens/{rid}"].tolist(), rid
    # the model's own stacks were let go, the rank holds its slots' experts alone, under the switched placement,
    # and the model's memory account (memory.py, the worker's load line) counts those
    whole, routed = want["weights"].tolist()
    assert all(ranks[r]["held"].tolist() == [0, E // world, 2, whole - routed + routed // world] for r in range(world))
