// One mlp test case, end to end: its description (MlpCase), random data (CaseData), the double
// reference (Reference), the tensors placed in host or device memory with the case's layout
// (PlacedCase), a run through one op-table entry and the comparison with the reference.
#pragma once
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "buffers.hpp"
#include "fusedmlp/fusedmlp.h"

namespace fmlp_test {

// FMLP_TEST_SEED when set, else the clock; fixed for the process and printed on first use.
uint64_t test_seed();
// The value of the environment knob `name` (core/knobs.def, through fmlp_knob_info): the
// environment's text when the library accepts it, else its default ("auto", "0", "" ...); a
// rejected value is reported on stderr.
std::string knob_value(const char* name);
uint64_t mix_seed(uint64_t a, uint64_t b);
using Rng = std::mt19937_64;

enum class Gate { kDense, kStacked, kSeparate };
enum class Residual { kNone, kSeparate, kInPlace };
constexpr fmlp_dtype_t kAbsent = FMLP_DTYPE_INVALID;

struct MlpCase {
  int64_t m = 1, d_in = 8, hidden = 8, d_out = 8;
  fmlp_activation_t act = FMLP_ACT_GELU;
  Gate gate = Gate::kDense;
  fmlp_dtype_t x_dtype = FMLP_DTYPE_F32;  // x, y and residual
  fmlp_dtype_t w_dtype = FMLP_DTYPE_F32;  // w1, w_up, w2
  bool per_row_scale = false;             // fp8 weights: [rows] scales instead of [1]
  // fp8 weights: 2-D 128 x 128 block scales for W1 and W_up (a stacked W1: the gate's block rows,
  // then the up's) / for W2, instead of per_row_scale's kind; each block its own scale.
  bool block_w1 = false, block_w2 = false;
  bool fp8_all_codes = false;  // fp8 weights: codes drawn from every finite non-zero code
                               // (subnormals and 448 included) instead of about +-16
  bool nan_weights = false;    // fp8 weights: w2 holds a 0x7f NaN in row 0, 0xff in the last row
  fmlp_dtype_t b1 = kAbsent, b_up = kAbsent, b2 = kAbsent;
  fmlp_norm_t norm = FMLP_NORM_NONE;
  fmlp_dtype_t gamma = kAbsent, beta = kAbsent;
  Residual residual = Residual::kNone;
  bool misaligned = false;      // every base pointer one element past a 256-byte boundary
  bool strided = false;         // row stride > row length for x, y, residual and weights
  bool packed_weights = false;  // misaligned / strided leave W1, W_up and W2 alone: 16-byte
                                // aligned bases and contiguous rows, as fmlp_mlp_pack makes them
  bool nonfinite = false;       // x row 0 holds a NaN, row 1 a +Inf (needs m >= 3)
  bool deterministic = false;
  uint64_t data_seed = 0;

  std::string name() const;
  fmlp_mlp_config_t config() const;
  bool gated() const { return gate != Gate::kDense; }
  int64_t macs() const { return m * (d_in * hidden * (gated() ? 2 : 1) + hidden * d_out); }
};

// Draws every axis at random (shapes from {1, 7, 64, 127, 769}, capped at `max_macs`).
MlpCase random_case(Rng& rng, int64_t max_macs);
// Makes the case valid after axes were overridden (drops b_up when not separate, beta without
// LayerNorm, nonfinite when m < 3).
void normalize(MlpCase* c);

// A row-major contiguous matrix (cols = 0: a vector) of encoded values.
struct HostMatrix {
  fmlp_dtype_t dtype = kAbsent;
  int64_t rows = 0, cols = 0;
  std::vector<unsigned char> bytes;
  bool present() const { return dtype != kAbsent; }
  int64_t width() const { return cols == 0 ? 1 : cols; }
  double get(int64_t r, int64_t c) const;
  void set(int64_t r, int64_t c, double v);  // rounds to dtype (fp8: nearest finite code)
};

struct CaseData {
  HostMatrix x, residual, w1, w1_scale, b1, w_up, w_up_scale, b_up, w2, w2_scale, b2, gamma, beta;
};
// weights ~ U(-1, 1) / sqrt(fan_in), x and residual ~ N(0, 1), biases and norm parameters around
// their neutral values; never zero. `seed` picks the values.
CaseData make_data(const MlpCase& c, uint64_t seed);

struct Reference {
  std::vector<double> y;      // [m, d_out]
  std::vector<double> scale;  // error scale per element, see tolerance.hpp
};
Reference reference(const MlpCase& c, const CaseData& d);

// The case's tensors in host or device memory, laid out as the case says (offsets, strides),
// every byte outside the views 0xFF.
class PlacedCase {
 public:
  PlacedCase(const MlpCase& c, bool device);
  // Writes every input; y is poisoned with 0xFF (or holds the residual when it is in place).
  void upload(const CaseData& d);
  const fmlp_mlp_args_t& args() const { return args_; }
  bool device() const { return device_; }
  // y decoded to double; *stray gets a message when a byte outside y's view changed.
  std::vector<double> download_y(std::string* stray) const;
  std::vector<unsigned char> y_bytes() const { return slots_[kY].buf.download(); }
  void poison_y() { slots_[kY].buf.fill(0xFF); }

 private:
  enum Slot { kX, kY, kRes, kW1, kW1s, kB1, kWu, kWus, kBu, kW2, kW2s, kB2, kG, kBeta, kSlots };
  struct Placed {
    Buffer buf;
    fmlp_tensor_t view{};
    int64_t offset = 0, rows = 0, cols = 0, stride = 0;  // in elements
  };
  void place(Slot s, fmlp_dtype_t dtype, int64_t rows, int64_t cols, int64_t pad);
  void write(Slot s, const HostMatrix& m);
  MlpCase c_;
  bool device_;
  Placed slots_[kSlots];
  fmlp_mlp_args_t args_{};
};

struct RunOutcome {
  fmlp_status_t status;
  std::string error;
};
// Runs one op-table entry (workspace sized by the library, on the tensors' device) and waits.
// kernel nullptr: dispatch (the cuda backend for device cases); ws (optional) keeps the
// workspace the call used, e.g. to check it was left zero-filled or to capture a graph on it.
RunOutcome run_kernel(const PlacedCase& p, const char* kernel, Buffer* ws = nullptr);

struct CompareOutcome {
  bool ok = true;
  int64_t bad = 0;
  double worst_ratio = 0.0;  // max err / tol over finite elements
  double max_err = 0.0;
  std::string detail;  // the worst failing element, when !ok
};
// gemm_composed: the kernel stores intermediates in the 16-bit dtype (tolerance.hpp); with fp8
// weights such a kernel is W8A8 (the prefill path): kW8A8Rtol per element plus kW8A8RmsBound.
CompareOutcome compare(const MlpCase& c, const std::vector<double>& out, const Reference& ref,
                       bool gemm_composed = false);

}  // namespace fmlp_test
