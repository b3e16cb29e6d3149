"""Tensor-parallel fusedmlp for PyTorch (issue #9): the Megatron split over a torch.distributed
process group on the NCCL backend, one GPU per rank (launch with torchrun --nproc-per-node N).

Rank r of N keeps hidden units [r*H/N, (r+1)*H/N): those rows of W1 (gate and up) and b1, those
columns of W2; b2 (and a residual) only on rank 0. Each rank runs the fused op on its shard (a
FusedMLP packed for its GPU) and torch.distributed.all_reduce sums the partial outputs in
place. x must be the same on every rank (replicated hidden states, as in Megatron-style TP).
Leave NVLink SHARP off: NCCL_NVLS_ENABLE=0 in the environment of every rank (set here when
unset, which only helps if it happens before the process group's communicator is created).

Mixtures of experts are expert parallel instead (TPFusedMoE): rank r keeps the contiguous range
expert_range(E, r, N) of the experts (a copy, so the full stack can be freed), every rank routes
every token over all E experts (the whole router), runs only its experts' slots, and
all_reduce sums the partial outputs; the residual is added by rank 0.
"""

import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from .torch import FusedMLP, _describe
from ._moe import FusedMoE, _describe_moe
from ._patch import _is_mlp_candidate, _is_moe

__all__ = ["TPFusedMLP", "TPFusedMoE", "shard_mlp", "shard_moe", "expert_range", "patch_tp"]

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def _group_info(group):
    import torch.distributed as dist
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call "
                           "dist.init_process_group('nccl') first (torchrun sets the env)")
    return dist.get_rank(group), dist.get_world_size(group)


def shard_mlp(kw: Dict[str, Any], rank: int, size: int) -> Dict[str, Any]:
    """FusedMLP keyword arguments cut down to rank's shard of the hidden units.

    Rank r of N keeps hidden units [r*H/N, (r+1)*H/N): those rows of w1, b1, w_up, b_up, those
    columns of w2; b2 only on rank 0.

    Parameters
    ----------
    kw : dict
        FusedMLP keyword arguments, as fusedmlp.torch._describe gives them (gate and up come
        separately, so rows split directly).
    rank, size : int
        This rank and the group size.

    Returns
    -------
    dict
        The shard's keyword arguments (contiguous copies).

    Raises
    ------
    ValueError
        hidden is not a multiple of size * 8 (the message gives the padded size).
    """
    hidden = int(kw["w2"].shape[1])
    if hidden % (size * 8) != 0:
        pad = -(-hidden // (size * 8)) * size * 8
        raise ValueError(f"hidden {hidden} is not a multiple of size * 8 = {size * 8}; pad it "
                         f"to {pad} (zero rows in W1/up, zero columns in W2)")
    hs = hidden // size
    sl = slice(rank * hs, (rank + 1) * hs)
    out = dict(kw)
    for name in ("w1", "b1", "w_up", "b_up"):
        if out.get(name) is not None:
            out[name] = out[name][sl].contiguous()
    out["w2"] = out["w2"][:, sl].contiguous()
    if rank != 0:
        out["b2"] = None
    return out


class TPFusedMLP(nn.Module):
    """y = all_reduce(mlp_shard(x) [+ residual on rank 0]) over ``group`` (default: WORLD).

    Each rank runs a FusedMLP packed for its GPU on its shard of the hidden units (shard_mlp);
    x must be the same on every rank. Inference only (no backward, no dropout).

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        An NCCL process group (default: WORLD).
    backend : {"auto", "ref", "cpu", "cuda"}
    **kw
        The whole MLP's FusedMLP keyword arguments (dropout is dropped).

    Raises
    ------
    RuntimeError
        torch.distributed is not initialised.
    ValueError
        hidden does not split over the group (see shard_mlp).
    """

    def __init__(self, group=None, backend="auto", **kw):
        super().__init__()
        self.group = group
        self.rank, self.size = _group_info(group)
        kw.pop("dropout", None)
        self.fused = FusedMLP(**shard_mlp(kw, self.rank, self.size), backend=backend)

    @classmethod
    def from_module(cls, module: nn.Module, group: Any = None,
                    backend: str = "auto") -> "TPFusedMLP":
        """The rank's shard of a Hugging Face MLP (the layouts FusedMLP.from_module takes); the
        module's weights should be on this rank's GPU.

        Parameters
        ----------
        module : torch.nn.Module
            The whole (unsharded) MLP, the same on every rank.
        group : torch.distributed.ProcessGroup, optional
            An NCCL process group (default: WORLD).
        backend : {"auto", "ref", "cpu", "cuda"}

        Returns
        -------
        TPFusedMLP

        Raises
        ------
        NotImplementedError
            The module does not fit FusedMLP.
        """
        return cls(group=group, backend=backend, **_describe(module))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The whole MLP's y on every rank.

        Parameters
        ----------
        x : torch.Tensor
            [..., d_in], the same on every rank.
        residual : torch.Tensor, optional
            Added once (by rank 0).

        Returns
        -------
        torch.Tensor
            [..., d_out], summed over the group in place.
        """
        import torch.distributed as dist
        y = self.fused(x, residual if self.rank == 0 else None)
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y

    def extra_repr(self):
        return f"rank {self.rank} of {self.size}: {self.fused.extra_repr()}"


def expert_range(num_experts: int, rank: int, size: int) -> Tuple[int, int]:
    """Rank's contiguous experts of num_experts over size ranks, as fmlp_tp_expert_range.

    Parameters
    ----------
    num_experts, rank, size : int

    Returns
    -------
    first, count : int
        The range [rank*E//size, (rank+1)*E//size) as its first expert and length.

    Raises
    ------
    ValueError
        Fewer experts than ranks.
    """
    if num_experts < size:
        raise ValueError(f"{num_experts} experts cannot be split over {size} ranks; every rank "
                         "needs at least one (use a smaller group for the experts)")
    first = num_experts * rank // size
    return first, num_experts * (rank + 1) // size - first


def shard_moe(kw: Dict[str, Any], rank: int, size: int) -> Dict[str, Any]:
    """FusedMoE keyword arguments cut down to rank's experts.

    w1/b1/w2/b2 are copied (so the whole stack can be freed), first_expert and global_experts
    set, the router kept whole.

    Parameters
    ----------
    kw : dict
        FusedMoE keyword arguments, as fusedmlp._moe._describe_moe gives them.
    rank, size : int

    Returns
    -------
    dict

    Raises
    ------
    ValueError
        Fewer experts than ranks.
    """
    num_experts = int(kw["w1"].shape[0])
    first, count = expert_range(num_experts, rank, size)
    out = dict(kw)
    for name in ("w1", "b1", "w2", "b2"):
        if out.get(name) is not None:
            out[name] = out[name].detach()[first:first + count].clone()
    out.update(first_expert=first, global_experts=num_experts)
    return out


class TPFusedMoE(nn.Module):
    """y = all_reduce(moe over this rank's experts (x) [+ residual on rank 0]) over ``group``.

    x must be bitwise the same on every rank (the routing is recomputed on each rank).
    Inference only.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        An NCCL process group (default: WORLD).
    backend : {"auto", "ref", "cpu", "cuda"}
    **kw
        The whole block's FusedMoE keyword arguments.

    Raises
    ------
    RuntimeError
        torch.distributed is not initialised.
    ValueError
        Fewer experts than ranks.
    """

    def __init__(self, group=None, backend="auto", **kw):
        super().__init__()
        self.group = group
        self.rank, self.size = _group_info(group)
        self.fused = FusedMoE(**shard_moe(kw, self.rank, self.size), backend=backend)

    @classmethod
    def from_module(cls, module: nn.Module, group: Any = None,
                    backend: str = "auto") -> "TPFusedMoE":
        """The rank's experts of a Hugging Face sparse-MoE block (the blocks
        FusedMoE.from_module takes); the block's weights should be on this rank's GPU.

        Parameters
        ----------
        module : torch.nn.Module
            The whole (unsharded) sparse-MoE block, the same on every rank.
        group : torch.distributed.ProcessGroup, optional
            An NCCL process group (default: WORLD).
        backend : {"auto", "ref", "cpu", "cuda"}

        Returns
        -------
        TPFusedMoE

        Raises
        ------
        NotImplementedError
            The block does not fit FusedMoE.
        """
        return cls(group=group, backend=backend, **_describe_moe(module))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """The whole block's y on every rank.

        Parameters
        ----------
        x : torch.Tensor
            [..., d], bitwise the same on every rank.
        residual : torch.Tensor, optional
            Added once (by rank 0).

        Returns
        -------
        torch.Tensor or (torch.Tensor, torch.Tensor)
            y [..., d_out] summed over the group (with the router logits when the wrapped
            block returns them).
        """
        import torch.distributed as dist
        out = self.fused(x, residual if self.rank == 0 else None)
        y = out[0] if isinstance(out, tuple) else out
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def extra_repr(self):
        return f"rank {self.rank} of {self.size}: {self.fused.extra_repr()}"


def patch_tp(model: nn.Module, tp_group: Any = None, backend: str = "auto") -> List[str]:
    """Replaces the MLP and sparse-MoE blocks of a model in place by their shards for this rank.

    Every MLP block becomes its TPFusedMLP shard, every sparse-MoE block FusedMoE takes its
    TPFusedMoE experts; blocks that cannot be fused are left as they are. Every rank must call
    it on an identical model.

    Parameters
    ----------
    model : nn.Module
    tp_group : torch.distributed.ProcessGroup, optional
        Default: WORLD.
    backend : {"auto", "ref", "cpu", "cuda"}

    Returns
    -------
    list of str
        The replaced module names.

    Raises
    ------
    RuntimeError
        torch.distributed is not initialised.
    """
    replaced = []

    def walk(module, prefix):
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if _is_moe(child):
                try:
                    setattr(module, name, TPFusedMoE.from_module(child, tp_group, backend))
                    replaced.append(full)
                except (NotImplementedError, ValueError):
                    pass
                continue
            if _is_mlp_candidate(child):
                try:
                    setattr(module, name, TPFusedMLP.from_module(child, tp_group, backend))
                    replaced.append(full)
                    continue
                except (NotImplementedError, ValueError):
                    pass
            walk(child, full)

    with torch.no_grad():
        walk(model, "")
    return replaced
