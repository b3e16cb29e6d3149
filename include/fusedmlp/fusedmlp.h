/* fusedmlp C ABI.
 *
 * The whole library is reachable through these plain-C entry points. Every function returns an
 * fmlp_status_t; on failure a human-readable message (naming the argument, what was expected and
 * what came) is kept per thread and returned by fmlp_last_error(). On failure nothing has been
 * written to any output buffer.
 *
 * Math of the mlp op (row i of x, one token):
 *   xn = norm(x_i)         none | LayerNorm(gamma, beta, eps) | RMSNorm(gamma, eps)
 *   dense: h = act(W1 xn + b1)                     W1: [hidden, d_in] (nn.Linear: [out, in])
 *   gated: h = act(Wg xn + bg) * (Wu xn + bu)
 *   y_i = [residual_i +] W2 h + b2        W2: [d_out, hidden]
 * act: relu | gelu (erf) | gelu_tanh | silu. Gated with silu is SwiGLU, with gelu GeGLU.
 */
#ifndef FUSEDMLP_FUSEDMLP_H
#define FUSEDMLP_FUSEDMLP_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define FMLP_API __declspec(dllexport)
#else
#define FMLP_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define FMLP_MAX_DIMS 4
/* The zeroed part of a CUDA workspace: its first FMLP_CUDA_WORKSPACE_ZEROED_BYTES bytes (4 MiB),
 * or all of it when smaller (see fmlp_mlp_workspace_size). */
#define FMLP_CUDA_WORKSPACE_ZEROED_BYTES ((size_t)4 << 20)

typedef enum fmlp_status_t {
  FMLP_SUCCESS = 0,
  FMLP_ERROR_NULL_POINTER = 1,    /* a required pointer is NULL */
  FMLP_ERROR_INVALID_VALUE = 2,   /* an enum or scalar argument is out of range */
  FMLP_ERROR_SHAPE_MISMATCH = 3,  /* shapes disagree with each other or with the op */
  FMLP_ERROR_DTYPE_MISMATCH = 4,  /* dtype not allowed for this argument or combination */
  FMLP_ERROR_BAD_STRIDE = 5,      /* strides the op cannot read (inner stride != 1, overlap) */
  FMLP_ERROR_MISALIGNED = 6,      /* pointer not aligned to its element size */
  FMLP_ERROR_ALIASING = 7,        /* output overlaps an input where that is not allowed */
  FMLP_ERROR_SIZE_OVERFLOW = 8,   /* a size is negative or its byte count overflows */
  FMLP_ERROR_DEVICE_MISMATCH = 9, /* tensors on different devices, or wrong device for backend */
  FMLP_ERROR_NOT_SUPPORTED = 10,  /* valid request, but no kernel of the backend handles it */
  FMLP_ERROR_WORKSPACE_TOO_SMALL = 11,
  FMLP_ERROR_OUT_OF_MEMORY = 12,
  FMLP_ERROR_BACKEND_UNAVAILABLE = 13, /* backend not built, no GPU, or CPU lacks the ISA */
  FMLP_ERROR_CUDA = 14,                /* a CUDA runtime call failed */
  FMLP_ERROR_BAD_SCALE = 15, /* fp8 scale missing, of wrong length, or not finite/positive */
  FMLP_ERROR_INDEX_OUT_OF_RANGE = 16, /* e.g. expert id outside [0, num_experts) */
  FMLP_ERROR_CORRUPT_FILE = 17,       /* a cache file failed to parse */
  FMLP_ERROR_INTERNAL = 18,
  FMLP_STATUS_MAX_ENUM = 0x7fffffff /* not a value (see FMLP_DTYPE_MAX_ENUM) */
} fmlp_status_t;

typedef enum fmlp_dtype_t {
  FMLP_DTYPE_INVALID = 0,
  FMLP_DTYPE_F32 = 1,
  FMLP_DTYPE_F16 = 2,
  FMLP_DTYPE_BF16 = 3,
  FMLP_DTYPE_F8_E4M3 = 4, /* float8_e4m3fn with fp32 scales: weights, and linear's x (W8A8) */
  /* Not a value. Like the other *_MAX_ENUM it widens the type's range to every non-negative int,
   * so that an out-of-range value from C (e.g. 42) is valid to read in C++ and is rejected with
   * FMLP_ERROR_INVALID_VALUE, instead of being undefined behaviour. */
  FMLP_DTYPE_MAX_ENUM = 0x7fffffff
} fmlp_dtype_t;

typedef enum fmlp_device_type_t {
  FMLP_DEVICE_CPU = 0,
  FMLP_DEVICE_CUDA = 1,
  FMLP_DEVICE_MAX_ENUM = 0x7fffffff /* not a value (see FMLP_DTYPE_MAX_ENUM) */
} fmlp_device_type_t;

typedef enum fmlp_backend_t {
  FMLP_BACKEND_AUTO = 0, /* cuda for device tensors, else cpu when the ISA is there, else ref */
  FMLP_BACKEND_REF = 1,  /* scalar fp64-accumulating oracle (host memory) */
  FMLP_BACKEND_CPU = 2,  /* AVX2/FMA/F16C, multithreaded (host memory) */
  FMLP_BACKEND_CUDA = 3, /* NVIDIA GPUs (device memory) */
  FMLP_BACKEND_MAX_ENUM = 0x7fffffff /* not a value (see FMLP_DTYPE_MAX_ENUM) */
} fmlp_backend_t;

typedef enum fmlp_activation_t {
  FMLP_ACT_RELU = 0,
  FMLP_ACT_GELU = 1,             /* 0.5 x (1 + erf(x / sqrt 2)) */
  FMLP_ACT_GELU_TANH = 2,        /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
  FMLP_ACT_SILU = 3,             /* x / (1 + exp(-x)) */
  FMLP_ACT_RELU2 = 4,            /* max(x, 0)^2, squared ReLU (Primer; Nemotron, Persimmon) */
  FMLP_ACT_MAX_ENUM = 0x7fffffff /* not a value (see FMLP_DTYPE_MAX_ENUM) */
} fmlp_activation_t;

typedef enum fmlp_norm_t {
  FMLP_NORM_NONE = 0,
  FMLP_NORM_LAYERNORM = 1,        /* (x - mean) / sqrt(var + eps) * gamma + beta, biased variance */
  FMLP_NORM_RMSNORM = 2,          /* x / sqrt(mean(x^2) + eps) * gamma */
  FMLP_NORM_MAX_ENUM = 0x7fffffff /* not a value (see FMLP_DTYPE_MAX_ENUM) */
} fmlp_norm_t;

/* A strided view of memory. Absent optional tensors are all-zero (data NULL, ndim 0); use
 * fmlp_tensor_none(). Strides count elements, not bytes. The innermost stride must be 1. */
typedef struct fmlp_tensor_t {
  void* data;
  fmlp_dtype_t dtype;
  int32_t ndim;
  int64_t shape[FMLP_MAX_DIMS];
  int64_t stride[FMLP_MAX_DIMS];
  fmlp_device_type_t device_type;
  int32_t device_id;
} fmlp_tensor_t;

typedef struct fmlp_mlp_config_t {
  fmlp_activation_t activation;
  int32_t gated; /* 0: dense, 1: gated (act(gate) * up) */
  fmlp_norm_t norm;
  float norm_eps;        /* > 0 when norm != NONE; 1e-5 is the PyTorch default */
  int32_t deterministic; /* 1: bitwise-identical results on reruns (may be slower on GPU) */
} fmlp_mlp_config_t;

/* Weights in nn.Linear layout ([out, in], rows may be strided, inner stride 1).
 * Gated: gate in w1 [hidden, d_in] and up in w_up [hidden, d_in]; or both stacked in w1
 * as [2*hidden, d_in] (gate rows first, then up rows) with w_up absent, b1 then [2*hidden].
 * Biases and norm parameters may be fp32, fp16 or bf16 whatever the weight dtype.
 * *_scale: fp32 dequantisation scales, only for fp8 weights: [1] per tensor, [rows] per row, or
 *   2-D [ceil(rows / 128), ceil(cols / 128)] per 128 x 128 block (the fine-grained fp8 checkpoints'
 *   weight_scale_inv; ref and cpu backends, weight-only), W[r, c] = code * scale[r / 128, c / 128].
 *   A stacked gated w1 [2*hidden, d_in] takes block scales [2 * ceil(hidden / 128),
 *   ceil(d_in / 128)]: the gate's block rows, then the up's, each half starting its own blocks,
 *   so the gate_proj and up_proj checkpoint scales concatenate as they are (one scale over the
 *   2*hidden stacked rows would differ where hidden % 128 != 0: block rows would straddle both).
 *   Separate w1 / w_up: both block-scaled or neither. Each matrix picks its own kind. */
typedef struct fmlp_mlp_weights_t {
  fmlp_tensor_t w1;
  fmlp_tensor_t w1_scale;
  fmlp_tensor_t b1;
  fmlp_tensor_t w_up;
  fmlp_tensor_t w_up_scale;
  fmlp_tensor_t b_up;
  fmlp_tensor_t w2;
  fmlp_tensor_t w2_scale;
  fmlp_tensor_t b2;
  fmlp_tensor_t norm_weight; /* gamma [d_in]; absent means 1 */
  fmlp_tensor_t norm_bias;   /* beta [d_in], LayerNorm only; absent means 0 */
} fmlp_mlp_weights_t;

/* y: [M, d_out]; x: [M, d_in]; residual: optional [M, d_out], may be the very same view as y
 * (in-place residual add). x, y and residual share one activation dtype (fp32, fp16 or bf16).
 * M may be 0 (nothing is done). Rows may be strided; the inner stride must be 1. */
typedef struct fmlp_mlp_args_t {
  fmlp_tensor_t y;
  fmlp_tensor_t x;
  fmlp_tensor_t residual;
  fmlp_mlp_weights_t weights;
  fmlp_mlp_config_t config;
} fmlp_mlp_args_t;

typedef struct fmlp_mlp_packed_s fmlp_mlp_packed_t;

/* ---- errors and info ---- */
FMLP_API const char* fmlp_last_error(void); /* thread-local; "" after success */
FMLP_API const char* fmlp_status_name(fmlp_status_t status);
FMLP_API const char* fmlp_version(void);
FMLP_API const char* fmlp_backend_name(fmlp_backend_t backend);
FMLP_API const char* fmlp_dtype_name(fmlp_dtype_t dtype);
FMLP_API const char* fmlp_activation_name(fmlp_activation_t act);
/* How this library was built: version, CUDA on/off and the GPU code it carries. */
FMLP_API const char* fmlp_build_info(void);
/* One line per visible CUDA device ("cuda:0 NVIDIA H200, sm_90, 132 SMs, 139.8 GiB"), or "" when
 * none; written like fmlp_mlp_explain (always NUL-terminated, *needed = full length + 1). */
FMLP_API fmlp_status_t fmlp_cuda_devices(char* buf, size_t buf_size, size_t* needed);
/* FMLP_SUCCESS when the backend can run here; otherwise the reason is in fmlp_last_error(). */
FMLP_API fmlp_status_t fmlp_backend_available(fmlp_backend_t backend);

/* ---- environment knobs ----
 * Every FMLP_* environment variable fusedmlp reads, from one table (docs/tuning.md lists them,
 * `fusedmlp info` and fusedmlp.knobs() show their values). Knobs are for measurements and A/B
 * runs: each default is the measured choice. The library reads a knob once, at its first use in
 * the process (unless its purpose says otherwise), so set it before the first call. A value it
 * cannot accept (not a number, outside the range, not one of the words) is ignored with one line
 * on stderr naming the variable, what it accepts and what came, and the default applies. */
typedef enum fmlp_knob_kind_t {
  FMLP_KNOB_BOOL = 0,                  /* 0 or 1 */
  FMLP_KNOB_INT = 1,                   /* a decimal integer */
  FMLP_KNOB_FLOAT = 2,                 /* a decimal number */
  FMLP_KNOB_STRING = 3,                /* text */
  FMLP_KNOB_KIND_MAX_ENUM = 0x7fffffff /* not a value (see FMLP_DTYPE_MAX_ENUM) */
} fmlp_knob_kind_t;

typedef struct fmlp_knob_info_t {
  const char* name; /* the variable, e.g. "FMLP_STREAM_PDL" */
  fmlp_knob_kind_t kind;
  const char* scope;         /* what reads it: "cuda", "dist", "python", "cli" or "test" */
  const char* default_value; /* as the environment spells it; "auto": decided per call; "" */
  const char* range;         /* accepted: "lo..hi" (inclusive), "a|b|c" or "" (any text) */
  const char* purpose;       /* one sentence */
  const char* env;           /* the environment's text now; NULL when unset or empty */
  const char* value;         /* what applies now: env when accepted, else default_value */
  const char* error;         /* why env is rejected; "" when it is accepted or unset */
} fmlp_knob_info_t;

/* The number of knobs; fmlp_knob_info takes 0 .. count - 1. */
FMLP_API int fmlp_knob_count(void);
/* Knob `index`, the environment read at this call (a knob the library already read keeps the
 * value it read then). name .. purpose live as long as the library; env, value and error until
 * the next fmlp_knob_info call on this thread. FMLP_ERROR_INDEX_OUT_OF_RANGE for a bad index. */
FMLP_API fmlp_status_t fmlp_knob_info(int index, fmlp_knob_info_t* info);
/* The index of the knob named `name` (e.g. "FMLP_PLAN_TUNE"), or -1. */
FMLP_API int fmlp_knob_find(const char* name);

/* ---- tensor helpers (no allocation) ---- */
FMLP_API fmlp_tensor_t fmlp_tensor_none(void);
/* Row-major contiguous 1-D or 2-D view on the host. */
FMLP_API fmlp_tensor_t fmlp_tensor_1d(void* data, fmlp_dtype_t dtype, int64_t n);
FMLP_API fmlp_tensor_t fmlp_tensor_2d(void* data, fmlp_dtype_t dtype, int64_t rows, int64_t cols,
                                      int64_t row_stride);
FMLP_API fmlp_mlp_config_t fmlp_mlp_config_default(void);

/* ---- mlp ---- */
/* Bytes of workspace memory fmlp_mlp needs for these args (on the tensors' device).
 * A CUDA workspace must be zero-filled once before first use (cudaMemset of all of it). It has
 * two parts: the first FMLP_CUDA_WORKSPACE_ZEROED_BYTES bytes (or all of it, when smaller) hold
 * the counters and flags kernels synchronise through, and every call leaves them zero; past them
 * lies scratch (hidden activations, partial sums, cuBLASLt's workspace), which calls overwrite and
 * leave as they like, so no call pays for clearing it. Either way one workspace, sized by the
 * largest query among the calls that use it, serves all of them and every CUDA-graph replay in
 * turn without clearing. Calls that run concurrently need separate workspaces. CUDA workspaces
 * start on a 256-byte boundary (as cudaMalloc returns them; FMLP_ERROR_MISALIGNED otherwise).
 * Host workspaces need no initialisation. */
FMLP_API fmlp_status_t fmlp_mlp_workspace_size(const fmlp_mlp_args_t* args, fmlp_backend_t backend,
                                               size_t* bytes);
/* Runs the op on `stream` (a cudaStream_t for CUDA, ignored on the host). Asynchronous on CUDA:
 * never synchronises and is capturable in a CUDA graph. workspace may be NULL when the size
 * query returned 0. */
FMLP_API fmlp_status_t fmlp_mlp(const fmlp_mlp_args_t* args, fmlp_backend_t backend,
                                void* workspace, size_t workspace_bytes, void* stream);
/* Writes a report (chosen kernel, every candidate and why it was rejected) into buf, always
 * NUL-terminated; *needed gets the full length + 1. */
FMLP_API fmlp_status_t fmlp_mlp_explain(const fmlp_mlp_args_t* args, fmlp_backend_t backend,
                                        char* buf, size_t buf_size, size_t* needed);

/* One-time weight pack: validates the weights once, copies them into the layout the backend's
 * kernels read fastest, and owns that copy. weights.* shapes define d_in, hidden and d_out.
 * CUDA: rows are padded with zeros to 16-byte multiples, so sizes that are not multiples of 8
 * (16 for fp8) run on the same weight streams as aligned ones; pack also times the kernels that
 * take the packed MLP at decode token counts (M = 1 .. 64, activations of the weights' 16-bit
 * dtype, bf16 for fp8 weights), once per shape and device in the process, and the planner then
 * runs the fastest for each M; this synchronises the device (packing is not capturable).
 * Deterministic mode, or FMLP_PLAN_TUNE=0, keeps the fixed rules; fmlp_mlp_packed_explain says
 * which decided. Host backends keep fp8 block scales as blocks (gate and up stacked); the CUDA
 * pack refuses them (FMLP_ERROR_NOT_SUPPORTED: re-quantise per row). */
FMLP_API fmlp_status_t fmlp_mlp_pack(fmlp_mlp_packed_t** packed, const fmlp_mlp_weights_t* weights,
                                     const fmlp_mlp_config_t* config, fmlp_backend_t backend,
                                     void* stream);
FMLP_API void fmlp_mlp_packed_destroy(fmlp_mlp_packed_t* packed);
FMLP_API fmlp_status_t fmlp_mlp_packed_workspace_size(const fmlp_mlp_packed_t* packed,
                                                      const fmlp_tensor_t* y,
                                                      const fmlp_tensor_t* x, size_t* bytes);
/* fmlp_mlp_explain for a packed call of x into y (the planner's choice and why). */
FMLP_API fmlp_status_t fmlp_mlp_packed_explain(const fmlp_mlp_packed_t* packed,
                                               const fmlp_tensor_t* y, const fmlp_tensor_t* x,
                                               char* buf, size_t buf_size, size_t* needed);
/* residual may be NULL. */
FMLP_API fmlp_status_t fmlp_mlp_packed_run(const fmlp_mlp_packed_t* packed, const fmlp_tensor_t* y,
                                           const fmlp_tensor_t* x, const fmlp_tensor_t* residual,
                                           void* workspace, size_t workspace_bytes, void* stream);
/* fmlp_mlp_packed_run through one named op-table entry instead of the planner's pick (tests and
 * benchmarks: every entry on the packed layout); NOT_SUPPORTED with its reason when the entry
 * cannot take the call. The workspace size is the entry's own. */
FMLP_API fmlp_status_t fmlp_mlp_packed_kernel_workspace_size(const fmlp_mlp_packed_t* packed,
                                                             const char* kernel,
                                                             const fmlp_tensor_t* y,
                                                             const fmlp_tensor_t* x, size_t* bytes);
FMLP_API fmlp_status_t fmlp_mlp_packed_with_kernel(const fmlp_mlp_packed_t* packed,
                                                   const char* kernel, const fmlp_tensor_t* y,
                                                   const fmlp_tensor_t* x,
                                                   const fmlp_tensor_t* residual, void* workspace,
                                                   size_t workspace_bytes, void* stream);

/* ---- the op table, for tests, benchmarks and explain ----
 * Every kernel of every backend is an entry with a unique name (op_arch_technique). Dispatch
 * takes the first supporting entry of the chosen backend; these calls address one entry. */
FMLP_API int fmlp_mlp_kernel_count(void);
FMLP_API const char* fmlp_mlp_kernel_name(int index); /* NULL when out of range */
FMLP_API fmlp_backend_t fmlp_mlp_kernel_backend(int index);
/* FMLP_SUCCESS when the named kernel handles args; else NOT_SUPPORTED with its reason. */
FMLP_API fmlp_status_t fmlp_mlp_kernel_supports(const fmlp_mlp_args_t* args, const char* kernel);
FMLP_API fmlp_status_t fmlp_mlp_kernel_workspace_size(const fmlp_mlp_args_t* args,
                                                      const char* kernel, size_t* bytes);
FMLP_API fmlp_status_t fmlp_mlp_with_kernel(const fmlp_mlp_args_t* args, const char* kernel,
                                            void* workspace, size_t workspace_bytes, void* stream);

/* ---- fp8 weight quantisation (host) ----
 * Quantises w [rows, cols] (f32, f16 or bf16, host memory, inner stride 1) to float8_e4m3fn q
 * [rows, cols] with fp32 dequantisation scales, so that w ~= q * scale. The shape of `scale`
 * picks the granularity: [1] one scale for the whole tensor, [rows] one per row (output unit;
 * the better choice: a row's outliers then cost only that row precision), or 2-D
 * [ceil(rows / 128), ceil(cols / 128)] one per 128 x 128 block (the fine-grained fp8 checkpoint
 * format: DeepSeek-V3 / Qwen3 FP8 `weight_scale_inv`; edge blocks are smaller; fmlp_linear,
 * fmlp_mlp and fmlp_moe take it; for a stacked gated w1 quantise gate and up apart and stack the
 * scales). Policy, per tensor, row or block:
 *   amax  = max |w| over the finite values (NaN and +-Inf are left out);
 *   scale = amax / 448 in fp32 (448 = largest e4m3 value), or 1 when that is not > 0 (all-zero
 *           or all-non-finite rows, or an amax so small that amax / 448 underflows), so every
 *           scale is finite and positive as fmlp_mlp requires;
 *   q     = e4m3(w / scale): the fp32 quotient rounded to nearest even; NaN stays NaN (0x7f);
 *           +-Inf and anything that would round past 448 saturate to +-448.
 * On finite input this is PyTorch's (w.float() / scale).clamp(-448, 448).to(float8_e4m3fn) with
 * scale = w.abs().amax() / 448. The round trip q * scale is within half an e4m3 step of w (plus
 * fp32 rounding): |q * scale - w| <= 2^-4 |w| where |w| >= 2^-6 scale, <= 2^-10 scale below
 * (the subnormal codes).
 * *amax_out (may be NULL) gets the largest amax used (over the whole tensor).
 * Quantise once at load time; device tensors are rejected (NOT_SUPPORTED): quantise on the host
 * and copy q and scale to the device. On error nothing is written. */
FMLP_API fmlp_status_t fmlp_quantize_fp8(const fmlp_tensor_t* w, const fmlp_tensor_t* q,
                                         const fmlp_tensor_t* scale, float* amax_out);

/* ==== linear and softmax ops ====
 * linear:  y[M, N] = x[M, K] W^T + bias        W: [N, K] (nn.Linear layout, rows may be strided)
 *   x, y: one dtype (f32, f16, bf16); W: f32, f16, bf16 or f8_e4m3 (then w_scale is required:
 *   fp32 [1] per tensor, [N] per row, or 2-D [ceil(N / 128), ceil(K / 128)] per 128 x 128 block,
 *   W[n, k] dequantised as w * scale[n / 128, k / 128]; block scales: x not fp8, ref and cpu
 *   backends); bias: optional [N],
 *   f32, f16 or bf16. M, N or K may be 0 (K = 0 gives y = bias, or 0). y may not overlap any
 *   input. Accumulation is fp32 or wider.
 *   CUDA: W rows that start on 16-byte boundaries (base and row stride) take the weight streams at
 *   any K; for K not a multiple of 8 (16 for f8_e4m3) store W with a padded row stride (e.g. a
 *   [N, round_up(K, 8)] buffer viewed as [:, :K]; nothing past K is read). Rows back to back run
 *   on the general GEMV, and fmlp_linear_explain says so.
 *   W8A8 (torch._scaled_mm semantics): x f8_e4m3 with x_scale fp32 [1] per tensor or [M] per
 *   row (token), W f8_e4m3 with w_scale; y f32, f16 or bf16:
 *     y[m, n] = (x_scale[m] * w_scale[n]) * sum_k x[m, k] w[n, k] + bias[n].
 *   Host scales are checked to be finite and > 0; device scales are not read by validation
 *   (that would synchronise), so a bad device scale gives a bad result, not an error.
 * softmax: y = softmax(x / T) over the last dim, or log_softmax when `log` is 1.
 *   x, y: [rows, n] (or [n]), f32, f16 or bf16, same dtype; y may be exactly x (in place) but
 *   may not overlap it otherwise. temperature: finite, > 0 (1 is plain softmax).
 *   Non-finite inputs behave like PyTorch's kernels (max-subtracted exp): a NaN or +Inf anywhere
 *   in a row, or a row of only -Inf, makes the whole row NaN; -Inf elements of an otherwise
 *   finite row give 0 (log: -Inf). n = 0 or rows = 0 is a no-op.
 * Workspaces follow the mlp contract above (CUDA: zero-filled once; the zeroed part left zero). */
typedef struct fmlp_linear_args_t {
  fmlp_tensor_t y;
  fmlp_tensor_t x;
  fmlp_tensor_t w;
  fmlp_tensor_t w_scale; /* only for f8_e4m3 weights */
  fmlp_tensor_t bias;    /* optional */
  fmlp_tensor_t x_scale; /* only for f8_e4m3 x (W8A8) */
} fmlp_linear_args_t;

typedef struct fmlp_softmax_args_t {
  fmlp_tensor_t y;
  fmlp_tensor_t x;
  float temperature; /* > 0; 1 for plain softmax */
  int32_t log;       /* 0: softmax, 1: log_softmax */
} fmlp_softmax_args_t;

FMLP_API fmlp_status_t fmlp_linear_workspace_size(const fmlp_linear_args_t* args,
                                                  fmlp_backend_t backend, size_t* bytes);
FMLP_API fmlp_status_t fmlp_linear(const fmlp_linear_args_t* args, fmlp_backend_t backend,
                                   void* workspace, size_t workspace_bytes, void* stream);
FMLP_API fmlp_status_t fmlp_linear_explain(const fmlp_linear_args_t* args, fmlp_backend_t backend,
                                           char* buf, size_t buf_size, size_t* needed);
FMLP_API int fmlp_linear_kernel_count(void);
FMLP_API const char* fmlp_linear_kernel_name(int index);
FMLP_API fmlp_backend_t fmlp_linear_kernel_backend(int index);
FMLP_API fmlp_status_t fmlp_linear_kernel_supports(const fmlp_linear_args_t* args,
                                                   const char* kernel);
FMLP_API fmlp_status_t fmlp_linear_kernel_workspace_size(const fmlp_linear_args_t* args,
                                                         const char* kernel, size_t* bytes);
FMLP_API fmlp_status_t fmlp_linear_with_kernel(const fmlp_linear_args_t* args, const char* kernel,
                                               void* workspace, size_t workspace_bytes,
                                               void* stream);

FMLP_API fmlp_status_t fmlp_softmax_workspace_size(const fmlp_softmax_args_t* args,
                                                   fmlp_backend_t backend, size_t* bytes);
FMLP_API fmlp_status_t fmlp_softmax(const fmlp_softmax_args_t* args, fmlp_backend_t backend,
                                    void* workspace, size_t workspace_bytes, void* stream);
FMLP_API fmlp_status_t fmlp_softmax_explain(const fmlp_softmax_args_t* args, fmlp_backend_t backend,
                                            char* buf, size_t buf_size, size_t* needed);
FMLP_API int fmlp_softmax_kernel_count(void);
FMLP_API const char* fmlp_softmax_kernel_name(int index);
FMLP_API fmlp_backend_t fmlp_softmax_kernel_backend(int index);
FMLP_API fmlp_status_t fmlp_softmax_kernel_supports(const fmlp_softmax_args_t* args,
                                                    const char* kernel);
FMLP_API fmlp_status_t fmlp_softmax_kernel_workspace_size(const fmlp_softmax_args_t* args,
                                                          const char* kernel, size_t* bytes);
FMLP_API fmlp_status_t fmlp_softmax_with_kernel(const fmlp_softmax_args_t* args, const char* kernel,
                                                void* workspace, size_t workspace_bytes,
                                                void* stream);

/* ==== mixture-of-experts op (issue #6) ====
 * For each token t (row of x [T, d]):
 *   routing, computed by the router:
 *     logits = Wr x_t + br            Wr: [E, d] (nn.Linear layout), br: optional [E]
 *     scores = softmax(logits) | sigmoid(logits)              (config.scoring)
 *     e_1..e_k = the k largest scores, ties to the lower expert id; w_j = scores[e_j]
 *     renormalize: w_j /= sum_j w_j
 *   or routing given: e_j = topk_ids[t][j], w_j = topk_weights[t][j] (used as given; scoring and
 *     renormalize describe the router and are ignored). Given ids may repeat within a token (each
 *     occurrence counts).
 *   expert e (weights stacked over experts, the mlp op's math without norm):
 *     dense: h = act(W1[e] x_t + b1[e])                        W1: [E, hidden, d]
 *     gated: h = act(gate) * up, [gate; up] = W1[e] x_t + b1[e]   W1: [E, 2*hidden, d]
 *                                                             (gate rows first, then up rows)
 *     mlp_e(x_t) = W2[e] h + b2[e]                             W2: [E, d_out, hidden]
 *   y_t = [residual_t +] sum_j w_j mlp_{e_j}(x_t)               (j in order 1..k)
 * A shared expert is one fmlp_mlp call whose output is passed here as `residual`.
 * Expert parallelism (a local expert range): w1/b1/w2/b2 may hold only the experts
 * [first_expert, first_expert + num_experts) of config.global_experts (0: global_experts =
 * num_experts, the whole op). Routing is then over all global experts (router_w is
 * [global_experts, d], given ids are global ids in [0, global_experts)), and a slot whose expert is
 * outside the local range contributes nothing here (not an error); the residual is added as
 * usual, so when the partial outputs of several ranges are summed (fmlp_tp_moe in
 * fusedmlp_nccl.h) pass it to one of them only. The sum over ranges covering [0, global_experts)
 * is the whole op.
 * Types: x, y, residual: one activation dtype (f32, f16, bf16). W1, W2: one dtype, f32, f16, bf16
 * or f8_e4m3; fp8 experts need fp32 scales w1_scale / w2_scale, [E] (one per expert), [E, rows]
 * (one per row of each expert: rows = W1's 2*hidden or hidden, W2's d_out) or [E, row blocks,
 * col blocks] (one per 128 x 128 block, ref and cpu backends: W1 [E, 2 * ceil(hidden / 128),
 * ceil(d / 128)] gated, each expert's gate block rows then its up block rows, as fmlp_mlp's
 * stacked w1; [E, ceil(hidden / 128), ceil(d / 128)] dense; W2 [E, ceil(d_out / 128),
 * ceil(hidden / 128)]), finite and > 0, and are dequantised exactly (W[e][r][c] * scale[e][r],
 * as in fmlp_mlp); fmlp_quantize_fp8 on each expert's [rows, cols] (gated block scales: on its
 * gate and up halves) makes them. fp8 experts run on the ref and cpu backends (the cuda entries
 * stream 16-bit weights). Wr: f32, f16 or bf16; biases f32, f16 or bf16.
 * Shapes: E = config.num_experts = W1.shape[0] = W2.shape[0]; Wr.shape[0] = the global expert
 * count (E without a local range); 1 <= top_k <= global experts;
 * d, hidden, d_out > 0; T may be 0 (nothing is done). residual may be the very same view as y.
 * topk_ids: int32, topk_weights: fp32, both [T, top_k] contiguous row-major, in the memory x is in;
 * pass both (and no router) or neither. Host ids are checked in validation: one outside [0, G)
 * (G: the global expert count) gives FMLP_ERROR_INDEX_OUT_OF_RANGE naming the token and the
 * value, and y is untouched. Device ids (cuda backend) are not read on the host, which would
 * synchronise: an id outside [0, G) is never used as an index, its slot is skipped, the token's
 * whole row of y is written as NaN, and the event is counted in the workspace;
 * fmlp_moe_device_errors reads the count.
 * Workspaces follow the mlp contract (the zeroed part of a cuda workspace is left zero except for
 * that count).
 * Accumulation is fp32 or wider. The cpu backend is deterministic (fixed summation order whatever
 * the thread count); the cuda backend is with config.deterministic set, and in practice at decode
 * sizes (it falls back to atomic fp32 sums only for large T * top_k * d_out without it). cuda
 * experts are bf16 or f16 (x is rounded to the weights' dtype for the tensor cores, h too). */
typedef enum fmlp_moe_scoring_t {
  FMLP_MOE_SCORING_SOFTMAX = 0,
  FMLP_MOE_SCORING_SIGMOID = 1,
  FMLP_MOE_SCORING_MAX_ENUM = 0x7fffffff /* not a value (see FMLP_DTYPE_MAX_ENUM) */
} fmlp_moe_scoring_t;

typedef struct fmlp_moe_config_t {
  int32_t num_experts; /* E >= 1: the experts held in w1/w2 */
  int32_t top_k;       /* k, 1 <= k <= global experts */
  fmlp_activation_t activation;
  int32_t gated; /* 0: dense, 1: gated (W1 stacked [gate; up]) */
  fmlp_moe_scoring_t scoring;
  int32_t renormalize; /* 1: the k router weights are divided by their sum */
  int32_t deterministic;
  int32_t first_expert;   /* global id of local expert 0 (expert parallelism); 0 otherwise */
  int32_t global_experts; /* experts routed over (router rows); 0 = num_experts (no range) */
  /* 1: the router's logits are rounded to x's dtype (f16/bf16) before scoring, as a 16-bit
   * nn.Linear router produces them (Hugging Face Mixtral, Qwen-MoE): the routing then matches
   * such a model's, exact ties aside (which expert wins a tie of rounded logits is the
   * framework's choice; here the lower id). 0: logits kept in fp32 or wider (the default). No
   * effect with f32 x or given routing. */
  int32_t round_router_logits;
} fmlp_moe_config_t;

typedef struct fmlp_moe_args_t {
  fmlp_tensor_t y;           /* [T, d_out] */
  fmlp_tensor_t x;           /* [T, d] */
  fmlp_tensor_t residual;    /* optional [T, d_out] */
  fmlp_tensor_t router_w;    /* [E, d]; absent when the routing is given */
  fmlp_tensor_t router_b;    /* optional [E] */
  const int32_t* topk_ids;   /* [T, top_k] or NULL (then the router runs) */
  const float* topk_weights; /* [T, top_k] or NULL */
  fmlp_tensor_t w1;          /* [E, hidden or 2*hidden, d] */
  fmlp_tensor_t b1;          /* optional [E, hidden or 2*hidden] */
  fmlp_tensor_t w2;          /* [E, d_out, hidden] */
  fmlp_tensor_t b2;          /* optional [E, d_out] */
  fmlp_moe_config_t config;
  fmlp_tensor_t w1_scale; /* fp8 w1 only: fp32 [E], [E, hidden or 2*hidden] or 3-D blocks */
  fmlp_tensor_t w2_scale; /* fp8 w2 only: fp32 [E], [E, d_out] or 3-D blocks */
} fmlp_moe_args_t;

/* softmax scoring, renormalize on, deterministic, silu, dense, all experts local. */
FMLP_API fmlp_moe_config_t fmlp_moe_config_default(int32_t num_experts, int32_t top_k);
FMLP_API fmlp_status_t fmlp_moe_workspace_size(const fmlp_moe_args_t* args, fmlp_backend_t backend,
                                               size_t* bytes);
FMLP_API fmlp_status_t fmlp_moe(const fmlp_moe_args_t* args, fmlp_backend_t backend,
                                void* workspace, size_t workspace_bytes, void* stream);
FMLP_API fmlp_status_t fmlp_moe_explain(const fmlp_moe_args_t* args, fmlp_backend_t backend,
                                        char* buf, size_t buf_size, size_t* needed);
FMLP_API int fmlp_moe_kernel_count(void);
FMLP_API const char* fmlp_moe_kernel_name(int index);
FMLP_API fmlp_backend_t fmlp_moe_kernel_backend(int index);
FMLP_API fmlp_status_t fmlp_moe_kernel_supports(const fmlp_moe_args_t* args, const char* kernel);
FMLP_API fmlp_status_t fmlp_moe_kernel_workspace_size(const fmlp_moe_args_t* args,
                                                      const char* kernel, size_t* bytes);
FMLP_API fmlp_status_t fmlp_moe_with_kernel(const fmlp_moe_args_t* args, const char* kernel,
                                            void* workspace, size_t workspace_bytes, void* stream);
/* The number of device expert ids outside [0, global experts) met by the cuda fmlp_moe calls that
 * used this workspace since the last read, then reset to 0. Synchronises `stream` (the stream of
 * those calls): call it outside graph capture. FMLP_ERROR_INVALID_VALUE when workspace is not
 * device memory. */
FMLP_API fmlp_status_t fmlp_moe_device_errors(void* workspace, size_t workspace_bytes, void* stream,
                                              int32_t* count);

#ifdef __cplusplus
}
#endif
#endif /* FUSEDMLP_FUSEDMLP_H */
