// The per-layer kernels of the CPU backend besides decode attention, each one call instead of the
// torch ops of `llm_kernels/ops.py` and `llm_kernels/attention.py` they stand in for: RMSNorm
// (with the residual add folded in), the neox rotary embedding, and the KV cache write.
// RMSNorm and rotary follow the torch ops' numerics step by step: every intermediate the torch path rounds to the input dtype is rounded
// here too (c10::BFloat16's round-to-nearest-even), and nothing is contracted into an FMA (the
// Python side builds with -ffp-contract=off). So the rotary embedding equals the torch path bit
// for bit; RMSNorm differs only in the order its sum of squares is added up.
// Python (`llm_kernels/cpu_layer_kernels.py`) checks dtypes, devices, shapes and layouts first; this
// file assumes:
//   rms_norm:  x, residual, out, sum  [rows, n] contiguous, one dtype T; weight [n], dtype T
//   rotary:    q [tokens, heads, d] with its last dim contiguous, any other strides; out
//              [tokens, heads, d] contiguous; cos, sin float32 [max_position, d] contiguous;
//              positions int64 [tokens] (checked against max_position here)
//   cache_write: key, value [tokens, kv_heads, d] with their last dim contiguous; kv_cache
//              [planes, num_blocks, block_size, kv_heads, d] contiguous, of their dtype;
//              slot_mapping int64 [tokens] (slots < 0 are skipped, the others checked here)

// Only the headers used (not <torch/extension.h>, which parses ~5x longer on every first build).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline T narrow(float x) {
  return static_cast<T>(x);  // float: exact; BFloat16: round to nearest even, as torch does
}

// Elements per parallel task: a decode step's few rows run on the calling thread.
constexpr int64_t kGrain = 1 << 15;

template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* sum, int64_t rows,
                   int64_t n, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(n, 1)),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> row(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      for (int64_t i = 0; i < n; ++i) {
        float v = widen(xr[i]);
        if (residual != nullptr) {
          const T s = narrow<T>(v + widen(residual[r * n + i]));  // x + residual, in T
          sum[r * n + i] = s;
          v = widen(s);
        }
        row[i] = v;
      }
      // Sixteen independent partial sums (vectorizable without reassociating any one of them).
      float part[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) {
        for (int j = 0; j < 16; ++j) part[j] += row[i + j] * row[i + j];
      }
      float total = 0.f;
      for (int j = 0; j < 16; ++j) total += part[j];
      for (; i < n; ++i) total += row[i] * row[i];
      const float inv = 1.f / std::sqrt(total / static_cast<float>(n) + eps);
      T* o = out + r * n;
      for (int64_t k = 0; k < n; ++k) {
        const T normed = narrow<T>(row[k] * inv);  // normalized in float32, cast to T
        o[k] = narrow<T>(widen(weight[k]) * widen(normed));  // times the weight, in T
      }
    }
  });
}

template <typename T>
void rotary_rows(const int64_t* positions, const T* q, int64_t stride_t, int64_t stride_h,
                 T* out, int64_t tokens, int64_t heads, int64_t d, const float* cos,
                 const float* sin) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, std::max<int64_t>(1, kGrain / std::max<int64_t>(heads * d, 1)),
                   [&](int64_t begin, int64_t end) {
    std::vector<T> c(d), s(d);
    for (int64_t t = begin; t < end; ++t) {
      const float* cp = cos + positions[t] * d;
      const float* sp = sin + positions[t] * d;
      for (int64_t k = 0; k < d; ++k) {
        c[k] = narrow<T>(cp[k]);  // the tables cast to T, as the torch path does
        s[k] = narrow<T>(sp[k]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        const T* x = q + t * stride_t + h * stride_h;
        T* y = out + (t * heads + h) * d;
        for (int64_t k = 0; k < d; ++k) {
          // rotate_half(x) = [-x2, x1]
          const float rotated = k < half ? -widen(x[k + half]) : widen(x[k - half]);
          const T a = narrow<T>(widen(x[k]) * widen(c[k]));
          const T b = narrow<T>(rotated * widen(s[k]));
          y[k] = narrow<T>(widen(a) + widen(b));
        }
      }
    }
  });
}

// Returns (normed, x + residual) with a residual, (normed,) without.
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                    const c10::optional<at::Tensor>& residual, double eps) {
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  auto out = at::empty_like(x);
  at::Tensor sum;
  if (residual.has_value()) sum = at::empty_like(x);
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      rms_norm_rows<float>(x.data_ptr<float>(),
                           residual.has_value() ? residual->data_ptr<float>() : nullptr,
                           weight.data_ptr<float>(), out.data_ptr<float>(),
                           residual.has_value() ? sum.data_ptr<float>() : nullptr, rows, n,
                           static_cast<float>(eps));
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using B = at::BFloat16;
      rms_norm_rows<B>(x.data_ptr<B>(), residual.has_value() ? residual->data_ptr<B>() : nullptr,
                       weight.data_ptr<B>(), out.data_ptr<B>(),
                       residual.has_value() ? sum.data_ptr<B>() : nullptr, rows, n,
                       static_cast<float>(eps));
    }));
  if (residual.has_value()) return {out, sum};
  return {out};
}

at::Tensor rotary(const at::Tensor& positions, const at::Tensor& q,
                     const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t max_position = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "positions[", t, "] = ", pos[t],
                " is outside the rotary table's [0, ", max_position, ")");
  }
  auto out = at::empty({tokens, heads, d}, q.options());
  AT_DISPATCH_SWITCH(q.scalar_type(), "rotary",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      rotary_rows<float>(pos, q.data_ptr<float>(), q.stride(0), q.stride(1),
                         out.data_ptr<float>(), tokens, heads, d, cos.data_ptr<float>(),
                         sin.data_ptr<float>());
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using B = at::BFloat16;
      rotary_rows<B>(pos, q.data_ptr<B>(), q.stride(0), q.stride(1), out.data_ptr<B>(), tokens,
                     heads, d, cos.data_ptr<float>(), sin.data_ptr<float>());
    }));
  return out;
}

// Copies each token's key (and value) rows to its slot: a byte copy, so any dtype of the cache.
void cache_write(const at::Tensor& key, const c10::optional<at::Tensor>& value,
                 at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  const int64_t tokens = key.size(0), heads = key.size(1), d = key.size(2);
  const int64_t capacity = kv_cache.size(1) * kv_cache.size(2);
  const int64_t elem = kv_cache.element_size();
  const int64_t row_bytes = d * elem;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] < capacity, "slot_mapping[", t, "] = ", slots[t],
                " is past the cache's ", capacity, " slots");
  }
  std::vector<const at::Tensor*> planes = {&key};
  if (value.has_value()) planes.push_back(&value.value());
  char* base = static_cast<char*>(kv_cache.data_ptr());
  for (size_t p = 0; p < planes.size(); ++p) {
    const at::Tensor& src = *planes[p];
    const char* from = static_cast<const char*>(src.data_ptr());
    char* plane = base + static_cast<int64_t>(p) * capacity * heads * row_bytes;
    for (int64_t t = 0; t < tokens; ++t) {
      if (slots[t] < 0) continue;
      char* to = plane + slots[t] * heads * row_bytes;
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(to + h * row_bytes, from + (t * src.stride(0) + h * src.stride(1)) * elem,
                    row_bytes);
      }
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, the residual add folded in");
  m.def("rotary", &rotary, "Neox rotary embedding of [tokens, heads, d] into a new tensor");
  m.def("cache_write", &cache_write, "Key/value rows into their slots of a paged cache");
}
