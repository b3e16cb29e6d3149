"""Type stub of fusedmlp._ext, the nanobind extension (python/fusedmlp/_ext.cpp) over the C ABI
(include/fusedmlp/fusedmlp.h). It is the package's private layer: fusedmlp/__init__.py and
fusedmlp/torch.py parse the arguments and call it; use those.

Conventions of the op functions:

- ``tensors`` maps argument names ("out", "x", "w1", ...) to arrays (DLPack capsules or
  objects with DLPack or the buffer protocol); absent optional arrays are left out.
- ``bits`` names arrays that carry another dtype's bits: "bf16" (a uint16 view of bfloat16),
  "f8" (a uint8 view of float8_e4m3fn), for producers that cannot export those dtypes.
- ``mode`` is "run" (returns None; y is written into tensors["out"]), "explain" (returns the
  dispatch report) or "workspace_size" (returns the bytes of workspace).
- ``workspace`` is None (host calls, or none needed), a device array, or a callable
  ``(nbytes, device_type, device_id) -> array`` that gives a zero-filled buffer on demand.
- ``stream`` is a cudaStream_t as an int (0: the default stream; ignored on the host).
- Enumerations are the C ABI's integers: activation (relu 0, gelu 1, gelu_tanh 2, silu 3,
  relu2 4), norm (none 0, layernorm 1, rmsnorm 2), backend (auto 0, ref 1, cpu 2, cuda 3),
  scoring (softmax 0, sigmoid 1).

Failures raise ValueError (bad arguments), NotImplementedError (backend unavailable, or no
kernel handles the request), RuntimeError (a CUDA call failed) or MemoryError.
tests: python/tests/test_stub.py checks that this stub and the module name the same things.
"""

from typing import Any, Callable, Dict, List, Literal, Mapping, Optional, Tuple, Union, overload

_Workspace = Union[None, Any, Callable[[int, int, int], Any]]

@overload
def mlp(mode: Literal["run"], tensors: Dict[str, Any], bits: Mapping[str, str], activation: int,
        gated: bool, norm: int, eps: float, deterministic: bool, backend: int,
        workspace: _Workspace, stream: int) -> None:
    """fmlp_mlp / fmlp_mlp_explain / fmlp_mlp_workspace_size on the arrays of ``tensors``
    (out, x, residual, w1, w1_scale, b1, w_up, w_up_scale, b_up, w2, w2_scale, b2,
    norm_weight, norm_bias)."""
@overload
def mlp(mode: Literal["explain"], tensors: Dict[str, Any], bits: Mapping[str, str],
        activation: int, gated: bool, norm: int, eps: float, deterministic: bool, backend: int,
        workspace: _Workspace, stream: int) -> str: ...
@overload
def mlp(mode: Literal["workspace_size"], tensors: Dict[str, Any], bits: Mapping[str, str],
        activation: int, gated: bool, norm: int, eps: float, deterministic: bool, backend: int,
        workspace: _Workspace, stream: int) -> int: ...

class PackedMlp:
    """fmlp_mlp_packed_t: weights packed once (fmlp_mlp_pack) on the weights' device."""

    def __init__(self, tensors: Dict[str, Any], bits: Mapping[str, str], activation: int,
                 gated: bool, norm: int, eps: float, deterministic: bool, backend: int,
                 stream: int) -> None:
        """Packs the weights of ``tensors`` (w1, w1_scale, b1, w_up, w_up_scale, b_up, w2,
        w2_scale, b2, norm_weight, norm_bias), the copy made on ``stream``."""
    @overload
    def run(self, mode: Literal["run"], tensors: Dict[str, Any], bits: Mapping[str, str],
            workspace: _Workspace, stream: int) -> None:
        """fmlp_mlp_packed_run / _explain / _workspace_size on tensors out, x, residual."""
    @overload
    def run(self, mode: Literal["explain"], tensors: Dict[str, Any], bits: Mapping[str, str],
            workspace: _Workspace, stream: int) -> str: ...
    @overload
    def run(self, mode: Literal["workspace_size"], tensors: Dict[str, Any],
            bits: Mapping[str, str], workspace: _Workspace, stream: int) -> int: ...
    @property
    def handle(self) -> int:
        """The pack's id in the extension's registry (what the C++ torch ops take)."""
    @property
    def d_in(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def d_out(self) -> int: ...
    @property
    def device(self) -> str:
        """"cpu" or "cuda:N"."""

@overload
def moe(mode: Literal["run"], tensors: Dict[str, Any], bits: Mapping[str, str], top_k: int,
        activation: int, gated: bool, scoring: int, renormalize: bool, deterministic: bool,
        first_expert: int, global_experts: int, round_logits: bool, backend: int,
        workspace: _Workspace, stream: int) -> None:
    """fmlp_moe / fmlp_moe_explain / fmlp_moe_workspace_size on the arrays of ``tensors``
    (out, x, residual, router_w, router_b, topk_ids, topk_weights, w1, b1, w2, b2, w1_scale,
    w2_scale)."""
@overload
def moe(mode: Literal["explain"], tensors: Dict[str, Any], bits: Mapping[str, str], top_k: int,
        activation: int, gated: bool, scoring: int, renormalize: bool, deterministic: bool,
        first_expert: int, global_experts: int, round_logits: bool, backend: int,
        workspace: _Workspace, stream: int) -> str: ...
@overload
def moe(mode: Literal["workspace_size"], tensors: Dict[str, Any], bits: Mapping[str, str],
        top_k: int, activation: int, gated: bool, scoring: int, renormalize: bool,
        deterministic: bool, first_expert: int, global_experts: int, round_logits: bool,
        backend: int, workspace: _Workspace, stream: int) -> int: ...

def moe_device_errors(workspace: Any, stream: int) -> int:
    """fmlp_moe_device_errors: the bad device expert ids counted in a moe workspace since the
    last read (then reset to 0); synchronises ``stream``."""

@overload
def linear(mode: Literal["run"], tensors: Dict[str, Any], bits: Mapping[str, str], backend: int,
           workspace: _Workspace, stream: int) -> None:
    """fmlp_linear / _explain / _workspace_size on tensors out, x, w, w_scale, x_scale, bias."""
@overload
def linear(mode: Literal["explain"], tensors: Dict[str, Any], bits: Mapping[str, str],
           backend: int, workspace: _Workspace, stream: int) -> str: ...
@overload
def linear(mode: Literal["workspace_size"], tensors: Dict[str, Any], bits: Mapping[str, str],
           backend: int, workspace: _Workspace, stream: int) -> int: ...

@overload
def softmax(mode: Literal["run"], tensors: Dict[str, Any], bits: Mapping[str, str],
            temperature: float, log: bool, backend: int, workspace: _Workspace,
            stream: int) -> None:
    """fmlp_softmax / _explain / _workspace_size on tensors out, x."""
@overload
def softmax(mode: Literal["explain"], tensors: Dict[str, Any], bits: Mapping[str, str],
            temperature: float, log: bool, backend: int, workspace: _Workspace,
            stream: int) -> str: ...
@overload
def softmax(mode: Literal["workspace_size"], tensors: Dict[str, Any], bits: Mapping[str, str],
            temperature: float, log: bool, backend: int, workspace: _Workspace,
            stream: int) -> int: ...

def quantize_fp8(tensors: Dict[str, Any], bits: Mapping[str, str]) -> float:
    """fmlp_quantize_fp8 of tensors w into q and scale; returns the largest amax used."""

def available(arg: int, /) -> Tuple[bool, str]:
    """fmlp_backend_available: (True, "") or (False, the reason)."""

def kernels(op: str = "mlp") -> List[Tuple[str, str]]:
    """The op table ("mlp", "moe", "linear" or "softmax") as (name, backend) pairs."""

def devices() -> str:
    """fmlp_cuda_devices: one line per visible CUDA device, "" without CUDA."""

def build_info() -> str:
    """fmlp_build_info."""

def version() -> str:
    """fmlp_version."""

def with_cuda() -> bool:
    """Whether the extension was built with the CUDA backend."""

def knobs() -> List[Dict[str, Any]]:
    """fmlp_knob_info of every FMLP_* knob: dicts with name, kind ("bool", "int", "float",
    "string"), scope, default, range, purpose, env (None when unset), value and error."""

def knob(name: str) -> Dict[str, Any]:
    """The dict of knobs() for one knob; KeyError when ``name`` is not one."""

_api: Any
"""A capsule holding the C function table that fusedmlp._torch_ops calls (_ext_api.h)."""
