"""fusedmlp.torch's ops as Python custom ops (torch.library.custom_op), for builds without the C++
module fusedmlp._torch_ops (torch absent at build time, -DFMLP_TORCH_OPS=OFF, another torch
installed since) or with FMLP_TORCH_OPS=python in the environment. Same schemas and results as
the C++ kernels; each call goes through DLPack capsules and the generic extension entry points,
which costs several times the host time (bench/host_overhead.py). Fake kernels are registered by
fusedmlp.torch for either implementation."""

from typing import Optional

import torch
from torch import Tensor

from . import _ACTIVATIONS, _BACKENDS, _NORMS, _SCORINGS, _ext, _lookup, _routing_ids
from . import _routing_weights
from .torch import _PACKS, _args, _device_of, _rows, _stream_for, _workspace_for


@torch.library.custom_op("fusedmlp::mlp", mutates_args=())
def _mlp_op(x: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor] = None,
            w_up: Optional[Tensor] = None, b_up: Optional[Tensor] = None,
            b2: Optional[Tensor] = None, residual: Optional[Tensor] = None,
            norm_weight: Optional[Tensor] = None, norm_bias: Optional[Tensor] = None,
            w1_scale: Optional[Tensor] = None, w_up_scale: Optional[Tensor] = None,
            w2_scale: Optional[Tensor] = None, activation: str = "gelu", gated: bool = False,
            norm: str = "none", eps: float = 1e-5) -> Tensor:
    x2 = _rows(x, "x")
    if w2.dim() == 0:
        raise ValueError("w2 has shape (); expected [d_out, hidden]")
    d_out = w2.shape[0]
    y = torch.empty((x2.shape[0], d_out), dtype=x.dtype, device=x.device)
    r2 = None if residual is None else _rows(residual, "residual")
    with _device_of(x):
        tensors, bits = _args(x.device, out=y, x=x2, residual=r2, w1=w1, w1_scale=w1_scale,
                              b1=b1, w_up=w_up, w_up_scale=w_up_scale, b_up=b_up, w2=w2,
                              w2_scale=w2_scale, b2=b2, norm_weight=norm_weight,
                              norm_bias=norm_bias)
        _ext.mlp("run", tensors, bits, _lookup(_ACTIVATIONS, "activation", activation), gated,
                 _lookup(_NORMS, "norm", norm), eps, False, _BACKENDS["auto"],
                 _workspace_for(x), _stream_for(x))
    return y.view(*x.shape[:-1], d_out)


@torch.library.custom_op("fusedmlp::mlp_packed", mutates_args=())
def _mlp_packed_op(x: Tensor, residual: Optional[Tensor], handle: int, d_out: int) -> Tensor:
    packed = _PACKS.get(handle)
    if packed is None:
        raise ValueError(f"handle {handle} names no live packed mlp (its FusedMLP was deleted or "
                         "repacked); rebuild the compiled graph from the live module")
    x2 = _rows(x, "x")
    y = torch.empty((x2.shape[0], d_out), dtype=x.dtype, device=x.device)
    r2 = None if residual is None else _rows(residual, "residual")
    with _device_of(x):
        tensors, bits = _args(x.device, out=y, x=x2, residual=r2)
        packed.ext.run("run", tensors, bits, _workspace_for(x), _stream_for(x))
    return y.view(*x.shape[:-1], d_out)


@torch.library.custom_op("fusedmlp::moe", mutates_args=())
def _moe_op(x: Tensor, w1: Tensor, w2: Tensor, top_k: int, router_w: Optional[Tensor] = None,
            router_b: Optional[Tensor] = None, topk_ids: Optional[Tensor] = None,
            topk_weights: Optional[Tensor] = None, b1: Optional[Tensor] = None,
            b2: Optional[Tensor] = None, residual: Optional[Tensor] = None,
            activation: str = "silu", gated: bool = True, scoring: str = "softmax",
            renormalize: bool = True, deterministic: bool = False,
            backend: str = "auto", first_expert: int = 0, global_experts: int = 0,
            round_router_logits: bool = False, w1_scale: Optional[Tensor] = None,
            w2_scale: Optional[Tensor] = None) -> Tensor:
    x2 = _rows(x, "x")
    if w2.dim() != 3:
        raise ValueError(f"w2 has shape {tuple(w2.shape)}; expected [num_experts, d_out, "
                         "hidden]")
    d_out = w2.shape[1]
    y = torch.empty((x2.shape[0], d_out), dtype=x.dtype, device=x.device)
    r2 = None if residual is None else _rows(residual, "residual")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t is not None and (t.dim() == 0 or t.shape[-1] != top_k
                              or t.numel() != x2.shape[0] * top_k):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected [..., top_k] = "
                             f"{(*x.shape[:-1], top_k)} (x's leading dims)")
    if topk_ids is not None:
        topk_ids = _routing_ids(topk_ids.reshape(-1, top_k),
                                global_experts if global_experts > 0
                                else w1.shape[0]).contiguous()
    if topk_weights is not None:
        topk_weights = _routing_weights(topk_weights.reshape(-1, top_k)).contiguous()
    with _device_of(x):
        tensors, bits = _args(x.device, out=y, x=x2, residual=r2, router_w=router_w,
                              router_b=router_b, topk_ids=topk_ids, topk_weights=topk_weights,
                              w1=w1, w1_scale=w1_scale, b1=b1, w2=w2, w2_scale=w2_scale, b2=b2)
        _ext.moe("run", tensors, bits, top_k, _lookup(_ACTIVATIONS, "activation", activation),
                 gated, _lookup(_SCORINGS, "scoring", scoring), renormalize, deterministic,
                 first_expert, global_experts, round_router_logits,
                 _lookup(_BACKENDS, "backend", backend),
                 _workspace_for(x, "moe"),
                 _stream_for(x))
    return y.view(*x.shape[:-1], d_out)


@torch.library.custom_op("fusedmlp::linear", mutates_args=())
def _linear_op(x: Tensor, w: Tensor, bias: Optional[Tensor] = None,
               w_scale: Optional[Tensor] = None) -> Tensor:
    x2 = _rows(x, "x")
    n = w.shape[0] if w.dim() else 0  # a 0-d w is reported by the library, naming w
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    with _device_of(x):
        tensors, bits = _args(x.device, out=y, x=x2, w=w, w_scale=w_scale, bias=bias)
        _ext.linear("run", tensors, bits, _BACKENDS["auto"], _workspace_for(x), _stream_for(x))
    return y.view(*x.shape[:-1], n)


@torch.library.custom_op("fusedmlp::softmax", mutates_args=())
def _softmax_op(x: Tensor, temperature: float = 1.0, log: bool = False) -> Tensor:
    x2 = _rows(x, "x")
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    with _device_of(x):
        tensors, bits = _args(x.device, out=y, x=x2)
        _ext.softmax("run", tensors, bits, temperature, log, _BACKENDS["auto"],
                     _workspace_for(x), _stream_for(x))
    return y.view(x.shape)
