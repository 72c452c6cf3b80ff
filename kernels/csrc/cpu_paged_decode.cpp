// Paged decode attention for x86 CPUs with AVX-512: one query token per request, its keys and
// values read in place from the paged cache (no gather), scores, softmax and the product with V
// in float32. The contract is `kernels.attention.paged_attention`'s for decode rows; Python
// (`kernels/cpu_decode.py`) checks every argument before calling in, and this file assumes:
//   query     [num_tokens, num_heads, head_dim], last dim contiguous, dtype T
//   kv_cache  [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous, dtype T
//   out       [num_tokens, num_heads, head_dim], contiguous, dtype T
//   block_table int32 [num_seqs, max_blocks] (row stride given), seq_lens int32 [num_seqs],
//   query_start_loc int32 [num_seqs + 1], decode_seqs int32 [n]: the requests with one query row
//   head_dim = 16 * NC for an NC this file instantiates; num_heads = G * num_kv_heads.
// Work is split over (decode request, kv head) pairs; each pair handles the G query heads that
// share its kv head, so K/V are read once per kv head (GQA without expansion).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

template <typename T>
struct Vec;

template <>
struct Vec<float> {
  static inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
};

template <>
struct Vec<at::BFloat16> {
  static inline __m512 load(const at::BFloat16* p) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  // Round to nearest even, NaN to the quiet NaN 0x7FC0: c10::BFloat16's conversion.
  static inline void store(at::BFloat16* p, __m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  }
};

template <>
struct Vec<at::Half> {
  static inline __m512 load(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline void store(at::Half* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

// exp(x) for x <= 0 to ~1 ulp: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial for e^r,
// scaled by 2^n. Inputs below -87.3 give ~1e-38 rather than a denormal.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF)
                         : static_cast<__mmask16>((1u << remaining) - 1u);
}

// Scales a row of raw scores (soft-capping them when asked), replaces it with exp(score - max)
// and returns 1 / sum of those.
inline float softmax_row(float* s, int64_t n, float scale, float soft_cap) {
  if (soft_cap > 0.f) {
    for (int64_t j = 0; j < n; ++j) s[j] = soft_cap * std::tanh(s[j] * scale / soft_cap);
  } else {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < n; j += 16) {
      __mmask16 m = tail_mask(n - j);
      _mm512_mask_storeu_ps(s + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), vs));
    }
  }
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) {
    __mmask16 m = tail_mask(n - j);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, s + j));
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    __mmask16 m = tail_mask(n - j);
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), mx));
    _mm512_mask_storeu_ps(s + j, m, e);
    vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
  }
  return 1.0f / _mm512_reduce_add_ps(vsum);
}

struct Problem {
  int64_t q_stride_token, q_stride_head;
  int64_t num_heads, num_kv_heads, group, block_size, num_blocks;
  int64_t table_stride;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const int32_t* decode_seqs;
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
  constexpr int64_t bytes = 16 * NC * static_cast<int64_t>(sizeof(T));
  const char* p = reinterpret_cast<const char*>(row);
#pragma GCC unroll 16
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

template <typename T, int NC>
void attend_pair(const Problem& pb, const T* query, const T* k_cache, const T* v_cache, T* out,
                 int64_t item, std::vector<float>& scores, std::vector<int64_t>& offsets) {
  constexpr int64_t D = 16 * NC;
  // Query heads handled together: their accumulators and a K/V row fit in the 32 registers.
  constexpr int GT = NC >= 16 ? 1 : 16 / NC;
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
    __m512 q[GT][NC];
#pragma GCC unroll 16
    for (int gi = 0; gi < GT; ++gi) {
      if (gi < gt) {
        const T* qr = query + row * pb.q_stride_token + (kv_head * G + g0 + gi) * pb.q_stride_head;
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) q[gi][c] = Vec<T>::load(qr + 16 * c);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* kr = k_cache + offsets[j];
      if (j + kPrefetch < n) prefetch_row<T, NC>(k_cache + offsets[j + kPrefetch]);
      __m512 k[NC];
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) k[c] = Vec<T>::load(kr + 16 * c);
#pragma GCC unroll 16
      for (int gi = 0; gi < GT; ++gi) {
        if (gi < gt) {
          __m512 acc = _mm512_mul_ps(q[gi][0], k[0]);
#pragma GCC unroll 16
          for (int c = 1; c < NC; ++c) acc = _mm512_fmadd_ps(q[gi][c], k[c], acc);
          scores[(g0 + gi) * n + j] = _mm512_reduce_add_ps(acc);
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) inv_sum[g] = softmax_row(scores.data() + g * n, n, pb.scale, pb.soft_cap);

  for (int64_t g0 = 0; g0 < G; g0 += GT) {
    const int64_t gt = std::min<int64_t>(GT, G - g0);
    __m512 acc[GT][NC];
#pragma GCC unroll 16
    for (int gi = 0; gi < GT; ++gi) {
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) acc[gi][c] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = v_cache + offsets[j];
      if (j + kPrefetch < n) prefetch_row<T, NC>(v_cache + offsets[j + kPrefetch]);
      __m512 v[NC];
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) v[c] = Vec<T>::load(vr + 16 * c);
#pragma GCC unroll 16
      for (int gi = 0; gi < GT; ++gi) {
        if (gi < gt) {
          const __m512 p = _mm512_set1_ps(scores[(g0 + gi) * n + j]);
#pragma GCC unroll 16
          for (int c = 0; c < NC; ++c) acc[gi][c] = _mm512_fmadd_ps(p, v[c], acc[gi][c]);
        }
      }
    }
#pragma GCC unroll 16
    for (int gi = 0; gi < GT; ++gi) {
      if (gi < gt) {
        const __m512 norm = _mm512_set1_ps(inv_sum[g0 + gi]);
        T* orow = out + (row * pb.num_heads + kv_head * G + g0 + gi) * D;
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) Vec<T>::store(orow + 16 * c, _mm512_mul_ps(acc[gi][c], norm));
      }
    }
  }
}

template <typename T, int NC>
void run(const Problem& pb, const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
         int64_t num_decode) {
  const T* q = query.data_ptr<T>();
  const T* k_cache = kv_cache.data_ptr<T>();
  const T* v_cache = k_cache + pb.num_blocks * pb.block_size * pb.num_kv_heads * 16 * NC;
  T* o = out.data_ptr<T>();
  at::parallel_for(0, num_decode * pb.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> offsets;
    for (int64_t item = begin; item < end; ++item)
      attend_pair<T, NC>(pb, q, k_cache, v_cache, o, item, scores, offsets);
  });
}

template <typename T>
void dispatch_head_dim(const Problem& pb, const at::Tensor& query, const at::Tensor& kv_cache,
                       at::Tensor& out, int64_t num_decode, int64_t head_dim) {
  switch (head_dim) {
    case 32: return run<T, 2>(pb, query, kv_cache, out, num_decode);
    case 64: return run<T, 4>(pb, query, kv_cache, out, num_decode);
    case 80: return run<T, 5>(pb, query, kv_cache, out, num_decode);
    case 96: return run<T, 6>(pb, query, kv_cache, out, num_decode);
    case 128: return run<T, 8>(pb, query, kv_cache, out, num_decode);
    case 256: return run<T, 16>(pb, query, kv_cache, out, num_decode);
    default: TORCH_CHECK(false, "cpu_paged_decode: unsupported head_dim ", head_dim);
  }
}

}  // namespace

// The head dims this file has code for; Python asks before routing a call here.
std::vector<int64_t> supported_head_dims() { return {32, 64, 80, 96, 128, 256}; }

void paged_decode(at::Tensor out, at::Tensor query, at::Tensor kv_cache, at::Tensor block_table,
                  at::Tensor seq_lens, at::Tensor query_start_loc, at::Tensor decode_seqs,
                  double scale, int64_t window, double soft_cap) {
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
  m.def("paged_decode", &paged_decode, "Paged decode attention (AVX-512, float32 accumulation)");
  m.def("supported_head_dims", &supported_head_dims);
}
