// fusedmlp quantize: a weight matrix to float8 e4m3 codes plus fp32 dequantisation scales, through
// fmlp_quantize_fp8 (the policy is documented there and printed here). Files are NumPy .npy so
// any framework can produce and read them: the input float32 or float16 [rows, cols] (bfloat16,
// which .npy cannot name, as a raw little-endian file with --raw-shape), the output codes as
// uint8 [rows, cols] (numpy: np.load(path).view(ml_dtypes.float8_e4m3fn); torch:
// .view(torch.float8_e4m3fn)) and the scales as float32 [rows], [1] or, with --block,
// [ceil(rows / 128), ceil(cols / 128)] (one per 128 x 128 block, the fine-grained fp8 layout;
// --gate-up: a stacked gated w1 [2 * hidden, cols] quantised as its two halves, the scales
// [2 * ceil(hidden / 128), ceil(cols / 128)] that fmlp_mlp / fmlp_moe read for it).
#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "commands.hpp"

namespace fmlp_cli {
namespace {

struct QuantizeOptions {
  std::string in, out, scales, raw_dtype;
  std::vector<int64_t> raw_shape;
  bool per_tensor = false, block = false, gate_up = false;
};

struct Matrix {
  fmlp_dtype_t dtype = FMLP_DTYPE_INVALID;
  int64_t rows = 0, cols = 0;
  std::vector<char> bytes;
};

std::vector<char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw CliError(fmt::format("cannot open {}: {}", path, std::strerror(errno)));
  return std::vector<char>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// The value of `key` in a .npy header dict ("{'descr': '<f4', 'fortran_order': False, ...}").
std::string header_field(const std::string& header, const std::string& key,
                         const std::string& path) {
  const size_t k = header.find("'" + key + "'");
  const size_t colon = k == std::string::npos ? k : header.find(':', k);
  if (colon == std::string::npos)
    throw CliError(fmt::format("{}: .npy header has no '{}' ({})", path, key, header));
  size_t b = header.find_first_not_of(' ', colon + 1);
  size_t e = header[b] == '(' ? header.find(')', b) + 1 : header.find_first_of(",}", b);
  return header.substr(b, e - b);
}

Matrix read_npy(const std::string& path) {
  const std::vector<char> f = read_file(path);
  static const char kMagic[] = "\x93NUMPY";
  if (f.size() < 10 || std::memcmp(f.data(), kMagic, 6) != 0)
    throw CliError(
        fmt::format("{} is not a .npy file (no \\x93NUMPY magic); for raw bfloat16 "
                    "bytes pass --raw-dtype bf16 --raw-shape ROWS,COLS",
                    path));
  const int major = static_cast<unsigned char>(f[6]);
  const size_t len_bytes = major == 1 ? 2 : 4, start = 8 + len_bytes;
  size_t hlen = 0;
  for (size_t i = 0; i < len_bytes; ++i)
    hlen |= size_t(static_cast<unsigned char>(f[8 + i])) << (8 * i);
  if (f.size() < start + hlen) throw CliError(fmt::format("{}: truncated .npy header", path));
  const std::string header(f.data() + start, hlen);
  const std::string descr = header_field(header, "descr", path);
  Matrix m;
  if (descr == "'<f4'")
    m.dtype = FMLP_DTYPE_F32;
  else if (descr == "'<f2'")
    m.dtype = FMLP_DTYPE_F16;
  else
    throw CliError(
        fmt::format("{}: dtype {} is not float32 ('<f4') or float16 ('<f2'); convert "
                    "it, or pass bfloat16 as raw bytes with --raw-dtype bf16",
                    path, descr));
  if (header_field(header, "fortran_order", path) != "False")
    throw CliError(
        fmt::format("{}: Fortran-ordered array; save it C-contiguous "
                    "(np.ascontiguousarray)",
                    path));
  std::string shape = header_field(header, "shape", path);
  std::vector<int64_t> dims;
  std::stringstream ss(shape.substr(1, shape.size() - 2));
  for (std::string item; std::getline(ss, item, ',');)
    if (item.find_first_not_of(' ') != std::string::npos) dims.push_back(std::stoll(item));
  if (dims.size() != 2)
    throw CliError(fmt::format("{}: shape {} is not 2-D [rows, cols]", path, shape));
  m.rows = dims[0], m.cols = dims[1];
  const size_t need = size_t(m.rows) * size_t(m.cols) * (m.dtype == FMLP_DTYPE_F32 ? 4 : 2);
  if (f.size() - start - hlen != need)
    throw CliError(fmt::format("{}: {} data bytes for shape {}, expected {}", path,
                               f.size() - start - hlen, shape, need));
  m.bytes.assign(f.begin() + std::ptrdiff_t(start + hlen), f.end());
  return m;
}

Matrix read_raw(const QuantizeOptions& o) {
  if (o.raw_shape.size() != 2 || o.raw_shape[0] <= 0 || o.raw_shape[1] <= 0)
    throw CliError("--raw-shape takes ROWS,COLS (two positive sizes)");
  Matrix m;
  m.dtype = weight_dtype_names().at(o.raw_dtype);
  m.rows = o.raw_shape[0], m.cols = o.raw_shape[1];
  m.bytes = read_file(o.in);
  const size_t need = size_t(m.rows) * size_t(m.cols) * (m.dtype == FMLP_DTYPE_F32 ? 4 : 2);
  if (m.bytes.size() != need)
    throw CliError(fmt::format("{} holds {} bytes; --raw-shape {}x{} of {} needs {}", o.in,
                               m.bytes.size(), m.rows, m.cols, o.raw_dtype, need));
  return m;
}

void write_npy(const std::string& path, const char* descr, const std::vector<int64_t>& shape,
               const void* data, size_t bytes) {
  std::string dims;
  for (int64_t d : shape) dims += fmt::format("{},{}", d, shape.size() > 1 ? " " : "");
  if (shape.size() > 1) dims.pop_back(), dims.pop_back();
  std::string header =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}), }}", descr, dims);
  header.append(63 - (10 + header.size()) % 64, ' ');  // header + magic a multiple of 64
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  const uint16_t len = uint16_t(header.size());
  const char version[2] = {1, 0};
  f.write("\x93NUMPY", 6).write(version, 2);
  f.write(reinterpret_cast<const char*>(&len), 2).write(header.data(), std::streamsize(len));
  f.write(static_cast<const char*>(data), std::streamsize(bytes));
  if (!f) throw CliError(fmt::format("cannot write {}: {}", path, std::strerror(errno)));
}

int run_quantize(const QuantizeOptions& o) {
  Matrix m = o.raw_dtype.empty() ? read_npy(o.in) : read_raw(o);
  std::vector<uint8_t> q(size_t(m.rows) * size_t(m.cols));
  if (o.block && o.per_tensor)
    throw CliError("--block and --per-tensor pick different scale layouts; pass one of them");
  if (o.gate_up && !o.block)
    throw CliError(
        "--gate-up splits a stacked gated w1 into its block-scaled halves; pass "
        "--block with it (per-row scales need no split)");
  if (o.gate_up && m.rows % 2 != 0)
    throw CliError(
        fmt::format("--gate-up: {} has {} rows; a stacked gated w1 has 2 * hidden "
                    "(gate rows, then up rows)",
                    o.in, m.rows));
  // --gate-up: each half's own blocks, the gate's block rows first.
  const int halves = o.gate_up ? 2 : 1;
  const int64_t half_rows = m.rows / halves, hb = (half_rows + 127) / 128;
  const int64_t rb = halves * hb, cb = (m.cols + 127) / 128;
  std::vector<float> scale(o.block ? size_t(rb * cb) : o.per_tensor ? 1 : size_t(m.rows));
  float amax = 0.f;
  const size_t es = m.dtype == FMLP_DTYPE_F32 ? 4 : 2;
  for (int i = 0; i < halves; ++i) {
    const int64_t r0 = i * half_rows;
    const fmlp_tensor_t wi = fmlp_tensor_2d(m.bytes.data() + size_t(r0 * m.cols) * es, m.dtype,
                                            half_rows, m.cols, m.cols);
    const fmlp_tensor_t qt = fmlp_tensor_2d(q.data() + size_t(r0 * m.cols), FMLP_DTYPE_F8_E4M3,
                                            half_rows, m.cols, m.cols);
    const fmlp_tensor_t st =
        o.block ? fmlp_tensor_2d(scale.data() + size_t(i * hb * cb), FMLP_DTYPE_F32, hb, cb, cb)
                : fmlp_tensor_1d(scale.data(), FMLP_DTYPE_F32, int64_t(scale.size()));
    float part = 0.f;
    check_status(fmlp_quantize_fp8(&wi, &qt, &st, &part), "quantize " + o.in);
    amax = std::max(amax, part);
  }
  write_npy(o.out, "|u1", {m.rows, m.cols}, q.data(), q.size());
  if (o.block)
    write_npy(o.scales, "<f4", {rb, cb}, scale.data(), scale.size() * 4);
  else
    write_npy(o.scales, "<f4", {int64_t(scale.size())}, scale.data(), scale.size() * 4);
  const std::string layout = o.block        ? fmt::format("[{}, {}]", rb, cb)
                             : o.per_tensor ? std::string("[1]")
                                            : fmt::format("[{}]", m.rows);
  fmt::print(
      "{}: {} x {} {} -> {} (e4m3 codes, uint8) + {} (float32 scales, {})\n"
      "amax {:g}; scale = amax / 448 per {}, q = e4m3(w / scale) rounded to nearest even, "
      "NaN kept, +-Inf and overflow saturated to +-448; w ~= q * scale\n",
      o.in, m.rows, m.cols, fmlp_dtype_name(m.dtype), o.out, o.scales, layout, amax,
      o.gate_up      ? "128 x 128 block of each half (gate rows, then up rows)"
      : o.block      ? "128 x 128 block"
      : o.per_tensor ? "tensor"
                     : "row");
  return 0;
}

}  // namespace

void add_quantize_command(CLI::App& app, Command* selected) {
  auto o = std::make_shared<QuantizeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "quantize",
      "Weights [rows, cols] (.npy float32/float16, or raw bf16) -> float8 e4m3 codes + fp32 "
      "scales (per row, per tensor, or per 128 x 128 block), for fp8 mlp/linear weights");
  cmd->add_option("input", o->in, "Input .npy (float32 or float16, C order, 2-D)")->required();
  cmd->add_option("--out", o->out, "Output .npy of the e4m3 codes (uint8 [rows, cols])")
      ->required();
  cmd->add_option("--scales", o->scales,
                  "Output .npy of the fp32 scales ([rows], [1] or the block grid)")
      ->required();
  cmd->add_flag("--per-tensor", o->per_tensor, "One scale for the whole matrix (default: per row)");
  cmd->add_flag("--block", o->block,
                "One scale per 128 x 128 block, [ceil(rows / 128), ceil(cols / 128)] (linear on "
                "the ref and cpu backends takes it)");
  cmd->add_flag("--gate-up", o->gate_up,
                "With --block: the input is a stacked gated w1 [2 * hidden, cols]; quantise the "
                "gate and up halves apart, scales [2 * ceil(hidden / 128), ceil(cols / 128)] "
                "(what mlp and moe read for a stacked w1)");
  cmd->add_option("--raw-dtype", o->raw_dtype,
                  "Read the input as raw little-endian bytes of this dtype (f32, f16, bf16)")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  cmd->add_option("--raw-shape", o->raw_shape, "ROWS,COLS of a raw input")->delimiter(',');
  cmd->callback([selected, o] { *selected = [o] { return run_quantize(*o); }; });
}

}  // namespace fmlp_cli
