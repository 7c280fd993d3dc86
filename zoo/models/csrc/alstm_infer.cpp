// Compiled inference loop of the aLSTM stack (zoo/models/_alstm_infer_ext.py builds and loads it).
//
// Why: at scoring batch sizes (B = 1..8) one aLSTM step is ~30 small tensor operations per layer, and
// from Python each costs several microseconds of dispatch, more than its arithmetic. This is the same
// loop as `_infer` in zoo/models/_alstm_fast.py, in C++: the matrix products and the large sigmoids stay
// ATen calls (MKL / vectorised kernels), while the concatenations, slicing and elementwise gate
// arithmetic between them become plain loops over preallocated buffers. Same arithmetic as the Python
// path (tanh(a) = 2 sigmoid(2a) - 1 where the Python path uses it), float32 only, no autograd.
//
// Interface (flat lists, so no custom pybind types are needed):
//   x        [B, T, n_x] input of layer 0
//   state    per layer: h, c (and z, zc for recurrent adaptation models)
//   weights  per layer: wv [n_a, K], wv_rest_t [K - k0, n_a], ba [n_a], wp_t [n_z, P], w_ih_t [n_x, 4n_h],
//            w_hh_t [n_h, 4n_h], bias [4n_h]: the `_t` ones transposed and contiguous (row-major [in, out]
//            makes the per-step products with a few rows ~5-30% faster than transposed views)
//   masks    per layer: mask_h [B, n_h], mask_z [B, n_z]; an empty tensor means no mask
//   cfg      per layer: n_x, n_h, n_z, n_zb, k0, K, recurrent, io, adaptive_bias, hoist_gi, P
// Column layout of the adaptation input V and the policy vector follow `_Layer` in _alstm_fast.py.
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

using at::Tensor;

namespace {

constexpr int kCfg = 11;
constexpr int kWeights = 7;

struct Layer {
  int64_t nx, nh, nz, nzb, k0, K, na, P;
  bool recurrent, io, ab, hoist_gi;
  int64_t off_ih, off_hh, off_b;                // policy column offsets (pi_x at 0, pi_h at nx when io)
  Tensor wv_t, ba, wp_t, w_ih_t, w_hh_t, bias;  // transposed views for the GEMMs
  Tensor mask_h, mask_z;                        // undefined: none
  Tensor h, c, z, zc;                           // state (owned copies, updated in place)
  Tensor v, a, pi, ux, uh, gi, gh, tc;          // per-step scratch
  Tensor ax, gi_all;                            // hoisted over the segment (undefined: not hoisted)
};

inline float* fp(const Tensor& t) { return t.data_ptr<float>(); }

// One time step of layer `L`. `x_t` is [B, n_x] with row stride `x_stride`; `zb_t` is [B, n_zb]
// (contiguous) or nullptr; `t` indexes the hoisted buffers; `out_h` receives the undropped h (or nullptr).
void step(Layer& L, int64_t B, const float* x_t, int64_t x_stride, const float* zb_t, bool layer_major,
          int64_t t, float* out_h, int64_t out_stride) {
  const int64_t nx = L.nx, nh = L.nh, nz = L.nz;
  // 1. the non-hoisted columns of V: [x (k0 == 0)] [h] [zb (interleaved)] [z (recurrent)]
  const int64_t kv = L.K - L.k0;
  float* v = fp(L.v);
  const float* h = fp(L.h);
  for (int64_t b = 0; b < B; ++b) {
    float* row = v + b * kv;
    if (L.k0 == 0) { std::memcpy(row, x_t + b * x_stride, nx * sizeof(float)); row += nx; }
    std::memcpy(row, h + b * nh, nh * sizeof(float)); row += nh;
    if (L.nzb && !layer_major) { std::memcpy(row, zb_t + b * L.nzb, L.nzb * sizeof(float)); row += L.nzb; }
    if (L.recurrent) std::memcpy(row, fp(L.z) + b * nz, nz * sizeof(float));
  }
  at::addmm_out(L.a, L.ax.defined() ? L.ax[t] : L.ba, L.v, L.wv_t);
  // 2. the adaptation model -> z (dropped)
  float* z = fp(L.z);
  const float* mz = L.mask_z.defined() ? fp(L.mask_z) : nullptr;
  if (L.recurrent) {
    L.a.sigmoid_();  // i, f, o and s_g (the g rows of wv arrive doubled: tanh(g) = 2 s_g - 1)
    const float* a = fp(L.a);
    float* zc = fp(L.zc);
    for (int64_t b = 0; b < B; ++b) {
      const float* ab = a + b * 4 * nz;
      for (int64_t j = 0; j < nz; ++j) {
        const float i = ab[j], f = ab[nz + j], g = ab[2 * nz + j], o = ab[3 * nz + j];
        float& cz = zc[b * nz + j];
        cz = f * cz + i * g * 2.0f - i;
        float zj = o * std::tanh(cz);
        if (mz) zj *= mz[b * nz + j];
        z[b * nz + j] = zj;
      }
    }
  } else {
    const float* a = fp(L.a);
    for (int64_t k = 0; k < B * nz; ++k) {
      float zj = a[k] > 0.0f ? a[k] : 0.0f;
      z[k] = mz ? zj * mz[k] : zj;
    }
  }
  // 3. the policy: s = sigmoid(2 W_pi z), pi = 2 s - 1 (applied where pi is used)
  at::addmm_out(L.pi, L.pi, L.z, L.wp_t, /*beta=*/0, /*alpha=*/2);  // beta 0: L.pi's old values are ignored
  L.pi.sigmoid_();
  const float* s = fp(L.pi);
  const int64_t P = L.P, n4 = 4 * nh;
  if (L.io) {
    float* ux = fp(L.ux);
    float* uh = fp(L.uh);
    for (int64_t b = 0; b < B; ++b) {
      const float* sb = s + b * P;
      const float* xb = x_t + b * x_stride;
      for (int64_t j = 0; j < nx; ++j) ux[b * nx + j] = xb[j] * (2.0f * sb[j] - 1.0f);
      for (int64_t j = 0; j < nh; ++j) uh[b * nh + j] = h[b * nh + j] * (2.0f * sb[nx + j] - 1.0f);
    }
    at::mm_out(L.gi, L.ux, L.w_ih_t);
    at::mm_out(L.gh, L.uh, L.w_hh_t);
  } else {
    if (L.gi_all.defined()) {
      L.gi.copy_(L.gi_all[t]);
    } else {
      at::mm_out(L.gi, at::from_blob(const_cast<float*>(x_t), {B, nx}, {x_stride, 1}, L.gi.options()), L.w_ih_t);
    }
    at::mm_out(L.gh, L.h, L.w_hh_t);
  }
  // 4. gates = gh * pi_hh + gi * pi_ih + bias * (pi_b or 1), the g block doubled for the shared sigmoid
  float* gh = fp(L.gh);
  const float* gi = fp(L.gi);
  const float* bias = fp(L.bias);
  for (int64_t b = 0; b < B; ++b) {
    const float* s_hh = s + b * P + L.off_hh;
    const float* s_ih = s + b * P + L.off_ih;
    const float* s_b = s + b * P + L.off_b;
    float* row = gh + b * n4;
    const float* gir = gi + b * n4;
    if (L.ab) {
      for (int64_t j = 0; j < n4; ++j)
        row[j] = row[j] * (2.0f * s_hh[j] - 1.0f) + gir[j] * (2.0f * s_ih[j] - 1.0f) + bias[j] * (2.0f * s_b[j] - 1.0f);
    } else {
      for (int64_t j = 0; j < n4; ++j)
        row[j] = row[j] * (2.0f * s_hh[j] - 1.0f) + gir[j] * (2.0f * s_ih[j] - 1.0f) + bias[j];
    }
    for (int64_t j = 2 * nh; j < 3 * nh; ++j) row[j] *= 2.0f;
  }
  L.gh.sigmoid_();
  // 5. the cell: c = f c + i tanh(g), h = o tanh(c); tanh(c) as 2 sigmoid(2c) - 1 through one ATen call
  float* c = fp(L.c);
  float* tc = fp(L.tc);
  for (int64_t b = 0; b < B; ++b) {
    const float* row = gh + b * n4;
    for (int64_t j = 0; j < nh; ++j) {
      float& cj = c[b * nh + j];
      cj = row[nh + j] * cj + row[j] * (2.0f * row[2 * nh + j] - 1.0f);
      tc[b * nh + j] = 2.0f * cj;
    }
  }
  L.tc.sigmoid_();
  float* hw = fp(L.h);
  const float* mh = L.mask_h.defined() ? fp(L.mask_h) : nullptr;
  for (int64_t b = 0; b < B; ++b) {
    const float* row = gh + b * n4;
    for (int64_t j = 0; j < nh; ++j) {
      const float hj = row[3 * nh + j] * (2.0f * tc[b * nh + j] - 1.0f);
      if (out_h) out_h[b * out_stride + j] = hj;
      hw[b * nh + j] = mh ? hj * mh[b * nh + j] : hj;
    }
  }
}

// The hoisted, time-independent products of a layer over the whole segment: the adaptation model's
// leading V columns ([zb | x] layer-major, x for layer 0 interleaved) and, without IO adaptation, W_ih x.
void hoist(Layer& L, int64_t T, int64_t B, const Tensor& seq, const Tensor& zseq, const Tensor& wv) {
  Tensor flat = seq.reshape({T * B, -1});
  if (L.k0) {
    Tensor inp = (zseq.defined() && L.nzb) ? at::cat({zseq.reshape({T * B, -1}), flat}, 1) : flat;
    L.ax = at::addmm(L.ba, inp, wv.narrow(1, 0, L.k0).t()).view({T, B, L.na});
  }
  if (L.hoist_gi) L.gi_all = at::mm(flat, L.w_ih_t).view({T, B, 4 * L.nh});
}

}  // namespace

std::vector<Tensor> alstm_infer(const Tensor& x_in, const std::vector<Tensor>& state,
                                const std::vector<Tensor>& weights, const std::vector<Tensor>& masks,
                                const std::vector<int64_t>& cfg, bool layer_major, int64_t per_layer) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "alstm_infer: float32 CPU only");
  at::NoGradGuard no_grad;
  const int64_t n_layers = static_cast<int64_t>(cfg.size()) / kCfg;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeights * n_layers && static_cast<int64_t>(masks.size()) == 2 * n_layers
              && static_cast<int64_t>(state.size()) == per_layer * n_layers, "alstm_infer: inconsistent arguments");
  const Tensor x = x_in.contiguous();
  const int64_t B = x.size(0), T = x.size(1);
  std::vector<Layer> layers(n_layers);
  std::vector<Tensor> wvs(n_layers);
  for (int64_t l = 0; l < n_layers; ++l) {
    Layer& L = layers[l];
    const int64_t* c = cfg.data() + l * kCfg;
    L.nx = c[0]; L.nh = c[1]; L.nz = c[2]; L.nzb = c[3]; L.k0 = c[4]; L.K = c[5];
    L.recurrent = c[6]; L.io = c[7]; L.ab = c[8]; L.hoist_gi = c[9]; L.P = c[10];
    L.na = L.recurrent ? 4 * L.nz : L.nz;
    L.off_ih = L.io ? L.nx + L.nh : 0;
    L.off_hh = L.off_ih + 4 * L.nh;
    L.off_b = L.off_hh + 4 * L.nh;
    const Tensor* w = weights.data() + kWeights * l;
    wvs[l] = w[0];
    L.wv_t = w[1];
    L.ba = w[2];
    L.wp_t = w[3];
    L.w_ih_t = w[4];
    L.w_hh_t = w[5];
    L.bias = w[6].contiguous();
    for (int k = 1; k < 6; ++k) TORCH_CHECK(w[k].is_contiguous(), "alstm_infer: weights must be contiguous");
    if (masks[2 * l].numel()) L.mask_h = masks[2 * l].contiguous();
    if (masks[2 * l + 1].numel()) L.mask_z = masks[2 * l + 1].contiguous();
    const Tensor* s = state.data() + per_layer * l;
    L.h = s[0].contiguous().clone();
    L.c = s[1].contiguous().clone();
    const auto opt = x.options();
    L.z = L.recurrent ? s[2].contiguous().clone() : at::zeros({B, L.nz}, opt);
    if (L.recurrent) L.zc = s[3].contiguous().clone();
    L.v = at::empty({B, L.K - L.k0}, opt);
    L.a = at::empty({B, L.na}, opt);
    L.pi = at::empty({B, L.P}, opt);
    if (L.io) { L.ux = at::empty({B, L.nx}, opt); L.uh = at::empty({B, L.nh}, opt); }
    L.gi = at::empty({B, 4 * L.nh}, opt);
    L.gh = at::empty({B, 4 * L.nh}, opt);
    L.tc = at::empty({B, L.nh}, opt);
  }
  const int64_t top = n_layers - 1;
  Tensor out = at::empty({B, T, layers[top].nh}, x.options());
  float* out_p = fp(out);
  const int64_t out_stride = T * layers[top].nh;
  if (layer_major) {
    Tensor seq = x.transpose(0, 1), zseq;
    for (int64_t l = 0; l < n_layers; ++l) {
      Layer& L = layers[l];
      hoist(L, T, B, seq, zseq, wvs[l]);
      const bool last = l == top;
      Tensor hseq = last ? Tensor() : at::empty({T, B, L.nh}, x.options());
      Tensor zseq_next = (!last && layers[l + 1].nzb) ? at::empty({T, B, L.nz}, x.options()) : Tensor();
      const float* sp = fp(l == 0 ? x : seq);
      const int64_t s_stride = l == 0 ? T * L.nx : L.nx;   // row stride of x_t within the sequence
      for (int64_t t = 0; t < T; ++t) {
        const float* x_t = l == 0 ? sp + t * L.nx : sp + t * B * L.nx;
        step(L, B, x_t, s_stride, nullptr, true, t, last ? out_p + t * layers[top].nh : nullptr, out_stride);
        if (!last) std::memcpy(fp(hseq) + t * B * L.nh, fp(L.h), B * L.nh * sizeof(float));
        if (zseq_next.defined()) std::memcpy(fp(zseq_next) + t * B * L.nz, fp(L.z), B * L.nz * sizeof(float));
      }
      seq = hseq;
      zseq = zseq_next;
    }
  } else {
    hoist(layers[0], T, B, x.transpose(0, 1), Tensor(), wvs[0]);
    const float* xp = fp(x);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t l = 0; l < n_layers; ++l) {
        Layer& L = layers[l];
        float* oh = l == top ? out_p + t * layers[top].nh : nullptr;
        if (l == 0) {
          step(L, B, xp + t * L.nx, T * L.nx, fp(layers[top].z), false, t, oh, out_stride);
        } else {
          step(L, B, fp(layers[l - 1].h), layers[l - 1].nh, fp(layers[l - 1].z), false, t, oh, out_stride);
        }
      }
    }
  }
  std::vector<Tensor> res{out};
  for (auto& L : layers) {
    res.push_back(L.h);
    res.push_back(L.c);
    if (L.recurrent) { res.push_back(L.z); res.push_back(L.zc); }
  }
  return res;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("alstm_infer", &alstm_infer, "aLSTM stack inference over a segment (no autograd)");
}
