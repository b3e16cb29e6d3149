"""fusedmlp.torch.FusedLinear: an nn.Linear or transformers Conv1D through
torch.ops.fusedmlp.linear, and the padded-row weight copies it and FusedMoE keep for the CUDA
weight streams (rows of odd length)."""

import torch
from torch import nn

from . import _fp8
from .torch import _linear_op, _param


_LINEAR_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _padded_rows(w):
    """w [..., N, K] re-stored with rows of whole 16-byte chunks (row stride K rounded up to a
    multiple of 8, zeros past K), or None where that buys nothing: not a 16-bit CUDA weight, or
    its rows already start on 16-byte boundaries. The CUDA weight streams (linear_sm80_stream,
    linear_sm80_mma, moe_sm80_stream) read such rows at any K; rows of odd K back to back leave
    the linear op only the general GEMV and the moe op no CUDA entry."""
    if w.device.type != "cuda" or w.dtype not in (torch.float16, torch.bfloat16):
        return None
    k = w.shape[-1]
    per = 16 // w.element_size()
    rows_ok = all(w.stride(i) % per == 0 for i in range(w.dim() - 1) if w.shape[i] > 1)
    if w.data_ptr() % 16 == 0 and rows_ok:
        return None
    kp = -(-k // per) * per
    padded = w.detach().new_zeros(*w.shape[:-1], kp)
    padded[..., :k].copy_(w.detach())
    return padded[..., :k]


class _PaddedCopy:
    """The padded-row copy (_padded_rows) of a weight, rebuilt when the weight's storage,
    version, device or dtype changes; `get(w)` gives the copy, or w where none is needed."""

    def __init__(self):
        self.key, self.padded = None, None

    def get(self, w):
        key = (w.data_ptr(), w._version, w.device, w.dtype, tuple(w.shape), w.stride())
        if key != self.key:
            self.key, self.padded = key, _padded_rows(w)
        return w if self.padded is None else self.padded


def _is_conv1d(m):
    """A transformers Conv1D (GPT-2's linears: weight [in, out]), told by name so that
    transformers need not be imported."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf")


class FusedLinear(nn.Module):
    """y = x W^T + b through torch.ops.fusedmlp.linear, in place of an nn.Linear or a
    transformers Conv1D (on CUDA a GEMV at few rows).

    Inference only: no backward. Autocast does not apply: the op runs in the weight's dtype.

    Parameters
    ----------
    weight : torch.Tensor
        [out, in], float32, float16 or bfloat16, or torch.float8_e4m3fn with ``weight_scale``;
        rows contiguous; an nn.Parameter is used as it is (shared, not copied: weight tying and
        memory stay as they were).
    bias : torch.Tensor, optional
        [out].
    pad_rows : bool
        On CUDA, a 16-bit weight whose rows do not start on 16-byte boundaries (``in`` not a
        multiple of 8, rows back to back) runs from a copy with a padded row stride, made at the
        first call and again whenever the weight changes (its version or storage): the weight
        streams then take it at the aligned shape's cost, where the rows as given leave the
        general GEMV. The copy costs the weight's memory once more. False runs the weight as
        given.
    weight_scale : torch.Tensor, optional
        float32 scales of an e4m3 weight: [1], [out] or [ceil(out / 128), ceil(in / 128)]
        (fusedmlp.linear's w_scale); x then stays in its own dtype (weight-only fp8).

    Attributes
    ----------
    in_features, out_features : int

    Raises
    ------
    ValueError
        weight is not 2-D, or bias is not [out].
    NotImplementedError
        A tensor subclass, a dtype other than float32/float16/bfloat16, a device other than
        cpu/cuda, or strided rows.
    """

    def __init__(self, weight, bias=None, weight_scale=None, pad_rows=True):
        super().__init__()
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight)
            raise ValueError(f"weight is {shape}; expected a 2-D tensor [out, in]")
        fp8 = weight.dtype == torch.float8_e4m3fn
        if fp8 != (weight_scale is not None):
            raise ValueError("weight_scale goes with a torch.float8_e4m3fn weight and only with "
                             f"one (weight is {weight.dtype}, weight_scale "
                             f"{'given' if weight_scale is not None else 'missing'})")
        for name, t in (("weight", weight), ("bias", bias)):
            if t is None:
                continue
            if type(t) not in (torch.Tensor, nn.Parameter):
                raise NotImplementedError(f"{name} is a {type(t).__name__} (a tensor subclass, "
                                          "e.g. quantized or sharded); FusedLinear takes plain "
                                          "tensors")
            if t.dtype not in _LINEAR_DTYPES and not (fp8 and name == "weight"):
                raise NotImplementedError(f"{name} has dtype {t.dtype}; FusedLinear takes "
                                          "float32, float16 or bfloat16 (or an e4m3 weight with "
                                          "its scales)")
            if t.device.type not in ("cpu", "cuda"):
                raise NotImplementedError(f"{name} is on {t.device}; FusedLinear runs on cpu or "
                                          "cuda tensors")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected [{weight.shape[0]}]")
        if weight.shape[1] > 1 and weight.stride(1) != 1:
            raise NotImplementedError(f"weight has strides {weight.stride()}; the op reads rows "
                                      "with contiguous elements (stride 1 along in)")
        self.weight = weight if isinstance(weight, nn.Parameter) else _param(weight)
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else _param(bias)
        self.register_buffer("weight_scale",
                             None if weight_scale is None else weight_scale.detach())
        self.in_features, self.out_features = int(weight.shape[1]), int(weight.shape[0])
        self.pad_rows = bool(pad_rows)
        self._padded = _PaddedCopy()

    @classmethod
    def from_module(cls, module: nn.Module) -> "FusedLinear":
        """A FusedLinear computing what an nn.Linear or a transformers Conv1D computes.

        An nn.Linear keeps its Parameters; a Conv1D's weight [in, out] is transposed once into
        a new contiguous Parameter.

        Parameters
        ----------
        module : nn.Linear or transformers Conv1D

        Returns
        -------
        FusedLinear

        Raises
        ------
        NotImplementedError
            Another module, an nn.Linear subclass with its own forward (e.g. a quantized one),
            or a dtype the op does not take.
        """
        if _fp8.is_fp8_linear(module):  # e4m3 weight and its scales (_fp8.py)
            return cls(module.weight, module.bias, _fp8.fp8_scale(module))
        if isinstance(module, nn.Linear):
            if type(module).forward is not nn.Linear.forward:
                raise NotImplementedError(f"{type(module).__name__} subclasses nn.Linear with its "
                                          "own forward; only plain nn.Linear is replaced")
            return cls(module.weight, module.bias)
        if _is_conv1d(module):
            return cls(_param(module.weight.t().contiguous()), module.bias)
        raise NotImplementedError(f"{type(module).__name__} is not an nn.Linear or a Conv1D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b.

        Parameters
        ----------
        x : torch.Tensor
            [..., in] in the weight's dtype, on its device.

        Returns
        -------
        torch.Tensor
            [..., out] in x's dtype.

        Raises
        ------
        RuntimeError
            x's dtype is not the weight's (nn.Linear raises here too).
        """
        w = self.weight
        if self.weight_scale is not None:  # weight-only e4m3: x keeps its dtype
            return _linear_op(x, w, self.bias, self.weight_scale)
        if x.dtype != w.dtype:
            raise RuntimeError(f"FusedLinear: x has dtype {x.dtype} but the weight {w.dtype}; "
                               "cast x first (nn.Linear raises here too)")
        if self.pad_rows and w.is_cuda and self.in_features % 8:
            w = self._padded.get(w)
        return _linear_op(x, w, self.bias, None)

    def extra_repr(self):
        fp8 = "" if self.weight_scale is None else \
            f", e4m3 weight with {_fp8.scale_kind(self.weight_scale)}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}{fp8}")
