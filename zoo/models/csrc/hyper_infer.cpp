// Compiled inference loop of the HyperLSTM stack, eval mode (zoo/models/_compiled.py builds and loads it).
//
// The same loop as `_forward(..., store=False)` in zoo/models/_hyper_fast.py, for the no-dropout case:
// layers run layer-major, W_x x and the hyper cell's x-columns are hoisted over the segment, and per step
// the four products (hyper cell, z, the batched d / beta, W_h h) stay ATen calls while the gate
// arithmetic, the layer norms and the cell updates are plain loops. tanh(a) = 2 sigmoid(2a) - 1 through
// one vectorised ATen sigmoid per cell (as the Python path does for large tensors). float32, no autograd.
//
// Per layer (weights, 11 tensors; `_LayerW` in _hyper_fast.py derives them, forget bias folded in):
//   w_xh [4n, n_in], w_hh_t [n, 4n], whx [4nh, n_in], wh_t [n + nh, 4nh], b_hat [4nh],
//   zw_t [nh, 12nz], zw_b [12nz], ab [12, nz, n], c12 [12, 1, n],
//   ln_main [10, n]: gamma4 (4 rows), beta4 (4 rows), gamma_c, beta_c; or empty without layer norm,
//   ln_hyper [10, nh]: the same for the hyper cell.
// cfg per layer: n_in, n, nh, nz, layer_norm.  State per layer: h, c, h_hat, c_hat.
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

using at::Tensor;

namespace {

constexpr int kCfg = 5;
constexpr int kWeights = 11;
constexpr float kEps = 1e-3f;  // supercell's layer-norm epsilon

inline float* fp(const Tensor& t) { return t.data_ptr<float>(); }

// Layer norm of one row of n values into `out` (biased variance, as torch.native_layer_norm).
inline void layer_norm_row(const float* x, int64_t n, const float* gamma, const float* beta, float* out) {
  double mean = 0.0;
  for (int64_t j = 0; j < n; ++j) mean += x[j];
  mean /= static_cast<double>(n);
  double var = 0.0;
  for (int64_t j = 0; j < n; ++j) { const double d = x[j] - mean; var += d * d; }
  var /= static_cast<double>(n);
  const float m = static_cast<float>(mean);
  const float rstd = static_cast<float>(1.0 / std::sqrt(var + kEps));
  for (int64_t j = 0; j < n; ++j) out[j] = (x[j] - m) * rstd * gamma[j] + beta[j];
}

// supercell's cell update on pre-activations `pre [B, 4n]` (gate blocks i, j, f, o; forget bias folded in),
// in place: `pre` becomes the activations. `c [B, n]` is updated; h goes to `h_out` (row stride h_stride).
// `ln` points at the 10 n-rows (gamma4, beta4, gamma_c, beta_c) or is nullptr; `tc` is scratch [B, n].
void cell(Tensor& pre, float* c, int64_t B, int64_t n, const float* ln, Tensor& tc, float* h_out,
          int64_t h_stride) {
  float* p = fp(pre);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < 4; ++g) {
      float* row = p + (b * 4 + g) * n;
      if (ln) layer_norm_row(row, n, ln + g * n, ln + (4 + g) * n, row);
      if (g == 1) for (int64_t j = 0; j < n; ++j) row[j] *= 2.0f;   // tanh(j) = 2 sigmoid(2j) - 1
    }
  }
  pre.sigmoid_();
  float* t = fp(tc);
  for (int64_t b = 0; b < B; ++b) {
    const float* a = p + b * 4 * n;
    float* cb = c + b * n;
    for (int64_t j = 0; j < n; ++j) cb[j] = a[2 * n + j] * cb[j] + a[j] * (2.0f * a[n + j] - 1.0f);
    float* tb = t + b * n;
    if (ln) layer_norm_row(cb, n, ln + 8 * n, ln + 9 * n, tb);
    else std::memcpy(tb, cb, n * sizeof(float));
    for (int64_t j = 0; j < n; ++j) tb[j] *= 2.0f;
  }
  tc.sigmoid_();
  for (int64_t b = 0; b < B; ++b) {
    const float* a = p + b * 4 * n;
    const float* tb = t + b * n;
    float* hb = h_out + b * h_stride;
    for (int64_t j = 0; j < n; ++j) hb[j] = a[3 * n + j] * (2.0f * tb[j] - 1.0f);
  }
}

}  // namespace

std::vector<Tensor> hyper_infer(const Tensor& x_in, const std::vector<Tensor>& state,
                                const std::vector<Tensor>& weights, const std::vector<int64_t>& cfg) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "hyper_infer: float32 CPU only");
  at::NoGradGuard no_grad;
  const int64_t n_layers = static_cast<int64_t>(cfg.size()) / kCfg;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeights * n_layers &&
              static_cast<int64_t>(state.size()) == 4 * n_layers, "hyper_infer: inconsistent arguments");
  const int64_t B = x_in.size(0), T = x_in.size(1);
  const auto opt = x_in.options();
  Tensor inp = x_in.transpose(0, 1).contiguous();  // [T, B, n_in]
  std::vector<Tensor> new_state;
  for (int64_t l = 0; l < n_layers; ++l) {
    const int64_t* k = cfg.data() + l * kCfg;
    const int64_t n_in = k[0], n = k[1], nh = k[2], nz = k[3];
    const bool ln = k[4];
    const Tensor* w = weights.data() + kWeights * l;
    const Tensor &w_xh = w[0], &w_hh_t = w[1], &whx = w[2], &wh_t = w[3], &b_hat = w[4], &zw_t = w[5],
                 &zw_b = w[6], &ab = w[7], &c12 = w[8];
    for (int i = 1; i < 9; ++i) TORCH_CHECK(w[i].is_contiguous(), "hyper_infer: weights must be contiguous");
    const float* ln_main = ln ? fp(w[9]) : nullptr;
    const float* ln_hyper = ln ? fp(w[10]) : nullptr;
    Tensor Xf = inp.view({T * B, n_in});
    Tensor WX = at::mm(Xf, w_xh.t()).view({T, B, 4 * n});             // hoisted main W_x x
    Tensor HX = at::addmm(b_hat, Xf, whx.t()).view({T, B, 4 * nh});    // hoisted hyper x-part + bias
    const Tensor* s0 = state.data() + 4 * l;
    Tensor V = at::empty({B, n + nh}, opt);                            // [h_{t-1} | h^_{t-1}]
    Tensor c = s0[1].contiguous().clone(), ch = s0[3].contiguous().clone();
    V.narrow(1, 0, n).copy_(s0[0]);
    V.narrow(1, n, nh).copy_(s0[2]);
    Tensor H = at::empty({T, B, n}, opt);                               // the layer's outputs
    Tensor pre_h = at::empty({B, 4 * nh}, opt), tch = at::empty({B, nh}, opt);
    Tensor z = at::empty({B, 12 * nz}, opt), S = at::empty({12, B, n}, opt);
    Tensor wh = at::empty({B, 4 * n}, opt), pre = at::empty({B, 4 * n}, opt), tc = at::empty({B, n}, opt);
    Tensor h_hat = V.narrow(1, n, nh), h_prev = V.narrow(1, 0, n);
    float* v = fp(V);
    const int64_t vs = n + nh;
    for (int64_t t = 0; t < T; ++t) {
      // hyper cell (Eq. 10): pre = HX[t] + [h; h^] wh, then its update writes h^_t into V's h^ columns
      at::addmm_out(pre_h, HX[t], V, wh_t);
      cell(pre_h, fp(ch), B, nh, ln_hyper, tch, v + n, vs);
      // z, then d and beta (the static bias in c12's beta slots) for the 12 blocks (Eqs. 11-12)
      at::addmm_out(z, zw_b, h_hat, zw_t);
      at::baddbmm_out(S, c12, z.view({B, 12, nz}).transpose(0, 1), ab);
      at::mm_out(wh, h_prev, w_hh_t);
      const float* s = fp(S);
      const float* wx = fp(WX) + t * B * 4 * n;
      const float* whp = fp(wh);
      float* pp = fp(pre);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t g = 0; g < 4; ++g) {
          const float* dx = s + (g * B + b) * n;
          const float* dh = s + ((4 + g) * B + b) * n;
          const float* bt = s + ((8 + g) * B + b) * n;
          const float* xr = wx + (b * 4 + g) * n;
          const float* hr = whp + (b * 4 + g) * n;
          float* out = pp + (b * 4 + g) * n;
          for (int64_t j = 0; j < n; ++j) out[j] = dx[j] * xr[j] + dh[j] * hr[j] + bt[j];
        }
      }
      float* h_t = fp(H) + t * B * n;
      cell(pre, fp(c), B, n, ln_main, tc, h_t, n);
      for (int64_t b = 0; b < B; ++b) std::memcpy(v + b * vs, h_t + b * n, n * sizeof(float));
    }
    new_state.push_back(H[T - 1].clone());
    new_state.push_back(c);
    new_state.push_back(h_hat.clone());
    new_state.push_back(ch);
    inp = H;
  }
  std::vector<Tensor> res{inp.transpose(0, 1).contiguous()};
  res.insert(res.end(), new_state.begin(), new_state.end());
  return res;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("hyper_infer", &hyper_infer, "HyperLSTM stack inference over a segment, eval mode (no autograd)");
}
