"""End-to-end decode with and without fusedmlp.patch: tokens/s of bs=1 greedy decode with a static
KV cache on randomly initialised Hugging Face models built from configs (nothing is downloaded).

Models: GPT-2 small (GPT2Config defaults), a ~1B Llama (hidden 2048, intermediate 8192,
16 layers, 32 heads, 8 KV heads) and a small Mixtral (hidden 2048, 8 experts of 4096, top-2,
8 layers; --models mixtral-small), bf16 on one CUDA device. gpt2-tiny, llama-tiny and
mixtral-tiny (hidden 256, 4 layers) are for the host: --device cpu runs the eager mode only
(graph needs CUDA; generate would compile with inductor), where host time per call decides.

Variants (--patch): the unpatched model, then "mlp" = fusedmlp.patch(model) (MLP blocks and their
pre-norm) and "mlp+linears" = fusedmlp.patch(model, linears=True) (also the attention projections
and the LM head as FusedLinear), each on a fresh copy of the same model (same seed).

Modes, each run identically for the unpatched model and every variant:
  generate  model.generate(cache_implementation="static"): transformers compiles the decode step
            (torch.compile, CUDA graphs) by itself. tokens/s = (N - 1) / (t(N) - t(1)), so the
            prefill and the first token are left out; median of --repeats (--stat).
  graph     a manual loop: one decode step (forward, argmax, position + 1) captured once in a
            CUDA graph over a StaticCache, replayed N times; best effort across transformers
            versions (the failure is recorded, not raised).
  eager     the same manual loop without the graph (Python and launch overhead included).

Check: logits of an eager prefill forward, patched against unpatched (max |diff| / rms of the
row), and how many generated tokens agree (random weights give near-ties, so a late divergence
is not an error). The same diff is measured for a second oracle, the unpatched model with its MLP
blocks run in fp32 (more exact math, no fusedmlp): the patched diff is judged against that
"reference noise", the spread bf16 rounding alone causes (in MoE models one flipped near-tie
routing decision moves a whole position's logits; the noise oracle keeps the attention in bf16, so
it understates what mlp+linears may move). JSON to --json: per model the "mlp" variant in the
top-level fields (patch, patched, speedup, ...) and "mlp+linears" under "patched_linears" (the
same fields), with its speedups also as "speedup_linears".

Usage (GPU machine): python3 bench/e2e_decode.py --json out/e2e.json [--models gpt2,llama1b]
[--patch mlp,mlp+linears] [--modes eager] ; on the host: python3 bench/e2e_decode.py --device cpu
--dtype float32 --models gpt2-tiny,llama-tiny,mixtral-tiny --modes eager --threads 1 --interleave
"""

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time
import traceback


def _configs(transformers):
    return {
        "gpt2": lambda: transformers.GPT2Config(),
        "llama1b": lambda: transformers.LlamaConfig(
            hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
            max_position_embeddings=4096),
        # A small Mixtral: 8 experts, top-2, the ~1B Llama's attention and width.
        "mixtral-small": lambda: transformers.MixtralConfig(
            hidden_size=2048, intermediate_size=4096, num_hidden_layers=8,
            num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
            num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=4096),
        # Host-sized models of the same architectures (--device cpu).
        "gpt2-tiny": lambda: transformers.GPT2Config(n_embd=256, n_layer=4, n_head=4,
                                                     vocab_size=4096, n_positions=512,
                                                     bos_token_id=0, eos_token_id=0),
        "llama-tiny": lambda: transformers.LlamaConfig(
            hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=4096, max_position_embeddings=512),
        "mixtral-tiny": lambda: transformers.MixtralConfig(
            hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=4096,
            max_position_embeddings=512),
    }


_MODEL_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama1b": "LlamaForCausalLM",
                  "mixtral-small": "MixtralForCausalLM", "gpt2-tiny": "GPT2LMHeadModel",
                  "llama-tiny": "LlamaForCausalLM", "mixtral-tiny": "MixtralForCausalLM"}
_DTYPE = ["bfloat16"]  # --dtype


def _sync(torch, device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _empty_cache(torch):
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build(transformers, torch, name, device):
    cfg = _configs(transformers)[name]()
    cls = getattr(transformers, _MODEL_CLASSES[name])
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg)
    model = model.to(getattr(torch, _DTYPE[0])).eval()
    model.generation_config.pad_token_id = 0
    return model


def reference_noise(torch, model, ids, ref_logits):
    """max |diff| / rms of the row between the model and a copy whose MLP blocks compute in fp32."""
    import copy

    class Fp32Block(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block.float()

        def forward(self, x, *args, **kwargs):
            y = self.block(x.float(), *args, **kwargs)
            return tuple(v.to(x.dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                         for v in y) if isinstance(y, tuple) else y.to(x.dtype)

    exact = copy.deepcopy(model)
    for name, mod in list(exact.named_modules()):
        if name.endswith(".mlp"):
            parent, _, leaf = name.rpartition(".")
            setattr(exact.get_submodule(parent), leaf, Fp32Block(mod))
    with torch.no_grad():
        logits = exact(input_ids=ids).logits.float()
    del exact
    _empty_cache(torch)
    rms = ref_logits.pow(2).mean(-1, keepdim=True).sqrt()
    return ((logits - ref_logits).abs() / rms).max().item()


_STAT = [statistics.median]  # --stat


def timed(torch, fn, repeats, device="cuda"):
    times = []
    for _ in range(repeats):
        _sync(torch, device)
        t0 = time.perf_counter()
        fn()
        _sync(torch, device)
        times.append(time.perf_counter() - t0)
    return _STAT[0](times)


def run_generate(torch, model, ids, n, repeats):
    def gen(k):
        return model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                              cache_implementation="static")
    with torch.no_grad():
        for _ in range(2):  # compile + CUDA-graph recording happen here
            out = gen(n)
        t_n = timed(torch, lambda: gen(n), repeats)
        t_1 = timed(torch, lambda: gen(1), repeats)
    return {"tok_s": (n - 1) / (t_n - t_1), "ms_per_token": 1e3 * (t_n - t_1) / (n - 1),
            "t_n_s": t_n, "t_1_s": t_1}, out[0, ids.shape[1]:].tolist()


def _forward_kwargs(model, cache, ids, pos):
    params = inspect.signature(model.forward).parameters
    kw = {"input_ids": ids, "use_cache": True, "position_ids": pos.view(1, -1)}
    kw["cache" if "cache" in params else "past_key_values"] = cache
    if "cache_position" in params:
        kw["cache_position"] = pos
    return kw


def _rewind(torch, cache, length):
    """Sets the cache's fill level back to `length` where the cache counts it itself
    (transformers >= 5.2x: a device tensor per layer, updated in place, so graphs see it)."""
    for layer in getattr(cache, "layers", []):
        n = getattr(layer, "cumulative_length", None)
        if isinstance(n, torch.Tensor):
            n.fill_(length)
        elif isinstance(n, int):
            layer.cumulative_length = length


def prepare_loop(torch, transformers, model, ids, n, use_graph):
    """Greedy decode of n tokens over a StaticCache, one step captured in a CUDA graph (or
    replayed eagerly), with the argmax and the position update inside the step: (decode, tokens)
    where decode() runs the n steps (warmed up once here) and tokens() lists what they made."""
    dev = ids.device
    p = ids.shape[1]
    cache = transformers.StaticCache(config=model.config, max_cache_len=p + n + 1)
    with torch.no_grad():
        pos = torch.arange(p, device=dev)
        logits = model(**_forward_kwargs(model, cache, ids, pos)).logits
        tok = logits[:, -1:].argmax(-1)
        static_ids = tok.clone()
        static_pos = torch.full((1,), p, device=dev, dtype=torch.long)
        tokens = torch.zeros(n + 1, dtype=torch.long, device=dev)

        def step():
            out = model(**_forward_kwargs(model, cache, static_ids, static_pos)).logits
            nxt = out[:, -1:].argmax(-1)
            tokens.index_copy_(0, static_pos - p, nxt.view(1))
            static_ids.copy_(nxt)
            static_pos.add_(1)

        start_ids, start_pos = static_ids.clone(), static_pos.clone()
        if use_graph:
            if dev.type != "cuda":
                raise RuntimeError("graph mode needs a CUDA device (a captured CUDA graph)")
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run_step = graph.replay
        else:
            run_step = step

    def decode():
        with torch.no_grad():
            static_ids.copy_(start_ids)
            static_pos.copy_(start_pos)
            _rewind(torch, cache, p)
            for _ in range(n):
                run_step()

    decode()  # warm-up
    # The cache is overwritten in place on every run (same positions, same tokens), so the
    # generated sequence is the same each time.
    return decode, lambda: [tok.item()] + tokens[:n - 1].tolist()


def loop_result(t, n):
    return {"tok_s": n / t, "ms_per_token": 1e3 * t / n}


def run_loop(torch, transformers, model, ids, n, use_graph, repeats):
    decode, tokens = prepare_loop(torch, transformers, model, ids, n, use_graph)
    return loop_result(timed(torch, decode, repeats, ids.device), n), tokens()


def measure(torch, transformers, model, ids, n, modes, repeats, pending=None):
    """{mode: result} and {mode: tokens}. With `pending` (a list; --interleave) the eager and
    graph loops are only prepared and appended there, for time_pending to time and fill in."""
    results, tokens = {}, {}
    for mode in modes:
        torch._dynamo.reset()
        # transformers recompiles only when the attribute is absent (get_compiled_call), and the
        # patched model must not reuse the unpatched model's compiled forward.
        if hasattr(model, "_compiled_call"):
            del model._compiled_call
        try:
            if mode == "generate":
                results[mode], tokens[mode] = run_generate(torch, model, ids, n, repeats)
            elif pending is not None:
                decode, made = prepare_loop(torch, transformers, model, ids, n, mode == "graph")
                pending.append((results, tokens, mode, decode, made))
            else:
                results[mode], tokens[mode] = run_loop(torch, transformers, model, ids, n,
                                                       mode == "graph", repeats)
        except Exception as e:  # recorded: one failing mode must not hide the others
            results[mode] = {"error": f"{type(e).__name__}: {e}",
                             "trace": traceback.format_exc(limit=6)[-1500:]}
        _sync(torch, ids.device)
    return results, tokens


def time_pending(torch, pending, n, repeats, device):
    """Times the prepared loops round-robin, repeat after repeat (a change of load on a shared
    machine then hits every variant alike), and fills in their results and tokens."""
    times = [[] for _ in pending]
    for _ in range(repeats):
        for i, (_, _, _, decode, _) in enumerate(pending):
            _sync(torch, device)
            t0 = time.perf_counter()
            decode()
            _sync(torch, device)
            times[i].append(time.perf_counter() - t0)
    for (results, tokens, mode, _, made), ts in zip(pending, times):
        results[mode] = loop_result(_STAT[0](ts), n)
        tokens[mode] = made()
    pending.clear()


_VARIANTS = {"mlp": {}, "mlp+linears": {"linears": True}}


def run_variant(torch, transformers, fusedmlp, name, variant, args, modes, ids, ref_logits,
                pending=None):
    """Builds the model afresh, patches it the variant's way and measures it like the unpatched
    one (with `pending`, prepares its loops there): the fields of one variant's JSON entry, the
    timings and tokens still to be compared by finish_variant."""
    model = build(transformers, torch, name, ids.device)
    with torch.no_grad():  # the diff below is the patch's only if the build repeats exactly
        rebuilt = torch.equal(model(input_ids=ids).logits.float(), ref_logits)
    patch_report = fusedmlp.patch(model, strict=True, mode=args.patch_mode, **_VARIANTS[variant])
    print(f"  [{variant}] {patch_report}", flush=True)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    rms = ref_logits.pow(2).mean(-1, keepdim=True).sqrt()
    rel = ((logits - ref_logits).abs() / rms).max().item()
    fused, fused_tokens = measure(torch, transformers, model, ids, args.new_tokens, modes,
                                  args.repeats, pending)
    del model
    _empty_cache(torch)
    entry = {"patch": str(patch_report), "patched": fused, "logits_max_abs_diff_over_rms": rel,
             "rebuild_identical": rebuilt,
             "argmax_agree_prefill": bool((logits[:, -1].argmax(-1)
                                           == ref_logits[:, -1].argmax(-1)).all())}
    return entry, fused_tokens


def finish_variant(variant, entry, fused_tokens, base, base_tokens, modes):
    fused = entry["patched"]
    print(f"  [{variant}] patched {json.dumps(fused)[:400]}", flush=True)
    entry["tokens_agree"] = {m: agreement(base_tokens[m], fused_tokens[m])
                             for m in base_tokens if m in fused_tokens}
    entry["speedup"] = {m: fused[m]["tok_s"] / base[m]["tok_s"] for m in modes
                        if "tok_s" in base.get(m, {}) and "tok_s" in fused.get(m, {})}
    print(f"  [{variant}] speedup {entry['speedup']}  logits diff/rms "
          f"{entry['logits_max_abs_diff_over_rms']:.3g}  tokens agree {entry['tokens_agree']}",
          flush=True)
    return entry


def agreement(a, b):
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,llama1b")
    ap.add_argument("--modes", default="generate,graph,eager")
    ap.add_argument("--patch", default="mlp,mlp+linears",
                    help="patched variants to measure: " + ", ".join(_VARIANTS))
    ap.add_argument("--patch-mode", default="always", choices=["always", "eager", "graph"],
                    help="fusedmlp.patch(mode=...): 'eager' / 'graph' keep the original modules "
                         "where the fused ones are not faster in that mode")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cuda (the GPU runs) or cpu (eager only)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--interleave", action="store_true",
                    help="build every variant first, then time the eager/graph loops of the "
                         "unpatched model and the variants round-robin (for a shared machine; "
                         "all copies of the model are alive at once)")
    ap.add_argument("--stat", default="median", choices=["median", "min"],
                    help="of the --repeats timings (min on a shared machine: the other runs "
                         "time the neighbours too)")
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS (host runs: torch's and fusedmlp's OpenMP runtimes "
                         "spin against each other on few cores; bench/host_overhead.py)")
    args = ap.parse_args()
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    _DTYPE[0] = args.dtype
    _STAT[0] = min if args.stat == "min" else statistics.median

    import torch
    report = {"python": platform.python_version(), "torch": torch.__version__,
              "new_tokens": args.new_tokens, "patch_mode": args.patch_mode,
              "prompt_len": args.prompt_len, "batch": 1,
              "dtype": args.dtype, "device": args.device, "threads": args.threads,
              "stat": args.stat, "repeats": args.repeats, "interleave": args.interleave,
              "models": {}}
    try:
        import transformers
        report["transformers"] = transformers.__version__
    except ImportError as e:
        report["transformers"] = None
        report["skipped"] = f"transformers is not installed ({e}); carry it as a wheel"
    import fusedmlp
    import fusedmlp.torch as ft
    report["fusedmlp"] = fusedmlp.build_info()
    report["ops_implementation"] = (ft.ops_implementation() if hasattr(ft, "ops_implementation")
                                    else "python")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            report["skipped"] = "no CUDA device"
        else:
            report["gpu"] = torch.cuda.get_device_name(0)
    else:
        report["cpu"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if "skipped" in report:
        print(json.dumps(report, indent=1))
        return _write(args.json, report)

    modes = [m for m in args.modes.split(",") if m]
    variants = [v for v in args.patch.split(",") if v]
    unknown = [v for v in variants if v not in _VARIANTS]
    if unknown:
        ap.error(f"--patch {','.join(unknown)}: expected some of {', '.join(_VARIANTS)}")
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device(args.device)
    for name in args.models.split(","):
        print(f"== {name}", flush=True)
        model = build(transformers, torch, name, dev)
        ids = torch.randint(100, 1000, (1, args.prompt_len), device=dev,
                            generator=torch.Generator(dev).manual_seed(1))
        with torch.no_grad():
            ref_logits = model(input_ids=ids).logits.float()
        noise = reference_noise(torch, model, ids, ref_logits)
        print(f"  reference noise (MLP blocks in fp32, no fusedmlp) diff/rms {noise:.3g}",
              flush=True)
        pending = [] if args.interleave else None
        base, base_tokens = measure(torch, transformers, model, ids, args.new_tokens, modes,
                                    args.repeats, pending)
        entry = {"params": sum(p.numel() for p in model.parameters()), "unpatched": base,
                 "reference_noise_diff_over_rms": noise}
        del model  # each variant patches a fresh build (the same seed: the same weights)
        _empty_cache(torch)
        done = {}
        for variant in variants:
            try:
                done[variant] = run_variant(torch, transformers, fusedmlp, name, variant, args,
                                            modes, ids, ref_logits, pending)
            except Exception as e:  # recorded: the other variant's numbers still count
                done[variant] = ({"error": f"{type(e).__name__}: {e}",
                                  "trace": traceback.format_exc(limit=6)[-1500:]}, None)
                print(f"  [{variant}] failed: {done[variant][0]['error']}", flush=True)
                _empty_cache(torch)
        if pending:
            time_pending(torch, pending, args.new_tokens, args.repeats, dev)
        print(f"  unpatched {json.dumps(base)[:400]}", flush=True)
        for variant, (fields, fused_tokens) in done.items():
            if fused_tokens is not None:
                fields = finish_variant(variant, fields, fused_tokens, base, base_tokens, modes)
            if variant == "mlp":  # the fields of the MLP-only patch stay where they were
                entry.update(fields)
            else:
                entry["patched_linears"] = fields
                entry["speedup_linears"] = fields.get("speedup", {})
        report["models"][name] = entry
    _write(args.json, report)


def _write(path, report):
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
