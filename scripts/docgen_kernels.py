"""The op table as docs/kernels.md shows it (scripts/gen_docs.py renders the page).

The entries, their backends and their order are read from the source: the OpKernel initializers
of src/cuda/<op>/table.cpp, src/cpu/<op>.cpp and src/ref/<op>.cpp, in the order dispatch asks
them (cuda, cpu, ref; within a backend, table order). What an entry takes (dtypes, token range,
architecture) lives in its supports() function, which cannot be enumerated without a device, so
it is described below, one record per entry. The token bounds are not written here: `{NAME}` in a
record is the value of `constexpr ... NAME = ...;` read from the entry's source files, so the page
follows the code. gen_docs.py fails when an entry of the table has no record here, when a record
names no entry, or when a constant cannot be found.
"""

import os
import re

OPS = ("mlp", "linear", "softmax", "moe")
BACKENDS = ("cuda", "cpu", "ref")  # the order of every op's lists() (core/op_table.hpp)

# Per entry: the files its constants come from (first is the implementation), weights, x,
# tokens, architecture, when dispatch takes it, and one line of how.
ENTRIES = {
    # ---- mlp -------------------------------------------------------------------------------
    "mlp_decode_sm80_stream": dict(
        src=["src/cuda/mlp/decode_sm80_stream.cu"],
        w="bf16, f16, e4m3", x="any (e4m3 weights: bf16, f16)",
        m="1..{kMaxTokens} (x and h within {kMaxStageBytes:KiB} of shared memory); any sizes on "
          "packed weights",
        arch="sm_80+",
        when="planner: first below the crossover (M <= 4)",
        how="two memory-order weight streams (up: W1 with bias, activation, gating; down: W2 with "
            "b2, residual), h through the workspace in 16 bits, programmatic dependent launch"),
    "mlp_decode_sm80_prefetch": dict(
        src=["src/cuda/mlp/decode_sm80_prefetch.cu"],
        w="bf16, f16", x="any", m="1..{kMaxTokens}", arch="sm_80+",
        when="table order where the stream declines; not in deterministic mode",
        how="one launch: each block copies its hidden slice of W1 and W2 into shared memory with "
            "cp.async at entry, fp32 partial outputs reduced by the last block"),
    "mlp_decode_sm80_gemv": dict(
        src=["src/cuda/mlp/decode_sm80_gemv.cu"],
        w="bf16, f16", x="any", m="{kMaxTokens}", arch="sm_80+",
        when="table order where the entries before it decline; not in deterministic mode",
        how="one launch on the CUDA cores: split hidden slices, register-streamed W1 rows, then "
            "the matching W2 columns, red.global.add, last block finishes"),
    "mlp_decode_sm90_cluster": dict(
        src=["src/cuda/mlp/decode_sm90_cluster.cu"],
        w="bf16, f16 (x's dtype), e4m3", x="bf16, f16", m="1..{kMaxTokens}", arch="sm_90",
        when="table order below the crossover past the streams (M > 4); not in deterministic mode",
        how="one launch on mma.sync, weights as the A operand straight from global memory, "
            "clusters of blocks sharing their hidden slices through distributed shared memory"),
    "mlp_decode_sm90_wgmma_fp8": dict(
        src=["src/cuda/mlp/decode_sm90_wgmma_fp8.cu", "src/cuda/engines/stream_wgmma_fp8.cuh"],
        w="e4m3", x="bf16, f16", m="1..{kWgMaxTokens}", arch="sm_90a",
        when="by name, or where no earlier entry takes the call",
        how="two TMA + wgmma weight streams multiplying e4m3 directly, x and h split exactly into "
            "two e4m3 parts"),
    "mlp_decode_sm80_mma_streamk": dict(
        src=["src/cuda/mlp/decode_sm80_mma_streamk.cu"],
        w="bf16, f16 (x's dtype), e4m3 (sm_89+)", x="bf16, f16",
        m="1..{kMaxTokens}; any sizes on packed weights",
        arch="sm_80+",
        when="pack-time timing or by name; table order where the entries before it decline",
        how="two stream-K tensor-core weight streams (engines/mma_streamk.cuh), each weight read "
            "once for all tokens"),
    "mlp_decode_sm90_splitk": dict(
        src=["src/cuda/mlp/decode_sm90_splitk.cu"],
        w="f32, f16, bf16, e4m3 (sm_89+)", x="f32, f16, bf16", m="1..{kMaxTokens}",
        arch="sm_80+",
        when="what the others refuse: f32, odd sizes of unpacked weights, misaligned views, "
             "deterministic mode",
        how="one launch, tensor cores with hi + lo bf16 splits (fp32-grade accuracy), "
            "per-tile counters"),
    "mlp_prefill_sm90_cublaslt": dict(
        src=["src/cuda/mlp/prefill_sm90_cublaslt.cu", "src/cuda/mlp/prefill_sm90_cublaslt_fp8.cu"],
        w="f32, f16, bf16 (x's dtype); e4m3 (W8A8, sm_89+)", x="f32, f16, bf16 (e4m3: bf16, f16)",
        m="any", arch="sm_80+",
        when="planner: from the crossover M",
        how="two cuBLASLt GEMMs around a norm pass and one bias + activation + gating pass; e4m3 "
            "weights quantise x and h per token (W8A8)"),
    "mlp_cpu_avx2_decode": dict(
        src=["src/cpu/mlp_decode.cpp", "src/cpu/mlp_common.hpp"],
        w="f32, f16, bf16, e4m3", x="f32, f16, bf16", m="1..{kDecodeMaxM}",
        arch="x86-64 AVX2 + FMA + F16C", when="first on the host",
        how="each weight matrix read once for all rows: threads own weight-row slices, 4-row "
            "groups dotted with every x row while in L1"),
    "mlp_cpu_avx2_blocked": dict(
        src=["src/cpu/mlp_blocked.cpp"],
        w="f32, f16, bf16, e4m3", x="f32, f16, bf16", m="any",
        arch="x86-64 AVX2 + FMA + F16C", when="larger M",
        how="two GotoBLAS-style GEMMs (6x16 micro-kernel) with fused epilogues"),
    "mlp_ref_scalar_fp64": dict(
        src=["src/ref/mlp.cpp"], w="all", x="all", m="any", arch="any host",
        when="by name, or backend ref", how="scalar loops in fp64: the oracle every test uses"),
    # ---- linear ----------------------------------------------------------------------------
    "linear_sm90_cublaslt": dict(
        src=["src/cuda/linear/sm90_cublaslt.cpp"],
        w="bf16, f16 (x's dtype)", x="bf16, f16", m="any", arch="sm_80+",
        when="16-bit M >= 2 (table order), two measured M = 1 shapes",
        how="one cuBLASLt GEMM with the bias in its epilogue"),
    "linear_sm80_mma": dict(
        src=["src/cuda/linear/sm80_mma.cu"],
        w="bf16, f16 (x's dtype); e4m3 (sm_89+, also W8A8)", x="bf16, f16, e4m3",
        m="2..{kMaxTokens} (e4m3: 1..{kMaxTokens}); any K on 16-byte aligned (padded) W rows",
        arch="sm_80+",
        when="fp8 weights at M <= 64 the stream does not take; 16-bit M = 2..64 cuBLASLt "
             "declines (x or y rows of odd length)",
        how="one pass over W for all tokens on mma.sync, W as the A operand from global memory"),
    "linear_sm90_cublaslt_fp8": dict(
        src=["src/cuda/linear/sm90_cublaslt_fp8.cpp"],
        w="e4m3", x="e4m3 (W8A8, x_scale)", m="any", arch="sm_89+",
        when="W8A8 beyond the tensor-core entry",
        how="one cuBLASLt fp8 GEMM with per-row (outer-vector) or per-tensor scales"),
    "linear_sm80_stream": dict(
        src=["src/cuda/linear/sm80_stream.cu"],
        w="bf16, f16, e4m3", x="any (e4m3 weights: bf16, f16)",
        m="1..{kMaxTokens} (staged x within {kMaxXsBytes:KiB}); any K on 16-byte aligned (padded) "
          "W rows",
        arch="sm_80+",
        when="planner: M = 1 wherever it runs; M = 2..4 where measured faster",
        how="memory-order stream over W (engines/stream_gemv.cuh), programmatic dependent launch"),
    "linear_sm90_wgmma_fp8": dict(
        src=["src/cuda/linear/sm90_wgmma_fp8.cu", "src/cuda/engines/stream_wgmma_fp8.cuh"],
        w="e4m3", x="bf16, f16", m="1..{kWgMaxTokens}", arch="sm_90a",
        when="by name (FMLP_LINEAR_KERNEL)",
        how="TMA + wgmma weight stream multiplying e4m3 without widening"),
    "linear_sm80_gemv": dict(
        src=["src/cuda/linear/sm80_gemv.cu"],
        w="all", x="all", m="any", arch="sm_80+",
        when="everything else (mixed dtypes, f32, misaligned W: odd K stored back to back; "
             "explain's note says to pad the row stride)",
        how="warp-per-row GEMV on the CUDA cores, x tiles of 8 rows, deterministic split-K"),
    "linear_cpu_avx2_gemv": dict(
        src=["src/cpu/linear.cpp"], w="f32, f16, bf16, e4m3", x="f32, f16, bf16, e4m3",
        m="any", arch="x86-64 AVX2 + FMA + F16C", when="backend cpu",
        how="threads own W-row slices, 4-row groups dotted with x blocks while in L1"),
    "linear_ref_scalar_fp64": dict(
        src=["src/ref/linear.cpp"], w="all", x="all", m="any", arch="any host",
        when="by name, or backend ref", how="fp64 loops"),
    # ---- softmax ---------------------------------------------------------------------------
    "softmax_sm80_ticket": dict(
        src=["src/cuda/softmax/sm80_ticket.cu"], w="-", x="f32, f16, bf16",
        m="up to {kMaxRows} rows of {kMinRowBytes:KiB} or more", arch="sm_80+",
        when="first that takes the call (table order)",
        how="one launch over the whole GPU, parts taken as tickets, each part kept in registers"),
    "softmax_sm90_cluster": dict(
        src=["src/cuda/softmax/sm90_cluster.cu"], w="-", x="f32, f16, bf16",
        m="rows of {kClusterMinRowBytes:KiB} and up", arch="sm_90",
        when="first that takes the call",
        how="each row over a thread-block cluster, parts in shared memory, (max, sum) pairs "
            "exchanged by st.async; blocks prefetch ahead into L2"),
    "softmax_sm80_warp_rows": dict(
        src=["src/cuda/softmax/sm80_warp_rows.cu"], w="-", x="f32, f16, bf16",
        m="rows of up to {kWarpRowsMaxBytes} bytes (whole 16-byte vectors)", arch="sm_80+",
        when="first that takes the call", how="one warp per row held in registers"),
    "softmax_sm80_rows": dict(
        src=["src/cuda/softmax/sm80_rows.cu"], w="-", x="f32, f16, bf16", m="any",
        arch="sm_80+", when="the rest",
        how="a block per row (online max/sum), or few long rows over many blocks in two "
            "launches"),
    "softmax_cpu_avx2_chunked": dict(
        src=["src/cpu/softmax.cpp"], w="-", x="f32, f16, bf16", m="any",
        arch="x86-64 AVX2 + FMA + F16C", when="backend cpu",
        how="fixed chunks per row combined in chunk order (thread-count independent)"),
    "softmax_ref_scalar_fp64": dict(
        src=["src/ref/softmax.cpp"], w="-", x="all", m="any", arch="any host",
        when="by name, or backend ref", how="fp64 loops"),
    # ---- moe -------------------------------------------------------------------------------
    "moe_sm80_stream": dict(
        src=["src/cuda/moe/sm80_stream.cu", "src/cuda/moe/moe_cuda.hpp", "src/cuda/moe/tuning.cpp"],
        w="bf16, f16", x="any",
        m="1..{kMoeStreamMaxTokens} tokens, top_k <= {kMoeStreamMaxTopK}; any d, hidden on "
          "16-byte aligned (padded) expert rows",
        arch="sm_80+",
        when="planner: up to {kStreamMaxShare} expected slots per hit expert; the only entry for "
             "d or hidden not a multiple of 8",
        how="device routing, then every slot's expert rows as two weight streams writing y "
            "directly"),
    "moe_sm90_grouped": dict(
        src=["src/cuda/moe/sm90_grouped.cu", "src/cuda/moe/tuning.cpp"],
        w="bf16, f16 (x's dtype), gated", x="bf16, f16",
        m="from {kGroupedSm90MinRows} expected tokens per hit expert", arch="sm_90a",
        when="table order after the stream",
        how="TMA + wgmma grouped GEMMs over the device chunk list: swapped, 128-row or 192-row "
            "tiles by tokens per expert"),
    "moe_sm80_grouped": dict(
        src=["src/cuda/moe/sm80_grouped.cu", "src/cuda/moe/tuning.cpp",
             "src/cuda/moe/tuning.hpp"],
        w="bf16, f16 (x's dtype), e4m3 (sm_89+)", x="bf16, f16 (e4m3 experts: any)",
        m="from {kGroupedMinRows} expected tokens per hit expert, or experts of {kGroupedBigExpert:MiB}", arch="sm_80+",
        when="table order", how="mma.sync grouped GEMMs (64- or 128-row tiles) over the chunk list"),
    "moe_sm80_chunked": dict(
        src=["src/cuda/moe/sm80_chunked.cu"],
        w="bf16, f16, e4m3 (sm_89+)", x="any", m="any", arch="sm_80+",
        when="the rest (few tokens on small experts, shapes the GEMMs refuse)",
        how="mma.sync weight streaming per chunk of tokens and hidden slice, combine kernel"),
    "moe_cpu_avx2_grouped": dict(
        src=["src/cpu/moe.cpp"], w="f32, f16, bf16, e4m3", x="f32, f16, bf16", m="any",
        arch="x86-64 AVX2 + FMA + F16C", when="backend cpu",
        how="fp64 routing, slots sorted by expert, each group through the cpu mlp kernels"),
    "moe_ref_scalar_fp64": dict(
        src=["src/ref/moe.cpp"], w="all", x="all", m="any", arch="any host",
        when="by name, or backend ref", how="fp64 loops; moe_route_token is the routing spec"),
}

# An OpKernel initializer: {"name" or a name constant, FMLP_BACKEND_X, ...
_INIT = re.compile(r'\{\s*("([a-z0-9_]+)"|(k[A-Za-z0-9_]+))\s*,\s*FMLP_BACKEND_(CUDA|CPU|REF)\b')


def _table_files(root, op):
    return {"cuda": [f"src/cuda/{op}/table.cpp"], "cpu": [f"src/cpu/{op}.cpp"],
            "ref": [f"src/ref/{op}.cpp"]}


def _read(root, rel):
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        return f.read()


def _name_constant(root, op, name):
    """The string a name constant (kPrefillKernelName) stands for, from the op's cuda headers."""
    folder = os.path.join(root, "src", "cuda", op)
    for fn in sorted(os.listdir(folder)):
        m = re.search(rf'\b{name}\s*=\s*"([a-z0-9_]+)"', _read(root, f"src/cuda/{op}/{fn}"))
        if m:
            return m.group(1)
    raise SystemExit(f"gen_docs: the name constant {name} of src/cuda/{op}/table.cpp is defined "
                     f"nowhere in src/cuda/{op}/")


def table(root):
    """[(op, backend, position, name, file)] in dispatch order, read from the source."""
    out = []
    for op in OPS:
        for backend in BACKENDS:
            pos = 0
            for rel in _table_files(root, op)[backend]:
                for m in _INIT.finditer(_read(root, rel)):
                    if m.group(4).lower() != backend:
                        continue
                    name = m.group(2) or _name_constant(root, op, m.group(3))
                    pos += 1
                    out.append((op, backend, pos, name, rel))
    return out


_CONST = re.compile(r"constexpr\s+[\w:]+\s+(\w+)\s*=\s*([^;]+);")
# A measured threshold with its bench knob, in either spelling:
#   const double NAME = tuned("FMLP_...", VALUE);
#   const double NAME = knob_float<Knob::FMLP_...>();   (the default in src/core/knobs.def)
_TUNED = re.compile(r'const\s+double\s+(\w+)\s*=\s*tuned\("(\w+)",\s*([0-9.e+-]+)\)')
_KNOBBED = re.compile(r"const\s+double\s+(\w+)\s*=\s*knob_(?:float|int)<Knob::(\w+)>\(\)")
_KNOB_DEF = re.compile(r'FMLP_KNOB\(\s*(\w+)\s*,\s*\w+\s*,\s*"([^"]*)"')


def _number(text):
    v = float(text)
    return int(v) if v.is_integer() else v


def thresholds(root, rel):
    """[(constant, value, knob)] of the measured thresholds a file defines, in file order."""
    text = _read(root, rel)
    defs = {}
    if os.path.exists(os.path.join(root, "src/core/knobs.def")):
        defs = dict(_KNOB_DEF.findall(_read(root, "src/core/knobs.def")))
    found = [(m.start(), m.group(1), _number(m.group(3)), m.group(2))
             for m in _TUNED.finditer(text)]
    for m in _KNOBBED.finditer(text):
        if m.group(2) not in defs:
            raise SystemExit(f"gen_docs: {rel} reads {m.group(2)}, which src/core/knobs.def "
                             "does not define")
        found.append((m.start(), m.group(1), _number(defs[m.group(2)]), m.group(2)))
    return [f[1:] for f in sorted(found)]


def _int_expr(text):
    expr = re.sub(r"\b(?:int64_t|int32_t|size_t|int|uint32_t)\s*\(", "(", text.strip())
    if not re.fullmatch(r"[0-9\s().*+<-]+", expr):
        return None
    try:
        v = eval(expr, {"__builtins__": {}}, {})  # digits and operators only
    except Exception:
        return None
    return int(v) if float(v).is_integer() else v


def constants(root, files):
    found = {}
    for rel in files:
        for m in _CONST.finditer(_read(root, rel)):
            v = _int_expr(m.group(2))
            if v is not None:
                found.setdefault(m.group(1), v)
        for name, value, _ in thresholds(root, rel):
            found.setdefault(name, value)
    return found


def _fill(text, consts, name):
    def sub(m):
        key, unit = m.group(1), m.group(2)
        if key not in consts:
            raise SystemExit(f"gen_docs: {name}'s description names {key}, which no "
                             f"`constexpr ... {key} = ...;` in its files defines")
        v = consts[key]
        if unit:
            return f"{v / (1024 if unit == 'KiB' else 1 << 20):g} {unit}"
        return str(v)
    return re.sub(r"\{(\w+)(?::(KiB|MiB))?\}", sub, text)


def rows(root):
    """The page's rows: every entry with its record filled in; fails on a mismatch."""
    tab = table(root)
    names = [t[3] for t in tab]
    missing = [n for n in names if n not in ENTRIES]
    extra = [n for n in ENTRIES if n not in names]
    if missing or extra:
        raise SystemExit("gen_docs: scripts/docgen_kernels.py is out of step with the op table: "
                         + (f"no record for {', '.join(missing)}" if missing else "")
                         + ("; " if missing and extra else "")
                         + (f"records for entries not in any table: {', '.join(extra)}"
                            if extra else ""))
    out = []
    for op, backend, pos, name, rel in tab:
        e = ENTRIES[name]
        for src in e["src"]:
            if not os.path.exists(os.path.join(root, src)):
                raise SystemExit(f"gen_docs: {name}'s source {src} does not exist")
        consts = constants(root, e["src"])
        out.append(dict(op=op, backend=backend, pos=pos, name=name, table=rel, src=e["src"][0],
                        **{k: _fill(e[k], consts, name)
                           for k in ("w", "x", "m", "arch", "when", "how")}))
    return out
