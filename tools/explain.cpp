// fusedmlp explain: which kernel the library picks for a problem, and why the others are not.
#include <memory>

#include "commands.hpp"
#include "fusedmlp/fusedmlp.hpp"
#include "workloads.hpp"

namespace fmlp_cli {
namespace {

struct ExplainOptions {
  int64_t d_in = 0, hidden = 0, d_out = 0, m = 1;
  fmlp_activation_t act = FMLP_ACT_GELU;
  bool gated = false, stacked = false, bias = false, residual = false;
  fmlp_norm_t norm = FMLP_NORM_NONE;
  fmlp_backend_t backend = FMLP_BACKEND_AUTO;
  fmlp_dtype_t act_dtype = FMLP_DTYPE_F32;
  fmlp_dtype_t w_dtype = FMLP_DTYPE_BF16;
};

fmlp_tensor_t on_device_if(bool cuda, fmlp_tensor_t t) {
  return cuda && t.data != nullptr ? fmlp::on_cuda(t) : t;
}

int run_explain(const ExplainOptions& o) {
  if (o.d_in <= 0 || o.hidden <= 0 || o.d_out < 0 || o.m < 0)
    throw CliError(
        fmt::format("sizes must be positive (got --d-in {} --hidden {} --d-out {} "
                    "-m {}); M may be 0",
                    o.d_in, o.hidden, o.d_out, o.m));
  if (o.stacked && !o.gated) throw CliError("--stacked needs --gated");
  MlpShape s;
  s.d_in = o.d_in;
  s.hidden = o.hidden;
  s.d_out = o.d_out > 0 ? o.d_out : o.d_in;
  s.act = o.act;
  s.gated = o.gated;
  s.stacked = o.stacked;
  s.bias = o.bias;
  s.norm = o.norm;
  // Real host buffers, never written or read: validation needs valid views, explain runs nothing.
  const WeightSet w = allocate_weights(s, o.w_dtype);
  const HostTensor x(o.act_dtype, o.m, s.d_in), y(o.act_dtype, o.m, s.d_out);
  fmlp_mlp_args_t a{};
  a.x = x.view();
  a.y = y.view();
  a.residual = o.residual ? a.y : fmlp_tensor_none();
  a.weights = w.view();
  a.config = make_config(s);
  // The cuda backend only accepts device views; labelling the host buffers as device memory is
  // enough for selection, which never dereferences them.
  const bool cuda = o.backend == FMLP_BACKEND_CUDA;
  if (cuda) {
    fmlp_mlp_weights_t& v = a.weights;
    for (fmlp_tensor_t* t :
         {&a.x, &a.y, &a.residual, &v.w1, &v.w1_scale, &v.b1, &v.w_up, &v.w_up_scale, &v.b_up,
          &v.w2, &v.w2_scale, &v.b2, &v.norm_weight, &v.norm_bias})
      *t = on_device_if(true, *t);
  }
  size_t needed = 0;
  check_status(fmlp_mlp_explain(&a, o.backend, nullptr, 0, &needed), "fmlp_mlp_explain");
  std::string report(needed, '\0');
  check_status(fmlp_mlp_explain(&a, o.backend, report.data(), report.size(), &needed),
               "fmlp_mlp_explain");
  report.resize(needed - 1);
  fmt::print("{}", report);
  return 0;
}

}  // namespace

void add_explain_command(CLI::App& app, Command* selected) {
  auto o = std::make_shared<ExplainOptions>();
  CLI::App* cmd = app.add_subcommand(
      "explain", "Show the kernel the library picks for a problem and why others are rejected");
  cmd->add_option("--d-in", o->d_in, "Input features")->required();
  cmd->add_option("--hidden", o->hidden, "Hidden features (per gate/up half when gated)")
      ->required();
  cmd->add_option("--d-out", o->d_out, "Output features (default: d_in)");
  cmd->add_option("-m,--m", o->m, "Rows of x (tokens)")->capture_default_str();
  cmd->add_option("--act", o->act, "Activation")
      ->transform(choice_of(activation_names()))
      ->default_str("gelu");
  cmd->add_flag("--gated", o->gated, "Gated MLP: act(x Wg^T) * (x Wu^T)");
  cmd->add_flag("--stacked", o->stacked, "Gated with gate and up stacked in one w1");
  cmd->add_flag("--bias", o->bias, "With biases b1 (b_up) and b2");
  cmd->add_flag("--residual", o->residual, "With an in-place residual add (residual = y)");
  cmd->add_option("--norm", o->norm, "Input norm")
      ->transform(choice_of(norm_names()))
      ->default_str("none");
  cmd->add_option("--backend", o->backend, "Backend to explain")
      ->transform(choice_of(backend_names()))
      ->default_str("auto");
  cmd->add_option("--act-dtype", o->act_dtype, "Activation dtype of x and y")
      ->transform(choice_of(act_dtype_names()))
      ->default_str("f32");
  cmd->add_option("--w-dtype", o->w_dtype, "Weight dtype")
      ->transform(choice_of(weight_dtype_names()))
      ->default_str("bf16");
  cmd->callback([o, selected] { *selected = [o] { return run_explain(*o); }; });
}

}  // namespace fmlp_cli
