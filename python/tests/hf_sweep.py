"""The patch() sweep over the installed transformers: every causal-LM class (MoE ones
included) and every encoder class (masked-LM, and text-encoder models of the other model types)
built from a tiny config, random-init, patched, and compared with its unpatched copy.

Tiny config: the class's default config with the common size fields shrunk (SIZES; only fields
whose default is larger, or unset where the model needs them), token ids moved inside the
vocabulary, layer-type lists cut to the layer count; sub-configs the same way. A class that
cannot be built or run that way, or that still has more than MAX_PARAMETERS, is skipped with
the reason. Nothing is downloaded.

run() patches one copy loosely and one strictly and returns a row: what was replaced, what was
skipped and why, the largest |patched - unpatched| logit over that row's rms, whether every
MLP-looking module is accounted for in the report (mlp_looking: this file's own test, by class
names and children, independent of the structural detection), and how strict mode ended.
Used by test_patch_sweep.py (fp32, CPU backend), test_gpu.py (bf16 on the device) and
bench/patch_sweep.py (the committed table)."""

import copy
import dataclasses
import gc
import re
import time
import warnings

import torch
from torch import nn

SIZES = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64, "embed_dim": 64, "n_embed": 64,
    "emb_dim": 64, "embedding_size": 64, "hidden_dim": 64,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128, "d_ff": 128, "ffn_hidden_size": 128, "inner_hidden_size": 128,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "encoder_layers": 2,
    "decoder_layers": 2, "n_layers": 2, "num_encoder_layers": 2, "num_decoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_heads": 4, "num_encoder_attention_heads": 4,
    "num_decoder_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_kv_heads": 2,
    "vocab_size": 256, "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2, "top_k": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "rotary_dim": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "kv_lora_rank": 32, "q_lora_rank": 32,
    "d_latents": 64, "num_latents": 32, "num_self_attends_per_block": 2,
}
MAX_PARAMETERS = 20_000_000  # a class still larger after shrinking is skipped (CI's time)
# Set even when the default is None (the model then needs them).
UNSET_SIZES = ("head_dim", "num_key_value_heads", "num_experts_per_tok")
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
             "sep_token_id", "eod_token_id")
SEQ = 7
BATCH = 2


class BuildError(Exception):
    """The class cannot be built (or run) from a tiny config: the reason."""


def classes():
    """[(kind, class name)]: causal-LM classes ("causal-lm"), then masked-LM classes of the
    other model types and text-encoder classes of the rest ("encoder"), each class once."""
    from transformers.models.auto import modeling_auto as ma
    causal = ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    seen, out = set(), []
    for _, name in sorted(causal.items()):
        if name not in seen:
            seen.add(name)
            out.append(("causal-lm", name))
    encoders = dict(ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    for k, v in ma.MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES.items():
        encoders.setdefault(k, v)
    for model_type, name in sorted(encoders.items()):
        if model_type not in causal and name not in seen:
            seen.add(name)
            out.append(("encoder", name))
    return out


def _fields(cls):
    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:
        return set()


def tiny_kwargs(config_class, every_kind=False):
    """Constructor keyword arguments shrinking config_class's defaults (see the module doc).
    Layer-type lists are cut to the layer count, or with every_kind to one layer of each type
    (for models that need, say, an attention layer among their linear-attention ones)."""
    default = config_class()
    names = _fields(config_class)
    kw = {}
    for k, v in SIZES.items():
        if k not in names:
            continue
        cur = getattr(default, k, None)
        if (isinstance(cur, int) and not isinstance(cur, bool) and cur > v) or (
                cur is None and k in UNSET_SIZES):
            kw[k] = v
    if "kv_lora_rank" in names and "num_key_value_heads" in kw:
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)  # MLA: one kv per head
    vocab = kw.get("vocab_size", getattr(default, "vocab_size", None))
    for i, k in enumerate(TOKEN_IDS):
        cur = getattr(default, k, None) if k in names else None
        if isinstance(vocab, int) and isinstance(cur, int) and cur >= vocab:
            kw[k] = i % 3
        elif isinstance(vocab, int) and isinstance(cur, list):
            kw[k] = [t if t < vocab else 2 for t in cur]
    if "n_routed_experts" in names and getattr(default, "n_routed_experts", 0) is None and \
            "moe_intermediate_size" in names:
        kw["n_routed_experts"] = SIZES["n_routed_experts"]
    layers = kw.get("num_hidden_layers")
    for k in ("layer_types", "layers_block_type", "block_types"):
        types = getattr(default, k, None) if k in names else None
        if isinstance(types, list) and layers and all(isinstance(t, str) for t in types):
            if not every_kind:
                kw[k] = types[:layers]
                continue
            kinds = list(dict.fromkeys(types))  # each kind once, in order of first use
            if len(kinds) > layers:
                layers = kw["num_hidden_layers"] = len(kinds)
            kw[k] = kinds + [types[-1]] * (layers - len(kinds))
    if "is_decoder" in names:
        kw["is_decoder"] = True
    for name in getattr(config_class, "sub_configs", {}):
        sub = getattr(default, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            sub_kw = tiny_kwargs(type(sub), every_kind)
            sub_kw["model_type"] = sub.model_type
            kw[name] = sub_kw
    return kw


def build(class_name, dtype=torch.float32, device="cpu"):
    """A tiny random-init model of class `class_name` in eval mode, or raises BuildError."""
    import transformers
    cls = getattr(transformers, class_name, None)
    if cls is None:
        raise BuildError(f"transformers has no {class_name}")
    failure = None
    for every_kind in (False, True):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = cls.config_class(**tiny_kwargs(cls.config_class, every_kind))
                torch.manual_seed(0)
                model = cls(config)
            break
        except Exception as e:  # noqa: BLE001 - any failure: the class cannot be built so
            failure = failure or e
    else:
        raise BuildError(_why(failure, "building it from a tiny config"))
    try:
        if hasattr(model, "set_default_language") and getattr(config, "languages", None):
            model.set_default_language(config.languages[0])
        model = model.to(device=device, dtype=dtype).eval()
    except Exception as e:  # noqa: BLE001
        raise BuildError(_why(e, "building it from a tiny config")) from None
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_PARAMETERS:
        raise BuildError(f"still {count / 1e6:.0f} M parameters from a tiny config (sizes "
                         "SIZES does not name)")
    return model


def _why(e, what):
    line = (str(e).strip().split("\n") or [""])[0][:140]
    return f"{what} failed: {type(e).__name__}: {line}"


def input_ids(model):
    vocab = getattr(model.config, "vocab_size", None) or 256
    gen = torch.Generator().manual_seed(0)
    codebooks = getattr(model.config, "num_codebooks", None)  # audio decoders: rows per book
    rows = BATCH * (codebooks if isinstance(codebooks, int) and codebooks > 0 else 1)
    ids = torch.randint(3, max(4, min(vocab, 256)), (rows, SEQ), generator=gen)
    return ids.to(next(model.parameters()).device)


def logits(model, ids):
    """The model's logits (or last hidden state) for ids, as float32."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            out = model(input_ids=ids, use_cache=False)
        except TypeError:
            out = model(input_ids=ids)
    for key in ("logits", "last_hidden_state", "prediction_logits"):
        t = getattr(out, key, None)
        if isinstance(t, torch.Tensor):
            return t.float()
    t = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(t, torch.Tensor):
        raise BuildError("its output has no logits tensor")
    return t.float()


_MLP_NAME = re.compile(r"(mlp|feed_?forward|ffn|ffw|experts?|moe|moeblock|mixtureofexperts|"
                       r"dense(gated)?(act|relu)dense)$", re.IGNORECASE)
_ATTENTION = re.compile(r"attention|attn", re.IGNORECASE)
_ACTIVATION_MODULES = ("transformers.activations", "torch.nn.modules.activation")


def mlp_looking(model):
    """Qualified names of the modules that look like MLP (or MoE) blocks: a class name ending
    like one (MLP, FeedForward, FFN, Experts, MoE, ...), or two or three linear children and an
    activation module; not attention modules nor anything inside one."""
    found = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if not name or _ATTENTION.search(name) or _ATTENTION.search(cls) or isinstance(
                m, (nn.ModuleList, nn.ModuleDict)):
            continue
        kids = list(m.children())
        linears = sum(isinstance(k, nn.Linear) or type(k).__name__ == "Conv1D" for k in kids)
        act = any(type(k).__module__ in _ACTIVATION_MODULES for k in kids)
        if _MLP_NAME.search(cls) or (linears in (2, 3) and act):
            found.append(name)
    return found


def accounted(name, report):
    """Whether the report names module `name`, a module containing it, or one inside it."""
    entries = report.replaced + report.experts + [n for n, _ in report.skipped]
    for entry in entries:
        for member in entry.split("+"):
            if member == name or member.startswith(name + ".") or name.startswith(member + "."):
                return True
    return False


def _state(model):
    return [(n, id(m)) for n, m in model.named_modules()]


def max_rel_diff(got, ref):
    """max |got - ref| / rms(ref row)."""
    rms = ref.pow(2).mean(dim=-1, keepdim=True).sqrt() + 1e-30
    return float(((got - ref).abs() / rms).nan_to_num(nan=float("inf")).max())


def close_error(got, ref, rtol):
    """Largest |got - ref| / (rtol * (|ref| + rms(ref row))): test_patch.py's whole-model
    criterion (used for 16-bit models, whose logits carry their own rounding)."""
    rms = ref.pow(2).mean(dim=-1, keepdim=True).sqrt()
    err = (got - ref).abs() / (rtol * (ref.abs() + rms) + 1e-30)
    return float(err.nan_to_num(nan=float("inf")).max())


def position_fraction(got, ref, rtol):
    """The fraction of token positions (rows of the logits) that pass close_error at rtol."""
    rms = ref.pow(2).mean(dim=-1, keepdim=True).sqrt()
    ok = ((got - ref).abs() <= rtol * (ref.abs() + rms)).all(dim=-1)
    return float(ok.float().mean())


@dataclasses.dataclass
class Row:
    kind: str
    arch: str
    built: bool = False
    reason: str = ""  # why it was not built
    replaced: list = dataclasses.field(default_factory=list)
    experts: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)  # (name, reason)
    mlp_looking: int = 0
    unaccounted: list = dataclasses.field(default_factory=list)
    max_diff: float = 0.0  # max |patched - unpatched| / row rms (loose mode)
    close: float = 0.0  # close_error at the dtype's rtol
    positions: float = 1.0  # fraction of token positions whose logits all pass close_error
    moe: bool = False  # MoE blocks were replaced or their experts switched
    strict: str = ""  # "patched", "refused: ..." or what went wrong
    strict_diff: float = 0.0
    error: str = ""  # patch() or the patched model raised: the model is broken
    seconds: float = 0.0


def run(kind, arch, dtype=torch.float32, device="cpu", rtol=1e-3):
    """The sweep's row for one class (see the module docstring)."""
    import fusedmlp
    row = Row(kind, arch)
    start = time.perf_counter()
    try:
        model = build(arch, dtype, device)
        ids = input_ids(model)
        try:
            ref = logits(model, ids)
        except Exception as e:  # noqa: BLE001
            raise BuildError(_why(e, "running its unpatched forward on input_ids")) from None
    except BuildError as e:
        row.reason = str(e)
        return row
    row.built = True
    strict_model = copy.deepcopy(model)
    looking = mlp_looking(model)
    row.mlp_looking = len(looking)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = fusedmlp.patch(model)
        got = logits(model, ids)
    except Exception as e:  # noqa: BLE001 - a broken model: the test fails on it
        row.error = _why(e, "patch (loose) or the patched forward")
        return row
    row.replaced, row.experts, row.skipped = report.replaced, report.experts, report.skipped
    row.unaccounted = [n for n in looking if not accounted(n, report)]
    row.max_diff = max_rel_diff(got, ref)
    row.close = close_error(got, ref, rtol)
    row.positions = position_fraction(got, ref, rtol)
    row.moe = bool(report.experts) or any("FusedMoE" in d for d in report.details.values())
    before = _state(strict_model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fusedmlp.patch(strict_model, strict=True)
        row.strict = "patched"
        row.strict_diff = max_rel_diff(logits(strict_model, ids), ref)
    except fusedmlp.PatchError as e:
        unchanged = _state(strict_model) == before
        row.strict = ("refused: " if unchanged else "REFUSED BUT CHANGED: ") + str(e)[:200]
        if unchanged:
            row.strict_diff = max_rel_diff(logits(strict_model, ids), ref)
    except Exception as e:  # noqa: BLE001
        row.strict = "CRASHED: " + _why(e, "patch(strict=True)")
    row.seconds = time.perf_counter() - start
    del model, strict_model
    gc.collect()
    return row


def patched_any(row):
    return bool(row.replaced or row.experts)


def _short(reason):
    """A skip reason without the per-layer detail, for the table."""
    reason = re.sub(r"\(nearest [^)]*\)", "", reason)
    reason = re.sub(r"model\.layers\.\d+\.", "", reason)
    return reason.split(";")[0].strip()[:110]


def table(rows, version):
    """The sweep's table (markdown) for the rows, with a summary line."""
    built = [r for r in rows if r.built]
    with_mlp = [r for r in built if r.mlp_looking or patched_any(r) or r.skipped]
    causal = [r for r in with_mlp if r.kind == "causal-lm"]
    causal_ok = [r for r in causal if patched_any(r)]
    broken = [r for r in built if r.error or r.strict.startswith(("CRASHED", "REFUSED BUT"))]
    lines = [
        f"transformers {version}: {len(rows)} classes, {len(built)} "
        f"built, {len(broken)} broken by patch; {len(causal_ok)} of the {len(causal)} built "
        f"causal-LM classes with MLP blocks get them (or their MoE blocks) replaced "
        f"({100.0 * len(causal_ok) / max(1, len(causal)):.0f} %).",
        "",
        "| architecture | kind | replaced | skipped (reasons) | max diff / row rms | strict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(rows, key=lambda r: (r.kind, r.arch.lower())):
        if not r.built:
            continue
        n = len(r.replaced) + len(r.experts)
        what = f"{n}" + (f" ({len(r.experts)} experts)" if r.experts else "")
        reasons = sorted({_short(why) for _, why in r.skipped})
        skipped = f"{len(r.skipped)}: " + "; ".join(reasons) if r.skipped else "0"
        strict = "patched" if r.strict == "patched" else (
            "refused, unchanged" if r.strict.startswith("refused") else r.strict[:40])
        if not r.mlp_looking and not n and not r.skipped:
            skipped = "no MLP block"
        lines.append(f"| {r.arch} | {r.kind} | {what} | {skipped.replace('|', '/')} | "
                     f"{r.max_diff:.1e} | {strict} |")
    not_built = [r for r in rows if not r.built]
    if not_built:
        lines += ["", f"Not built from a tiny config ({len(not_built)}):", ""]
        lines += [f"- {r.arch}: {r.reason.replace('|', '/')}"
                  for r in sorted(not_built, key=lambda r: r.arch.lower())]
    return "\n".join(lines)
