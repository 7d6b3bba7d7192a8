"""DeepSeek-V4's weights as the forward reads them: one frozen record per layer, built from the loader's tensors.

Expert weights are stacked per layer ((E, 2 I, D) gate rows then up rows, and (E, D, I)), so a batch can index
them by expert id. Everything numerically sensitive (norm weights, mHC parameters, sinks, position biases)
is kept in float32 whatever the weight dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.models.deepseek_v4.spec import CSA, SLIDING, DeepseekV4Spec


@dataclass(frozen=True)
class Compressor:
    wkv: torch.Tensor  # (C, D): C = 2 d for CSA (Ca | Cb), d for HCA
    wgate: torch.Tensor  # (C, D)
    ape: torch.Tensor  # (m, C) float32 position bias inside a window
    norm: torch.Tensor  # (d,) float32
    ratio: int
    overlap: bool  # CSA: entry w also mixes window w - 1


@dataclass(frozen=True)
class Indexer:
    compressor: Compressor
    wq_b: torch.Tensor  # (heads * index_head_dim, q_lora_rank)
    weights_proj: torch.Tensor  # (heads, D)


@dataclass(frozen=True)
class Experts:
    w13: torch.Tensor  # (E, 2 I, D): gate rows then up rows
    w2: torch.Tensor  # (E, D, I)


HcParams = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # fn ((2 + hc) hc, hc D), base, scale (3,)


@dataclass(frozen=True)
class Layer:
    kind: str
    hc_attn: HcParams
    hc_ffn: HcParams
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    wq_a: torch.Tensor
    q_norm: torch.Tensor
    wq_b: torch.Tensor
    wkv: torch.Tensor
    kv_norm: torch.Tensor
    wo_a: torch.Tensor  # (G * o_lora_rank, H * d / G)
    wo_b: torch.Tensor  # (D, G * o_lora_rank)
    sinks: torch.Tensor  # (H,) float32
    compressor: Compressor | None
    indexer: Indexer | None
    gate: torch.Tensor  # (E, D) router
    gate_bias: torch.Tensor | None  # (E,) float32 selection bias (top-k routed layers)
    tid2eid: torch.Tensor | None  # (V, k) int64 (hash-routed layers)
    experts: Experts
    shared: Experts | None  # the shared expert(s) as one (1, 2 I', D) expert


@dataclass(frozen=True)
class Mtp:
    """Multi-token prediction: the layer pairs the main model's streams at position j with the embedding of
    token j + 1 and predicts token j + 2, through one more (window-only) block and its own head collapse."""

    layer: Layer
    e_proj: torch.Tensor  # (D, D)
    h_proj: torch.Tensor  # (D, D)
    enorm: torch.Tensor
    hnorm: torch.Tensor
    norm: torch.Tensor
    hc_head: HcParams


@dataclass(frozen=True)
class V4Weights:
    embed: torch.Tensor
    head: torch.Tensor
    norm: torch.Tensor
    hc_head: HcParams
    layers: list[Layer]
    mtp: Mtp | None  # None: the checkpoint has no (window-only) MTP layer


def load(spec: DeepseekV4Spec, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
         ) -> V4Weights:
    def w(name: str, keep_fp32: bool = False) -> torch.Tensor:
        if name not in weights:
            raise ValueError(f"checkpoint has no tensor {name}")
        return weights[name].to(device=device, dtype=torch.float32 if keep_fp32 else dtype)

    def f32(name: str) -> torch.Tensor:
        return w(name, keep_fp32=True)

    def hc(p: str) -> HcParams:
        return f32(p + "_fn"), f32(p + "_base"), f32(p + "_scale")

    def compressor(p: str, ratio: int, overlap: bool) -> Compressor:
        return Compressor(w(p + "wkv.weight"), w(p + "wgate.weight"), f32(p + "ape"), f32(p + "norm.weight"),
                          ratio, overlap)

    def experts(p: str, names: list[str]) -> Experts:
        w13 = torch.stack([torch.cat([w(f"{p}{e}.w1.weight"), w(f"{p}{e}.w3.weight")]) for e in names])
        return Experts(w13, torch.stack([w(f"{p}{e}.w2.weight") for e in names]))

    def layer(p: str, kind: str, ratio: int, hashed: bool) -> Layer:
        a = p + "attn."
        return Layer(
            kind=kind,
            hc_attn=hc(p + "hc_attn"),
            hc_ffn=hc(p + "hc_ffn"),
            attn_norm=f32(p + "attn_norm.weight"),
            ffn_norm=f32(p + "ffn_norm.weight"),
            wq_a=w(a + "wq_a.weight"), q_norm=f32(a + "q_norm.weight"), wq_b=w(a + "wq_b.weight"),
            wkv=w(a + "wkv.weight"), kv_norm=f32(a + "kv_norm.weight"),
            wo_a=w(a + "wo_a.weight"), wo_b=w(a + "wo_b.weight"), sinks=f32(a + "attn_sink"),
            compressor=compressor(a + "compressor.", ratio, kind == CSA) if kind != SLIDING else None,
            indexer=Indexer(compressor(a + "indexer.compressor.", ratio, True), w(a + "indexer.wq_b.weight"),
                            w(a + "indexer.weights_proj.weight")) if kind == CSA else None,
            gate=w(p + "ffn.gate.weight"),
            gate_bias=None if hashed else f32(p + "ffn.gate.bias"),
            tid2eid=weights[p + "ffn.gate.tid2eid"].to(device=device, dtype=torch.long) if hashed else None,
            experts=experts(p + "ffn.experts.", [str(e) for e in range(spec.num_experts)]),
            shared=experts(p + "ffn.", ["shared_experts"]) if spec.num_shared_experts else None,
        )

    layers = [layer(f"layers.{i}.", kind, ratio, i < spec.hash_layers)
              for i, (kind, ratio) in enumerate(zip(spec.kinds, spec.ratios))]
    # The MTP layer drafts tokens for speculative decoding. DeepSeek's releases make it window-only (their
    # compress_ratios end in 0): its sliding ring is all the state it needs, kept beside the main layers'.
    mtp = None
    if spec.num_mtp_layers and spec.mtp_kinds[0] == SLIDING:
        p = "mtp.0."
        mtp = Mtp(layer(p, SLIDING, 0, False), w(p + "e_proj.weight"), w(p + "h_proj.weight"),
                  f32(p + "enorm.weight"), f32(p + "hnorm.weight"), f32(p + "norm.weight"), hc(p + "hc_head"))
    return V4Weights(w("embed.weight"), w("head.weight"), f32("norm.weight"), hc("hc_head"), layers, mtp)
