"""fusedmlp.torch.FusedMoE: a sparse mixture-of-experts block (router, top-k, stacked expert
MLPs, weighted sum) as one fusedmlp::moe op, built from stacked expert weights or from a
Hugging Face block.

Hugging Face blocks taken by from_module (their routing math, read from transformers 5.24):
- MixtralSparseMoeBlock: logits = gate(x) (no bias); probs = softmax(logits in fp32); the top_k
  largest; divided by their sum; experts SwiGLU (act_fn) on gate_up_proj [E, 2I, H] (gate rows,
  then up rows: fusedmlp's stacked gated W1) and down_proj [E, H, I]. In training, x is first
  scaled by uniform(1 - jitter_noise, 1 + jitter_noise) noise (FusedMoE does the same).
- Qwen3MoeSparseMoeBlock: the same with the renormalisation only when norm_topk_prob.
- The transformers 4.x layouts of both (gate an nn.Linear, experts an nn.ModuleList of
  w1/w3/w2 or gate_proj/up_proj/down_proj MLPs, forward returning (y, router_logits)): the
  expert weights are copied into stacked tensors once, and forward returns the router logits
  too (computed by torch, as the 4.x block does, for the auxiliary loss).
Other MoE blocks (shared experts, grouped or biased routers, transposed or biased experts) raise
NotImplementedError naming what does not fit.
"""

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from . import _ACTIVATIONS, _BACKENDS, _SCORINGS, _fp8, _lookup
from .torch import _activation, _moe_op, _PaddedCopy, _param

__all__ = ["FusedMoE"]


class FusedMoE(nn.Module):
    """y = moe(x) [+ residual]: a sparse mixture-of-experts block through torch.ops.fusedmlp.moe.

    The router (router_w [E, d], router_b [E]), softmax or sigmoid scoring, the top_k experts
    per token (ties to the lower id), optionally renormalised, and the weighted sum of those
    experts' MLPs (w1 [E, hidden or 2*hidden, d], w2 [E, d_out, hidden]); the math is
    fusedmlp.moe's. The weights are used as they are (nothing is packed), so .to() and in-place
    edits need no extra step; on CUDA, 16-bit experts whose d or hidden is not a multiple of 8
    (rows back to back) run from a copy with padded rows, made at the first call and again when
    the weights change (pad_rows=False: as given, which no CUDA kernel takes). Inference only: no
    backward.

    Parameters
    ----------
    w1, w2, router_w : torch.Tensor
        The stacked experts and the router, as for fusedmlp.moe (kept as Parameters without
        grad).
    top_k : int
        Experts per token, in [1, experts routed over].
    router_b, b1, b2 : torch.Tensor, optional
    activation, gated, scoring, renormalize, deterministic, backend
        As for fusedmlp.moe.
    jitter_noise : float
        > 0 scales x by uniform(1 - j, 1 + j) noise in training mode only, as Mixtral does.
    return_router_logits : bool
        forward returns (y, router_logits [rows, E]), the transformers 4.x block interface.
    first_expert, global_experts : int
        w1/w2 hold only experts [first_expert, first_expert + E) of global_experts routed over
        (expert parallelism, fusedmlp.tp); 0, 0: every expert.
    round_router_logits : bool
        Round the router's logits to x's dtype before scoring, as a 16-bit nn.Linear router
        does (from_module sets it, so routing follows the Hugging Face block's).
    w1_scale, w2_scale : torch.Tensor, optional
        float32 scales of float8_e4m3fn experts, [E] (per expert) or [E, rows] (per row).
    pad_rows : bool
        See above: the padded-row copies of w1 and w2 for odd d or hidden on CUDA.

    Attributes
    ----------
    num_experts, d, hidden, d_out : int
        E local experts; x [..., d] -> y [..., d_out] through h [..., hidden].

    Raises
    ------
    ValueError
        w1 or w2 not 3-D, top_k out of range, an unknown activation, scoring or backend.
    """

    def __init__(self, w1, w2, router_w, *, top_k, router_b=None, b1=None, b2=None,
                 activation="silu", gated=True, scoring="softmax", renormalize=True,
                 jitter_noise=0.0, return_router_logits=False, deterministic=False,
                 backend="auto", first_expert=0, global_experts=0, round_router_logits=False,
                 w1_scale=None, w2_scale=None, pad_rows=True):
        super().__init__()
        _lookup(_ACTIVATIONS, "activation", activation)
        _lookup(_SCORINGS, "scoring", scoring)
        _lookup(_BACKENDS, "backend", backend)
        if w1.dim() != 3 or w2.dim() != 3:
            raise ValueError(f"w1 has shape {tuple(w1.shape)} and w2 {tuple(w2.shape)}; expected "
                             "[num_experts, hidden (2*hidden gated), d] and [num_experts, d_out, "
                             "hidden]")
        routed = int(global_experts) if global_experts > 0 else int(w1.shape[0])
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= routed:
            raise ValueError(f"top_k is {top_k!r}; expected an int in [1, {routed}] "
                             "(the experts routed over)")
        for name, t in dict(w1=w1, w2=w2, router_w=router_w, router_b=router_b, b1=b1,
                            b2=b2, w1_scale=w1_scale, w2_scale=w2_scale).items():
            self.register_parameter(name, _param(t))
        self.top_k, self.activation, self.gated = top_k, activation, bool(gated)
        self.scoring, self.renormalize = scoring, bool(renormalize)
        self.jitter_noise, self.return_router_logits = float(jitter_noise), return_router_logits
        self.deterministic, self.backend = bool(deterministic), backend
        self.num_experts, self.d = int(w1.shape[0]), int(w1.shape[2])
        self.first_expert, self.global_experts = int(first_expert), int(global_experts)
        self.round_router_logits = bool(round_router_logits)
        self.d_out, self.hidden = int(w2.shape[1]), int(w2.shape[2])
        self.pad_rows = bool(pad_rows)
        self._padded = (_PaddedCopy(), _PaddedCopy())  # of w1, w2

    @classmethod
    def from_module(cls, module: nn.Module, backend: str = "auto") -> "FusedMoE":
        """A FusedMoE computing what a Hugging Face sparse-MoE block computes.

        Stacked (transformers 5) expert weights are shared, not copied.

        Parameters
        ----------
        module : nn.Module
            One of the blocks listed in the module docstring (Mixtral, Qwen-MoE style).
        backend : {"auto", "ref", "cpu", "cuda"}

        Returns
        -------
        FusedMoE

        Raises
        ------
        NotImplementedError
            The block does not fit (the message names what).
        """
        return cls(**_describe_moe(module), backend=backend)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """y = moe(x) [+ residual].

        Parameters
        ----------
        x : torch.Tensor
            [..., d] on the weights' device.
        residual : torch.Tensor, optional
            [..., d_out] in x's dtype.

        Returns
        -------
        torch.Tensor or (torch.Tensor, torch.Tensor)
            y [..., d_out] in x's dtype; (y, router_logits [rows, E]) with
            return_router_logits.

        Raises
        ------
        ValueError
            A bad input (shape, dtype, device).
        NotImplementedError
            No kernel of the device handles the request.
        """
        if self.training and self.jitter_noise > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise,
                                                 1.0 + self.jitter_noise)
        w1, w2 = self.w1, self.w2
        if self.pad_rows and w1.is_cuda and (self.d % 8 or self.hidden % 8):
            w1, w2 = self._padded[0].get(w1), self._padded[1].get(w2)
        y = _moe_op(x, w1, w2, self.top_k, self.router_w, self.router_b, None, None,
                    self.b1, self.b2, residual, self.activation, self.gated, self.scoring,
                    self.renormalize, self.deterministic, self.backend, self.first_expert,
                    self.global_experts, self.round_router_logits, self.w1_scale, self.w2_scale)
        if self.return_router_logits:
            return y, F.linear(x.reshape(-1, self.d), self.router_w, self.router_b)
        return y

    def routing_margin(self, x: torch.Tensor) -> torch.Tensor:
        """How far each row is from picking other experts.

        Rows with a small margin may pick other experts under another rounding of the router
        (a 16-bit model's torch router rounds its logits to the model dtype;
        round_router_logits does the same, but the sums before that rounding differ).

        Parameters
        ----------
        x : torch.Tensor
            [..., d].

        Returns
        -------
        torch.Tensor
            float64 [rows]: the gap between the top_k-th and the next largest router logit
            over max |logit| (inf when top_k = E).
        """
        logits = F.linear(x.reshape(-1, self.d).double(), self.router_w.double(),
                          None if self.router_b is None else self.router_b.double())
        if self.top_k == logits.shape[-1]:
            return torch.full(logits.shape[:1], float("inf"), dtype=torch.float64)
        top = logits.topk(self.top_k + 1, dim=-1).values
        scale = logits.abs().amax(dim=-1).clamp_min(1e-30)
        return (top[:, -2] - top[:, -1]) / scale

    def extra_repr(self):
        kind = "gated " if self.gated else ""
        norm = ", renormalized" if self.renormalize else ""
        experts = (f"experts [{self.first_expert}, {self.first_expert + self.num_experts}) of "
                   f"{self.global_experts}" if self.global_experts else
                   f"{self.num_experts} experts")
        return (f"{experts}, top {self.top_k}, {self.d} -> {self.hidden} -> "
                f"{self.d_out}, {kind}{self.activation}, {self.scoring}{norm}, on "
                f"{self.w1.device}")


# Block class -> how its router renormalises the top-k weights.
_RENORMALIZE = {
    "MixtralSparseMoeBlock": lambda block: True,
    "Qwen3MoeSparseMoeBlock": lambda block: bool(
        getattr(block.gate, "norm_topk_prob", getattr(block, "norm_topk_prob", False))),
}


def _router(block):
    gate = getattr(block, "gate", None)
    weight = getattr(gate, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise NotImplementedError(f"{type(block).__name__}.gate has no [num_experts, d] weight")
    extra = [n for n, _ in gate.named_parameters() if n not in ("weight", "bias")]
    if extra:
        raise NotImplementedError(f"{type(block).__name__}.gate has parameters {extra} that "
                                  "fusedmlp's router does not use")
    return weight, getattr(gate, "bias", None)


def _stacked_experts(experts, owner):
    """(w1, w2, activation, scales) of transformers 5 experts (3-D gate_up_proj, down_proj;
    fine-grained fp8 ones with their 128 x 128 block scales, else scales {})."""
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False) \
            or not getattr(experts, "has_gate", True):
        raise NotImplementedError(f"{owner}.experts is transposed, biased or not gated; "
                                  "fusedmlp takes gate_up_proj [E, 2I, H] and down_proj "
                                  "[E, H, I] without biases")
    names = sorted(n for n, _ in experts.named_parameters())
    scales = {}
    if _fp8.is_fp8_experts(experts):
        for a in ("gate_softcap", "swiglu_alpha", "limit"):
            if getattr(experts, a, None) is not None:
                raise NotImplementedError(f"{owner}.experts clamp or softcap their gate ({a}); "
                                          "fusedmlp's experts apply act(gate) * up")
        s1, s2 = _fp8.experts_scales(experts, owner)
        scales = dict(w1_scale=s1, w2_scale=s2)
        names = [n for n in names if n not in ("gate_up_proj_scale_inv", "down_proj_scale_inv",
                                               "gate_up_proj_activation_scale",
                                               "down_proj_activation_scale")]
    if names != ["down_proj", "gate_up_proj"]:
        raise NotImplementedError(f"{owner}.experts has parameters {names}; expected "
                                  "gate_up_proj and down_proj only")
    w1, w2 = experts.gate_up_proj, experts.down_proj
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[1] != 2 * w2.shape[2] \
            or w1.shape[2] != w2.shape[1]:
        raise NotImplementedError(f"{owner}.experts has gate_up_proj {tuple(w1.shape)} and "
                                  f"down_proj {tuple(w2.shape)}; expected [E, 2I, H] and "
                                  "[E, H, I]")
    return w1, w2, _activation(experts.act_fn), scales


def _listed_experts(experts, owner):
    """(w1, w2, activation) stacked from a transformers 4.x nn.ModuleList of expert MLPs
    (Mixtral's w1 gate / w3 up / w2 down, or gate_proj / up_proj / down_proj)."""
    gates, ups, downs, acts = [], [], [], set()
    for i, e in enumerate(experts):
        names = (("w1", "w3", "w2") if all(hasattr(e, a) for a in ("w1", "w2", "w3"))
                 else ("gate_proj", "up_proj", "down_proj"))
        layers = [getattr(e, a, None) for a in names]
        if not all(isinstance(la, nn.Linear) and la.bias is None for la in layers) \
                or not hasattr(e, "act_fn"):
            raise NotImplementedError(f"{owner}.experts[{i}] is a {type(e).__name__}; expected "
                                      "bias-free w1/w3/w2 or gate_proj/up_proj/down_proj "
                                      "nn.Linear layers and act_fn")
        gates.append(layers[0].weight)
        ups.append(layers[1].weight)
        downs.append(layers[2].weight)
        acts.add(_activation(e.act_fn))
    if len(acts) != 1:
        raise NotImplementedError(f"{owner}.experts use different activations {sorted(acts)}")
    with torch.no_grad():
        w1 = torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)])
        w2 = torch.stack(downs)
    return w1, w2, acts.pop(), {}


def _describe_moe(block):
    """FusedMoE keyword arguments for a supported Hugging Face sparse-MoE block."""
    kind = type(block).__name__
    if kind not in _RENORMALIZE:
        raise NotImplementedError(f"{kind} is not a known sparse-MoE block (fusedmlp maps "
                                  f"{', '.join(sorted(_RENORMALIZE))})")
    router_w, router_b = _router(block)
    experts = getattr(block, "experts", None)
    legacy = isinstance(experts, nn.ModuleList)
    w1, w2, activation, scales = (_listed_experts if legacy else _stacked_experts)(experts, kind)
    top_k = getattr(block, "top_k", getattr(block.gate, "top_k", None))
    if not isinstance(top_k, int) or router_w.shape[0] != w1.shape[0]:
        raise NotImplementedError(f"{kind}: top_k {top_k!r} or router {tuple(router_w.shape)} "
                                  f"does not fit {w1.shape[0]} experts")
    return dict(w1=w1, w2=w2, router_w=router_w, router_b=router_b, top_k=top_k,
                activation=activation, gated=True, scoring="softmax",
                renormalize=_RENORMALIZE[kind](block),
                jitter_noise=float(getattr(block, "jitter_noise", 0.0) or 0.0),
                return_router_logits=legacy,
                # The block's router is an nn.Linear in the model dtype: its logits are rounded
                # to it before the softmax, and routing near a tie follows that rounding.
                round_router_logits=True, **scales)
