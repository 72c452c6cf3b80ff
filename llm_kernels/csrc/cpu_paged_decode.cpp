// Paged decode attention for x86 CPUs with AVX-512 or AVX2: one query token per request, its keys and
// values read in place from the paged cache (no gather), scores, softmax and the product with V
// in float32. The contract is `llm_kernels.attention.paged_attention`'s for decode rows; Python
// (`llm_kernels/cpu_decode.py`) checks every argument before calling in, and this file assumes:
//   query     [num_tokens, num_heads, head_dim], last dim contiguous, dtype T
//   kv_cache  [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous, dtype T; or one
//             plane [1, ...]: a latent cache (MLA) whose values are each key's first value_dim
//   out       [num_tokens, num_heads, value_dim], contiguous, dtype T (value_dim = head_dim for
//             a K/V cache)
//   block_table int32 [num_seqs, max_blocks] (row stride given), seq_lens int32 [num_seqs],
//   query_start_loc int32 [num_seqs + 1], decode_seqs int32 [n]: the requests with one query row
//   sinks     float32 [num_heads], contiguous, or none: a logit per query head with no value
//   head_dim one of supported_head_dims() (a K/V cache) or (head_dim, value_dim) one of
//   supported_latent_dims() (a latent cache); num_heads = G * num_kv_heads.
// Work is split over (decode request, kv head) pairs; each pair handles the G query heads that
// share its kv head, so K/V are read once per kv head (GQA without expansion).

// Only the headers used (not <torch/extension.h>, which parses ~5x longer on every first build).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace {

// ---- the vector layer: one float32 register of W lanes, per instruction set ----------------
// Compiled once per ISA (Python passes -DLLMC_ISA_AVX512 or -DLLMC_ISA_AVX2 with its flags);
// everything below the layer is written once in terms of VF, W and these functions.

#if defined(LLMC_ISA_AVX512)
using VF = __m512;
constexpr int W = 16;
inline VF vzero() { return _mm512_setzero_ps(); }
inline VF vset1(float x) { return _mm512_set1_ps(x); }
inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF vsub(VF a, VF b) { return _mm512_sub_ps(a, b); }
inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vmax(VF a, VF b) { return _mm512_max_ps(a, b); }
inline VF vmin(VF a, VF b) { return _mm512_min_ps(a, b); }
inline VF vfmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vfnmadd(VF a, VF b, VF c) { return _mm512_fnmadd_ps(a, b, c); }
inline float vsum(VF a) { return _mm512_reduce_add_ps(a); }
inline float vhmax(VF a) { return _mm512_reduce_max_ps(a); }
inline VF vloadf(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoref(float* p, VF v) { _mm512_storeu_ps(p, v); }
// round(x) * 2^n for the exp below.
inline VF vround(VF x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline VF vscale2(VF y, VF n) { return _mm512_scalef_ps(y, n); }
inline VF vload_bf16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// Round to nearest even, NaN to the quiet NaN 0x7FC0: c10::BFloat16's conversion.
inline void vstore_bf16(at::BFloat16* p, VF v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}
inline VF vload_f16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vstore_f16(at::Half* p, VF v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(LLMC_ISA_AVX2)
using VF = __m256;
constexpr int W = 8;
inline VF vzero() { return _mm256_setzero_ps(); }
inline VF vset1(float x) { return _mm256_set1_ps(x); }
inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF vsub(VF a, VF b) { return _mm256_sub_ps(a, b); }
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vmax(VF a, VF b) { return _mm256_max_ps(a, b); }
inline VF vmin(VF a, VF b) { return _mm256_min_ps(a, b); }
inline VF vfmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vfnmadd(VF a, VF b, VF c) { return _mm256_fnmadd_ps(a, b, c); }
inline float vsum(VF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vhmax(VF a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline VF vloadf(const float* p) { return _mm256_loadu_ps(p); }
inline void vstoref(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF vround(VF x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// y * 2^n for an integral n in [-126, 127] (the exp below keeps it there): n's exponent bits.
inline VF vscale2(VF y, VF n) {
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
inline VF vload_bf16(const at::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline void vstore_bf16(at::BFloat16* p, VF v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // 8 x 32-bit values < 2^16 -> 8 x 16-bit: pack within each 128-bit lane, then gather lanes.
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline VF vload_f16(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void vstore_f16(at::Half* p, VF v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
#error "compile with -DLLMC_ISA_AVX512 or -DLLMC_ISA_AVX2"
#endif

template <typename T>
struct Vec;

template <>
struct Vec<float> {
  static inline VF load(const float* p) { return vloadf(p); }
  static inline void store(float* p, VF v) { vstoref(p, v); }
};

template <>
struct Vec<at::BFloat16> {
  static inline VF load(const at::BFloat16* p) { return vload_bf16(p); }
  static inline void store(at::BFloat16* p, VF v) { vstore_bf16(p, v); }
};

template <>
struct Vec<at::Half> {
  static inline VF load(const at::Half* p) { return vload_f16(p); }
  static inline void store(at::Half* p, VF v) { vstore_f16(p, v); }
};

// exp(x) to ~1 ulp: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial for e^r, scaled by
// 2^n. Inputs are clamped to [-87.3, 88.3]: below, ~1e-38 rather than a denormal.
inline VF exp_ps(VF x) {
  x = vmin(vmax(x, vset1(-87.3f)), vset1(88.3f));
  VF n = vround(vmul(x, vset1(1.44269504088896341f)));
  VF r = vfnmadd(n, vset1(0.693359375f), x);
  r = vfnmadd(n, vset1(-2.12194440e-4f), r);
  VF y = vset1(1.9875691500e-4f);
  y = vfmadd(y, r, vset1(1.3981999507e-3f));
  y = vfmadd(y, r, vset1(8.3334519073e-3f));
  y = vfmadd(y, r, vset1(4.1665795894e-2f));
  y = vfmadd(y, r, vset1(1.6666665459e-1f));
  y = vfmadd(y, r, vset1(5.0000001201e-1f));
  y = vfmadd(y, vmul(r, r), vadd(r, vset1(1.0f)));
  return vscale2(y, n);
}

// Scales a row of raw scores (soft-capping them when asked), replaces it with exp(score - max)
// and returns 1 / sum of those. The sink is one more logit, in the max and the sum but not the
// row (-inf without one: it then adds exp(-inf) = 0). The tail past the last full vector is scalar.
inline float softmax_row(float* s, int64_t n, float scale, float soft_cap, float sink) {
  const int64_t full = n - n % W;
  if (soft_cap > 0.f) {
    for (int64_t j = 0; j < n; ++j) s[j] = soft_cap * std::tanh(s[j] * scale / soft_cap);
  } else {
    for (int64_t j = 0; j < full; j += W) vstoref(s + j, vmul(vloadf(s + j), vset1(scale)));
    for (int64_t j = full; j < n; ++j) s[j] *= scale;
  }
  VF vm = vset1(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < full; j += W) vm = vmax(vm, vloadf(s + j));
  float mx = std::max(vhmax(vm), sink);
  for (int64_t j = full; j < n; ++j) mx = std::max(mx, s[j]);
  const VF vmx = vset1(mx);
  VF vs = vzero();
  for (int64_t j = 0; j < full; j += W) {
    VF e = exp_ps(vsub(vloadf(s + j), vmx));
    vstoref(s + j, e);
    vs = vadd(vs, e);
  }
  float total = vsum(vs) + std::exp(sink - mx);
  for (int64_t j = full; j < n; ++j) {
    s[j] = std::exp(s[j] - mx);
    total += s[j];
  }
  return 1.0f / total;
}

struct Problem {
  int64_t q_stride_token, q_stride_head;
  int64_t num_heads, num_kv_heads, group, block_size, num_blocks;
  int64_t table_stride;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const int32_t* decode_seqs;
  const float* sinks;  // nullptr: none
  float scale;
  int64_t window;  // 0: none
  float soft_cap;  // 0: none
};

// The cache offset (in elements, within K or V) of each visible key of one request, for one
// kv head: position p lives in block block_table[p / block_size], at offset p % block_size.
inline void key_offsets(const Problem& pb, int64_t seq, int64_t start, int64_t end, int64_t kv_head,
                        int64_t head_dim, std::vector<int64_t>& offsets) {
  offsets.clear();
  const int32_t* table = pb.block_table + seq * pb.table_stride;
  const int64_t token_stride = pb.num_kv_heads * head_dim;
  for (int64_t p = start; p < end;) {
    const int64_t logical = p / pb.block_size;
    const int64_t block_end = std::min(end, (logical + 1) * pb.block_size);
    int64_t base = (static_cast<int64_t>(table[logical]) * pb.block_size + (p - logical * pb.block_size)) *
                       token_stride +
                   kv_head * head_dim;
    for (; p < block_end; ++p, base += token_stride) offsets.push_back(base);
  }
}

// Rows are scattered over blocks, which the hardware prefetcher does not follow: each loop
// asks for the row kPrefetch keys ahead.
constexpr int64_t kPrefetch = 8;

template <typename T, int NC>
inline void prefetch_row(const T* row) {
  constexpr int64_t bytes = W * NC * static_cast<int64_t>(sizeof(T));
  const char* p = reinterpret_cast<const char*>(row);
#pragma GCC unroll 32
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// NC vectors per key row, NV per value row (NV = NC for a K/V cache; fewer for a latent one,
// whose values are the first NV vectors of the key row, read at the key's offset).
template <typename T, int NC, int NV>
void attend_pair(const Problem& pb, const T* query, const T* k_cache, const T* v_cache, T* out,
                 int64_t item, std::vector<float>& scores, std::vector<int64_t>& offsets) {
  constexpr int64_t D = W * NC;
  constexpr int64_t DV = W * NV;
  // Query heads handled together: their accumulators and a K/V row fit in the registers (32
  // with AVX-512, 16 with AVX2).
  constexpr int kTile = W == 16 ? 16 : 8;
  constexpr int GT = NC >= kTile ? 1 : kTile / NC;
  constexpr int GTV = NV >= kTile ? 1 : kTile / NV;
  const int64_t pair = item / pb.num_kv_heads;
  const int64_t kv_head = item % pb.num_kv_heads;
  const int64_t seq = pb.decode_seqs[pair];
  const int64_t row = pb.query_start_loc[seq];
  const int64_t seq_len = pb.seq_lens[seq];
  const int64_t start = pb.window > 0 ? std::max<int64_t>(0, seq_len - pb.window) : 0;
  const int64_t n = seq_len - start;
  const int64_t G = pb.group;
  key_offsets(pb, seq, start, seq_len, kv_head, D, offsets);
  scores.resize(static_cast<size_t>(G * n));
  std::vector<float> inv_sum(static_cast<size_t>(G));

  for (int64_t g0 = 0; g0 < G; g0 += GT) {
    const int64_t gt = std::min<int64_t>(GT, G - g0);
    VF q[GT][NC];
#pragma GCC unroll 32
    for (int gi = 0; gi < GT; ++gi) {
      if (gi < gt) {
        const T* qr = query + row * pb.q_stride_token + (kv_head * G + g0 + gi) * pb.q_stride_head;
#pragma GCC unroll 32
        for (int c = 0; c < NC; ++c) q[gi][c] = Vec<T>::load(qr + W * c);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* kr = k_cache + offsets[j];
      if (j + kPrefetch < n) prefetch_row<T, NC>(k_cache + offsets[j + kPrefetch]);
      VF k[NC];
#pragma GCC unroll 32
      for (int c = 0; c < NC; ++c) k[c] = Vec<T>::load(kr + W * c);
#pragma GCC unroll 32
      for (int gi = 0; gi < GT; ++gi) {
        if (gi < gt) {
          VF acc = vmul(q[gi][0], k[0]);
#pragma GCC unroll 32
          for (int c = 1; c < NC; ++c) acc = vfmadd(q[gi][c], k[c], acc);
          scores[(g0 + gi) * n + j] = vsum(acc);
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float sink =
        pb.sinks != nullptr ? pb.sinks[kv_head * G + g] : -std::numeric_limits<float>::infinity();
    inv_sum[g] = softmax_row(scores.data() + g * n, n, pb.scale, pb.soft_cap, sink);
  }

  for (int64_t g0 = 0; g0 < G; g0 += GTV) {
    const int64_t gt = std::min<int64_t>(GTV, G - g0);
    VF acc[GTV][NV];
#pragma GCC unroll 32
    for (int gi = 0; gi < GTV; ++gi) {
#pragma GCC unroll 32
      for (int c = 0; c < NV; ++c) acc[gi][c] = vzero();
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = v_cache + offsets[j];
      if (j + kPrefetch < n) prefetch_row<T, NV>(v_cache + offsets[j + kPrefetch]);
      VF v[NV];
#pragma GCC unroll 32
      for (int c = 0; c < NV; ++c) v[c] = Vec<T>::load(vr + W * c);
#pragma GCC unroll 32
      for (int gi = 0; gi < GTV; ++gi) {
        if (gi < gt) {
          const VF p = vset1(scores[(g0 + gi) * n + j]);
#pragma GCC unroll 32
          for (int c = 0; c < NV; ++c) acc[gi][c] = vfmadd(p, v[c], acc[gi][c]);
        }
      }
    }
#pragma GCC unroll 32
    for (int gi = 0; gi < GTV; ++gi) {
      if (gi < gt) {
        const VF norm = vset1(inv_sum[g0 + gi]);
        T* orow = out + (row * pb.num_heads + kv_head * G + g0 + gi) * DV;
#pragma GCC unroll 32
        for (int c = 0; c < NV; ++c) Vec<T>::store(orow + W * c, vmul(acc[gi][c], norm));
      }
    }
  }
}

template <typename T, int NC, int NV>
void run(const Problem& pb, const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
         int64_t num_decode) {
  const T* q = query.data_ptr<T>();
  const T* k_cache = kv_cache.data_ptr<T>();
  // The second plane of a K/V cache; a latent cache's values are its keys' first NV vectors.
  const T* v_cache =
      kv_cache.size(0) == 2 ? k_cache + pb.num_blocks * pb.block_size * pb.num_kv_heads * W * NC : k_cache;
  T* o = out.data_ptr<T>();
  at::parallel_for(0, num_decode * pb.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> offsets;
    for (int64_t item = begin; item < end; ++item)
      attend_pair<T, NC, NV>(pb, q, k_cache, v_cache, o, item, scores, offsets);
  });
}

template <typename T>
void dispatch_head_dim(const Problem& pb, const at::Tensor& query, const at::Tensor& kv_cache,
                       at::Tensor& out, int64_t num_decode, int64_t head_dim) {
  if (kv_cache.size(0) == 1) {
    const int64_t value_dim = out.size(2);
    // DeepSeek-V2/V3 and Kimi K2: kv_lora_rank 512 plus a rope part of 64.
    if (head_dim == 576 && value_dim == 512) return run<T, 576 / W, 512 / W>(pb, query, kv_cache, out, num_decode);
    TORCH_CHECK(false, "cpu_paged_decode: unsupported latent dims ", head_dim, "/", value_dim);
  }
  switch (head_dim) {
    case 32: return run<T, 32 / W, 32 / W>(pb, query, kv_cache, out, num_decode);
    case 64: return run<T, 64 / W, 64 / W>(pb, query, kv_cache, out, num_decode);
    case 80: return run<T, 80 / W, 80 / W>(pb, query, kv_cache, out, num_decode);
    case 96: return run<T, 96 / W, 96 / W>(pb, query, kv_cache, out, num_decode);
    case 128: return run<T, 128 / W, 128 / W>(pb, query, kv_cache, out, num_decode);
    case 256: return run<T, 256 / W, 256 / W>(pb, query, kv_cache, out, num_decode);
    default: TORCH_CHECK(false, "cpu_paged_decode: unsupported head_dim ", head_dim);
  }
}

}  // namespace

// The head dims this file has code for; Python asks before routing a call here.
std::vector<int64_t> supported_head_dims() { return {32, 64, 80, 96, 128, 256}; }

// The (head_dim, value_dim) pairs of a one-plane latent cache this file has code for.
std::vector<std::pair<int64_t, int64_t>> supported_latent_dims() { return {{576, 512}}; }

void paged_decode(at::Tensor out, at::Tensor query, at::Tensor kv_cache, at::Tensor block_table,
                  at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor decode_seqs,
                  double scale, int64_t window, double soft_cap,
                  std::optional<at::Tensor> sinks) {
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  Problem pb{};
  pb.q_stride_token = query.stride(0);
  pb.q_stride_head = query.stride(1);
  pb.num_heads = num_heads;
  pb.num_blocks = kv_cache.size(1);
  pb.block_size = kv_cache.size(2);
  pb.num_kv_heads = kv_cache.size(3);
  pb.group = num_heads / pb.num_kv_heads;
  pb.table_stride = block_table.stride(0);
  pb.block_table = block_table.data_ptr<int32_t>();
  pb.seq_lens = seq_lens.data_ptr<int32_t>();
  pb.query_start_loc = query_start_loc.data_ptr<int32_t>();
  pb.decode_seqs = decode_seqs.data_ptr<int32_t>();
  pb.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  pb.scale = static_cast<float>(scale);
  pb.window = window;
  pb.soft_cap = static_cast<float>(soft_cap);
  const int64_t num_decode = decode_seqs.numel();
  switch (query.scalar_type()) {
    case at::kFloat: return dispatch_head_dim<float>(pb, query, kv_cache, out, num_decode, head_dim);
    case at::kBFloat16:
      return dispatch_head_dim<at::BFloat16>(pb, query, kv_cache, out, num_decode, head_dim);
    case at::kHalf: return dispatch_head_dim<at::Half>(pb, query, kv_cache, out, num_decode, head_dim);
    default: TORCH_CHECK(false, "cpu_paged_decode: unsupported dtype ", query.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention (float32 accumulation)");
  m.def("supported_head_dims", &supported_head_dims);
  m.def("supported_latent_dims", &supported_latent_dims);
}
