// A 2-D test tensor for the linear and softmax tests: values staged on the host (HostMatrix),
// placed in host or device memory at an optional one-element offset and padded row stride, every
// byte outside the view 0xFF so stray writes and unwritten outputs show.
#pragma once
#include <string>
#include <vector>

#include "buffers.hpp"
#include "core/dtype.hpp"
#include "fusedmlp/fusedmlp.h"
#include "mlp_case.hpp"

namespace fmlp_test {

class PlacedTensor {
 public:
  PlacedTensor() = default;
  PlacedTensor(fmlp_dtype_t t, int64_t rows, int64_t cols, bool device, bool misaligned,
               bool strided)
      : t_(t), rows_(rows), cols_(cols), off_(misaligned ? 1 : 0), ld_(cols + (strided ? 3 : 0)) {
    es_ = int64_t(fmlp::dtype_size(t));
    buf_ = Buffer(size_t((off_ + std::max<int64_t>(rows, 1) * ld_) * es_), device);
    buf_.fill(0xFF);
    view_ = fmlp_tensor_2d(buf_.bytes_at(size_t(off_ * es_)), t, rows, cols, ld_);
    if (device) view_.device_type = FMLP_DEVICE_CUDA;
  }
  void upload(const HostMatrix& m) {
    std::vector<unsigned char> host(buf_.size(), 0xFF);
    for (int64_t r = 0; r < rows_; ++r)
      std::memcpy(host.data() + (off_ + r * ld_) * es_, m.bytes.data() + r * cols_ * es_,
                  size_t(cols_ * es_));
    buf_.upload(host);
  }
  // The view's values; *stray names a changed byte outside the view.
  std::vector<double> download(std::string* stray) const {
    const std::vector<unsigned char> host = buf_.download();
    std::vector<double> out(size_t(rows_ * cols_));
    for (size_t i = 0; i < host.size(); ++i) {
      const int64_t e = int64_t(i) / es_ - off_;
      const bool inside = int64_t(i) >= off_ * es_ && e / ld_ < rows_ && e % ld_ < cols_;
      if (!inside && host[i] != 0xFF && stray->empty())
        *stray = "byte " + std::to_string(i) + " outside the output view was written";
    }
    for (int64_t r = 0; r < rows_; ++r)
      for (int64_t c = 0; c < cols_; ++c)
        out[size_t(r * cols_ + c)] =
            fmlp::detail::load_as_double(host.data() + (off_ + r * ld_) * es_, t_, c);
    return out;
  }
  const fmlp_tensor_t& view() const { return view_; }
  fmlp_tensor_t vector_view() const {  // [cols] view of a one-row tensor
    fmlp_tensor_t v = fmlp_tensor_1d(view_.data, t_, cols_);
    v.device_type = view_.device_type;
    return v;
  }

 private:
  fmlp_dtype_t t_ = FMLP_DTYPE_F32;
  int64_t rows_ = 0, cols_ = 0, off_ = 0, ld_ = 0, es_ = 4;
  Buffer buf_;
  fmlp_tensor_t view_{};
};

}  // namespace fmlp_test
