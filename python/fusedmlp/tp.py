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


def shard_mlp(kw, rank, size):
    """FusedMLP keyword arguments (as _describe gives them) cut down to rank's shard. Stacked
    gate/up are not used by _describe (gate and up come separately), so rows split directly."""
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
    """y = all_reduce(mlp_shard(x) [+ residual on rank 0]) over `group` (default: WORLD).

    forward(x[, residual]) -> y on every rank. Inference only (no backward, no dropout).
    """

    def __init__(self, group=None, backend="auto", **kw):
        super().__init__()
        self.group = group
        self.rank, self.size = _group_info(group)
        kw.pop("dropout", None)
        self.fused = FusedMLP(**shard_mlp(kw, self.rank, self.size), backend=backend)

    @classmethod
    def from_module(cls, module, group=None, backend="auto"):
        """The rank's shard of a Hugging Face MLP (the layouts FusedMLP.from_module takes); the
        module's weights should be on this rank's GPU."""
        return cls(group=group, backend=backend, **_describe(module))

    def forward(self, x, residual=None):
        import torch.distributed as dist
        y = self.fused(x, residual if self.rank == 0 else None)
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y

    def extra_repr(self):
        return f"rank {self.rank} of {self.size}: {self.fused.extra_repr()}"


def expert_range(num_experts, rank, size):
    """(first, count): rank's contiguous experts of num_experts over size ranks,
    [rank*E//size, (rank+1)*E//size) (as fmlp_tp_expert_range)."""
    if num_experts < size:
        raise ValueError(f"{num_experts} experts cannot be split over {size} ranks; every rank "
                         "needs at least one (use a smaller group for the experts)")
    first = num_experts * rank // size
    return first, num_experts * (rank + 1) // size - first


def shard_moe(kw, rank, size):
    """FusedMoE keyword arguments (as _describe_moe gives them) cut down to rank's experts:
    w1/b1/w2/b2 copied (so the whole stack can be freed), first_expert and global_experts set,
    the router whole."""
    num_experts = int(kw["w1"].shape[0])
    first, count = expert_range(num_experts, rank, size)
    out = dict(kw)
    for name in ("w1", "b1", "w2", "b2"):
        if out.get(name) is not None:
            out[name] = out[name].detach()[first:first + count].clone()
    out.update(first_expert=first, global_experts=num_experts)
    return out


class TPFusedMoE(nn.Module):
    """y = all_reduce(moe over this rank's experts (x) [+ residual on rank 0]) over `group`
    (default: WORLD). x must be bitwise the same on every rank (the routing is recomputed on
    each rank). forward(x[, residual]) -> y (and the router logits, when the wrapped block
    returned them) on every rank. Inference only."""

    def __init__(self, group=None, backend="auto", **kw):
        super().__init__()
        self.group = group
        self.rank, self.size = _group_info(group)
        self.fused = FusedMoE(**shard_moe(kw, self.rank, self.size), backend=backend)

    @classmethod
    def from_module(cls, module, group=None, backend="auto"):
        """The rank's experts of a Hugging Face sparse-MoE block (the blocks FusedMoE.from_module
        takes); the block's weights should be on this rank's GPU."""
        return cls(group=group, backend=backend, **_describe_moe(module))

    def forward(self, x, residual=None):
        import torch.distributed as dist
        out = self.fused(x, residual if self.rank == 0 else None)
        y = out[0] if isinstance(out, tuple) else out
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def extra_repr(self):
        return f"rank {self.rank} of {self.size}: {self.fused.extra_repr()}"


def patch_tp(model, tp_group=None, backend="auto"):
    """Replaces every MLP block of `model` (in place) by its TPFusedMLP shard for this rank, and
    every sparse-MoE block FusedMoE takes by its TPFusedMoE experts, and returns the list of
    replaced module names. Blocks that cannot be fused are left as they are. Every rank must
    call it on an identical model."""
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
