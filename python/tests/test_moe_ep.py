"""Expert parallelism of the moe op from Python: fusedmlp.moe(..., first_expert=,
global_experts=) on each range of a partition of the experts sums to the whole op (ref and cpu
backends, router and given routing, the residual passed to one range); the torch op and FusedMoE
carry the range; fusedmlp.tp's expert split; and, on 2 GPUs, TPFusedMoE over an NCCL group of
two processes against the single-GPU FusedMoE (skipped otherwise, with the reason).

Tolerance: each range's output is within rtol * (|ref| + rms) of its own float64 value (as in
test_moe.py), so the f32 sum of P ranges is within P times that of the whole op."""

import os
import tempfile

import numpy as np
import pytest

import fusedmlp
from test_mlp import assert_close, rand
from test_moe import call, make_moe, moe_ref


def ranges_of(counts):
    first, out = 0, []
    for c in counts:
        out.append((first, c))
        first += c
    return out


def range_kw(kw, first, count):
    out = dict(kw)
    for name in ("w1", "b1", "w2", "b2"):
        if out.get(name) is not None:
            out[name] = np.ascontiguousarray(out[name][first:first + count])
    return out


@pytest.mark.parametrize("backend", ["ref", "cpu"])
@pytest.mark.parametrize("routing", ["router", "given", "one_expert"])
@pytest.mark.parametrize("counts", [(3, 5), (1, 1, 1, 1, 1, 1, 1, 1), (7, 1)],
                         ids=["3+5", "8x1", "7+1"])
def test_ranges_sum_to_the_whole_op(backend, routing, counts):
    rng = np.random.default_rng(len(counts) * 10 + len(routing))
    kw = make_moe(rng, t=9, experts=8, top_k=2)
    residual = rand(rng, (9, 40), np.float32)
    if routing != "router":
        del kw["router_w"], kw["router_b"]
        ids = rng.integers(0, 8, (9, 2)) if routing == "given" else np.full((9, 2), 7)
        kw.update(topk_ids=ids.astype(np.int32), topk_weights=rng.random((9, 2), np.float32))
    whole = moe_ref(**kw, residual=residual)
    total = np.zeros_like(whole)
    for i, (first, count) in enumerate(ranges_of(counts)):
        y = call(range_kw(kw, first, count), residual=residual if i == 0 else None,
                 first_expert=first, global_experts=8, backend=backend)
        total += y
    rtol = 1e-4 * len(counts)
    assert_close(total, whole, rtol=rtol)


@pytest.mark.parametrize("change,words", [
    (dict(first_expert=-1), "config.first_expert is -1"),
    (dict(first_expert=5, global_experts=8), "exceeds the global expert count 8"),
    (dict(first_expert=0, global_experts=6), "router_w"),
    (dict(global_experts=-2), "config.global_experts is -2"),
])
def test_bad_range_names_the_field(change, words):
    rng = np.random.default_rng(2)
    kw = make_moe(rng, t=3, experts=4, top_k=2)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(")):
        call(kw, **change)


def test_given_ids_are_checked_against_the_global_count():
    rng = np.random.default_rng(3)
    kw = make_moe(rng, t=3, experts=4, top_k=2)
    del kw["router_w"], kw["router_b"]
    ids = np.array([[0, 5], [6, 2], [3, 4]], np.int32)  # experts [2, 6) of 8: 0, 6, 7 remote
    wts = np.ones((3, 2), np.float32)
    call(kw, topk_ids=ids, topk_weights=wts, first_expert=2, global_experts=8)
    ids[1, 0] = 8
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        call(kw, topk_ids=ids, topk_weights=wts, first_expert=2, global_experts=8)


def _torch():
    return pytest.importorskip("torch")


def test_torch_op_and_fused_moe_carry_the_range():
    torch = _torch()
    import fusedmlp.torch as ft
    from fusedmlp.tp import expert_range, shard_moe
    g = torch.Generator().manual_seed(4)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    kw = dict(w1=r(8, 48, 32, scale=32**-0.5), w2=r(8, 32, 24, scale=24**-0.5),
              router_w=r(8, 32, scale=0.3), b2=r(8, 32, scale=0.1), top_k=2)
    x, residual = r(2, 3, 32), r(2, 3, 32)
    whole = ft.FusedMoE(**kw).eval()(x, residual)
    for size in (1, 2, 3, 8):
        total = torch.zeros_like(whole)
        for rank in range(size):
            first, count = expert_range(8, rank, size)
            part = shard_moe(kw, rank, size)
            assert part["first_expert"] == first and part["w1"].shape[0] == count
            m = ft.FusedMoE(**part).eval()
            assert f"experts [{first}, {first + count}) of 8" in m.extra_repr()
            total += m(x, residual if rank == 0 else None)
        torch.testing.assert_close(total, whole, rtol=1e-4 * size, atol=1e-5 * size)
    part = shard_moe(kw, 1, 2)
    torch.library.opcheck(torch.ops.fusedmlp.moe.default, (x, part["w1"], part["w2"], 2),
                          dict(router_w=kw["router_w"], b2=part["b2"], first_expert=4,
                               global_experts=8))
    with pytest.raises(ValueError, match="cannot be split over 9 ranks"):
        expert_range(8, 0, 9)


_WORKER = r'''
import os, sys, torch, torch.distributed as dist
sys.path[:0] = [{site!r}]
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
import fusedmlp.torch as ft
from fusedmlp.tp import TPFusedMoE
rank = int(sys.argv[1])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", init_method="file://" + {store!r}, rank=rank, world_size=2)
g = torch.Generator().manual_seed(5)
def r(*shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to("cuda", torch.bfloat16)
kw = dict(w1=r(8, 512, 256, scale=256**-0.5), w2=r(8, 256, 256, scale=256**-0.5),
          router_w=r(8, 256, scale=0.3), top_k=2)
worst = 0.0
for t in (1, 16, 300):
    x, res = r(t, 256), r(t, 256)
    single = ft.FusedMoE(**kw).eval()
    tp = TPFusedMoE(**kw).eval()
    keep = single.routing_margin(x) > 1e-2  # rows whose routing is unambiguous in bf16
    a, b = tp(x, res).float(), single(x, res).float()
    rms = b.pow(2).mean(dim=-1, keepdim=True).sqrt()
    err = ((a - b).abs() / (b.abs() + rms))[keep]
    worst = max(worst, float(err.max()) if err.numel() else 0.0)
dist.destroy_process_group()
assert worst <= 2**-6, f"rank {{rank}}: worst relative error {{worst}}"
'''


def test_tp_fused_moe_two_gpus():
    torch = _torch()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (TPFusedMoE over an NCCL group of two processes)")
    if not torch.distributed.is_nccl_available():
        pytest.skip("torch.distributed has no NCCL backend")
    import subprocess
    import sys
    site = os.path.dirname(os.path.dirname(os.path.abspath(fusedmlp.__file__)))
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "worker.py")
        with open(script, "w") as f:
            f.write(_WORKER.format(site=site, store=os.path.join(d, "store")))
        env = dict(os.environ, NCCL_NVLS_ENABLE="0")
        procs = [subprocess.Popen([sys.executable, script, str(r)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(2)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}:\n{out}"
