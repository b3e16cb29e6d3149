#include "workloads.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "cli_common.hpp"
#include "dtype_convert.hpp"

namespace fmlp_cli {
namespace {

const std::vector<MlpShape>& presets() {
  static const std::vector<MlpShape> p = {
      {"gpt2-small", 768, 3072, 768, FMLP_ACT_GELU_TANH, false, false, true},
      {"seed-4096", 4096, 4096, 4096, FMLP_ACT_GELU, false, false, true},
      {"llama3-8b", 4096, 14336, 4096, FMLP_ACT_SILU, true, false, false},
  };
  return p;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, sep);) out.push_back(part);
  return out;
}

int64_t parse_dim(const std::string& text, const std::string& spec) {
  size_t used = 0;
  long long v = -1;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || v <= 0)
    throw CliError(
        fmt::format("shape '{}': '{}' is not a positive size; write "
                    "DINxHIDDEN[xDOUT]:ACT[:gated][:bias], e.g. 1024x4096:gelu:bias",
                    spec, text));
  return v;
}

// Copies `rows` rows of src (row-major, `cols` wide) into a new tensor.
HostTensor gather_rows(const HostTensor& src, const std::vector<int64_t>& rows) {
  HostTensor out(src.dtype(), int64_t(rows.size()), src.cols());
  const size_t row_bytes = size_t(src.cols()) * dtype_bytes(src.dtype());
  for (size_t i = 0; i < rows.size(); ++i)
    std::memcpy(static_cast<char*>(out.data()) + i * row_bytes,
                static_cast<const char*>(src.data()) + size_t(rows[i]) * row_bytes, row_bytes);
  return out;
}

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const MlpShape& s : presets()) names.push_back(s.name);
  return names;
}

MlpShape parse_shape(const std::string& spec, bool stacked_gate_up) {
  for (MlpShape s : presets())
    if (s.name == spec) {
      s.stacked = s.gated && stacked_gate_up;
      return s;
    }
  const std::vector<std::string> parts = split(spec, ':');
  const std::vector<std::string> dims =
      parts.empty() ? std::vector<std::string>{} : split(parts[0], 'x');
  if (parts.size() < 2 || dims.size() < 2 || dims.size() > 3) {
    std::string known;
    for (const std::string& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
    throw CliError(
        fmt::format("unknown shape '{}'; use a preset ({}) or a custom spec "
                    "DINxHIDDEN[xDOUT]:ACT[:gated][:bias], e.g. 1024x4096:gelu:bias",
                    spec, known));
  }
  MlpShape s;
  s.name = spec;
  s.d_in = parse_dim(dims[0], spec);
  s.hidden = parse_dim(dims[1], spec);
  s.d_out = dims.size() == 3 ? parse_dim(dims[2], spec) : s.d_in;
  const auto act = activation_names().find(parts[1]);
  if (act == activation_names().end())
    throw CliError(
        fmt::format("shape '{}': activation '{}' is unknown; use relu, gelu, "
                    "gelu_tanh or silu",
                    spec, parts[1]));
  s.act = act->second;
  for (size_t i = 2; i < parts.size(); ++i) {
    if (parts[i] == "gated")
      s.gated = true;
    else if (parts[i] == "bias")
      s.bias = true;
    else
      throw CliError(
          fmt::format("shape '{}': flag '{}' is unknown; the flags are 'gated' and "
                      "'bias'",
                      spec, parts[i]));
  }
  s.stacked = s.gated && stacked_gate_up;
  return s;
}

std::string describe(const MlpShape& s) {
  std::string d = fmt::format("{}->{}->{} {}{}", s.d_in, s.hidden, s.d_out, s.gated ? "gated " : "",
                              fmlp_activation_name(s.act));
  if (s.gated) d += s.stacked ? " (stacked gate/up)" : " (separate gate/up)";
  if (s.bias) d += " +bias";
  if (s.norm == FMLP_NORM_LAYERNORM) d += " layernorm";
  if (s.norm == FMLP_NORM_RMSNORM) d += " rmsnorm";
  return d;
}

double mlp_flops(const MlpShape& s, int64_t m) {
  const double up = double(s.d_in) * double(s.hidden) * (s.gated ? 2.0 : 1.0);
  return 2.0 * double(m) * (up + double(s.hidden) * double(s.d_out));
}

fmlp_mlp_weights_t WeightSet::view() const {
  fmlp_mlp_weights_t w{};
  w.w1 = w1.view();
  w.w1_scale = w1_scale.view();
  w.b1 = b1.view();
  w.w_up = w_up.view();
  w.w_up_scale = w_up_scale.view();
  w.b_up = b_up.view();
  w.w2 = w2.view();
  w.w2_scale = w2_scale.view();
  w.b2 = b2.view();
  w.norm_weight = norm_weight.view();
  w.norm_bias = norm_bias.view();
  return w;
}

size_t WeightSet::bytes() const {
  size_t n = 0;
  for (const HostTensor* t : {&w1, &w1_scale, &b1, &w_up, &w_up_scale, &b_up, &w2, &w2_scale, &b2,
                              &norm_weight, &norm_bias})
    n += t->empty() ? 0 : t->bytes();
  return n;
}

WeightSet WeightSet::clone() const {
  return {w1.clone(),         w1_scale.clone(),    b1.clone(),       w_up.clone(),
          w_up_scale.clone(), b_up.clone(),        w2.clone(),       w2_scale.clone(),
          b2.clone(),         norm_weight.clone(), norm_bias.clone()};
}

WeightSet allocate_weights(const MlpShape& s, fmlp_dtype_t w_dtype) {
  const bool fp8 = w_dtype == FMLP_DTYPE_F8_E4M3;
  const fmlp_dtype_t bias_dtype = fp8 ? FMLP_DTYPE_BF16 : w_dtype;
  const bool separate_up = s.gated && !s.stacked;
  const int64_t rows1 = s.gated && s.stacked ? 2 * s.hidden : s.hidden;
  auto scales = [&](int64_t rows) {
    if (!fp8) return HostTensor();
    HostTensor t(FMLP_DTYPE_F32, rows, 0);
    for (int64_t i = 0; i < rows; ++i) t.set(i, 1.0f);
    return t;
  };
  WeightSet w;
  w.w1 = HostTensor(w_dtype, rows1, s.d_in);
  w.w1_scale = scales(rows1);
  if (separate_up) {
    w.w_up = HostTensor(w_dtype, s.hidden, s.d_in);
    w.w_up_scale = scales(s.hidden);
  }
  w.w2 = HostTensor(w_dtype, s.d_out, s.hidden);
  w.w2_scale = scales(s.d_out);
  if (s.bias) {
    w.b1 = HostTensor(bias_dtype, rows1, 0);
    if (separate_up) w.b_up = HostTensor(bias_dtype, s.hidden, 0);
    w.b2 = HostTensor(bias_dtype, s.d_out, 0);
  }
  if (s.norm != FMLP_NORM_NONE) w.norm_weight = HostTensor(FMLP_DTYPE_F32, s.d_in, 0);
  if (s.norm == FMLP_NORM_LAYERNORM) w.norm_bias = HostTensor(FMLP_DTYPE_F32, s.d_in, 0);
  return w;
}

void quantize_weight(const HostTensor& w, HostTensor& q, HostTensor& scale) {
  const fmlp_tensor_t wv = w.view(), qv = q.view(), sv = scale.view();
  check_status(fmlp_quantize_fp8(&wv, &qv, &sv, nullptr), "quantising weights to fp8");
}

namespace {
// A weight matrix ~ bound * U(-1, 1); fp8 ones through the library's quantiser.
void fill_weight(HostTensor& w, HostTensor& scale, float bound, uint64_t seed, uint64_t stream) {
  if (w.dtype() != FMLP_DTYPE_F8_E4M3) return fill_uniform(w, bound, seed, stream);
  HostTensor f(FMLP_DTYPE_F32, w.rows(), w.cols());
  fill_uniform(f, bound, seed, stream);
  quantize_weight(f, w, scale);
}
}  // namespace

WeightSet random_weights(const MlpShape& s, fmlp_dtype_t w_dtype, uint64_t seed) {
  WeightSet w = allocate_weights(s, w_dtype);
  const float bound1 = 1.0f / std::sqrt(float(s.d_in));
  const float bound2 = 1.0f / std::sqrt(float(s.hidden));
  fill_weight(w.w1, w.w1_scale, bound1, seed, 1);
  if (!w.w_up.empty()) fill_weight(w.w_up, w.w_up_scale, bound1, seed, 2);
  fill_weight(w.w2, w.w2_scale, bound2, seed, 3);
  if (!w.b1.empty()) fill_uniform(w.b1, 0.1f, seed, 4);
  if (!w.b_up.empty()) fill_uniform(w.b_up, 0.1f, seed, 5);
  if (!w.b2.empty()) fill_uniform(w.b2, 0.1f, seed, 6);
  if (!w.norm_weight.empty()) {
    fill_uniform(w.norm_weight, 0.1f, seed, 7);
    for (int64_t i = 0; i < s.d_in; ++i) w.norm_weight.set(i, 1.0f + w.norm_weight.get(i));
  }
  if (!w.norm_bias.empty()) fill_uniform(w.norm_bias, 0.1f, seed, 8);
  return w;
}

fmlp_mlp_config_t make_config(const MlpShape& s) {
  fmlp_mlp_config_t c = fmlp_mlp_config_default();
  c.activation = s.act;
  c.gated = s.gated ? 1 : 0;
  c.norm = s.norm;
  return c;
}

HostMlp::HostMlp(const MlpCase& c, uint64_t seed, int copies) : case_(c), seed_(seed) {
  weights_.push_back(random_weights(c.shape, c.w_dtype, seed));
  set_copies(copies);
  set_batch(c.m);
}

void HostMlp::set_copies(int copies) {
  weights_.resize(std::min(weights_.size(), size_t(std::max(copies, 1))));
  while (int(weights_.size()) < copies) weights_.push_back(weights_.front().clone());
}

void HostMlp::set_batch(int64_t m) {
  case_.m = m;
  const uint64_t stream = 16 + 4 * uint64_t(m);  // new data per batch size
  x_ = HostTensor(case_.act_dtype, m, case_.shape.d_in);
  fill_uniform(x_, 1.0f, seed_, stream);
  y_ = HostTensor(case_.act_dtype, m, case_.shape.d_out);
  residual_ = HostTensor();
  if (case_.residual != Residual::kNone) {
    residual_ = HostTensor(case_.act_dtype, m, case_.shape.d_out);
    fill_uniform(residual_, 1.0f, seed_, stream + 1);
  }
  reset_output();
}

fmlp_mlp_args_t HostMlp::args(int copy) const {
  fmlp_mlp_args_t a{};
  a.x = x_.view();
  a.y = y_.view();
  a.residual = case_.residual == Residual::kInPlace    ? a.y
               : case_.residual == Residual::kSeparate ? residual_.view()
                                                       : fmlp_tensor_none();
  a.weights = weights_[size_t(copy)].view();
  a.config = make_config(case_.shape);
  return a;
}

void HostMlp::reset_output() {
  if (case_.residual == Residual::kInPlace)
    std::memcpy(y_.data(), residual_.data(), y_.bytes());
  else
    fill_uniform(y_, 1000.0f, seed_, 15);
}

size_t HostMlp::io_bytes() const {
  return x_.bytes() + y_.bytes() + (case_.residual == Residual::kSeparate ? residual_.bytes() : 0);
}

std::vector<float> HostMlp::output_rows(const std::vector<int64_t>& rows) const {
  std::vector<float> out;
  const int64_t n = case_.shape.d_out;
  for (int64_t r : rows)
    for (int64_t j = 0; j < n; ++j) out.push_back(y_.get(r * n + j));
  return out;
}

std::vector<float> HostMlp::reference_rows(const std::vector<int64_t>& rows) const {
  const HostTensor x = gather_rows(x_, rows);
  HostTensor y(case_.act_dtype, int64_t(rows.size()), case_.shape.d_out);
  HostTensor residual;
  if (case_.residual != Residual::kNone) residual = gather_rows(residual_, rows);
  fmlp_mlp_args_t a = args(0);
  a.x = x.view();
  a.y = y.view();
  a.residual = residual.view();
  size_t ws_bytes = 0;
  check_status(fmlp_mlp_workspace_size(&a, FMLP_BACKEND_REF, &ws_bytes),
               "sizing the ref workspace");
  std::vector<unsigned char> ws(ws_bytes);
  check_status(fmlp_mlp(&a, FMLP_BACKEND_REF, ws.data(), ws.size(), nullptr),
               "the ref backend (reference output)");
  std::vector<float> out(size_t(y.numel()));
  for (int64_t i = 0; i < y.numel(); ++i) out[size_t(i)] = y.get(i);
  return out;
}

std::vector<int64_t> sample_rows(int64_t m) {
  std::vector<int64_t> rows = {0, m / 2, m - 1};
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

}  // namespace fmlp_cli
