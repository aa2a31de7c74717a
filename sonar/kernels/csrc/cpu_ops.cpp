// Sonar's native CPU kernels, registered as torch operators in the namespace `sonar_cpu`.
//
// Built and loaded by sonar/kernels/native.py (g++ -O3 -march=native, torch's own OpenMP runtime
// through at::parallel_for). Each kernel follows the contract of its torch reference in
// sonar/kernels/attention.py and sonar/kernels/reference.py; the comments say where the
// arithmetic differs (summation order only) and where it matches the reference bit for bit.
//
// Every kernel computes in float32. Element types: float32, bfloat16, float16; inputs of
// one call share one type, and the innermost dimension of every tensor is contiguous.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <tuple>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SONAR_AVX512 1
#include <immintrin.h>
#endif
// The AVX-512 paths of the linear kernels: bfloat16 pairs (`vdpbf16ps`), and for the quantized
// kernel int8 dot products (VNNI) too.
#if defined(SONAR_AVX512) && defined(__AVX512BF16__)
#define SONAR_LINEAR_BF16 1
#if defined(__AVX512VNNI__)
#define SONAR_LINEAR_QUANT 1
#endif
#endif
// The AVX2 + FMA paths are compiled into every x86 build through a target attribute, and chosen
// at run time (`cpu_has_avx2`).
#if defined(__x86_64__) || defined(__i386__)
#define SONAR_AVX2 1
#include <immintrin.h>
#define SONAR_AVX2_FN __attribute__((target("avx2,fma"))) inline
#endif

namespace {

// --- element conversion --------------------------------------------------------------------------
//
// Kernels work on storage types the compiler can vectorize: float, Bf16 (the bits of a bfloat16)
// and _Float16 (IEEE half, the layout of c10::Half); `data<S>` views a tensor's memory as one.

using Bf16 = uint16_t;

inline float to_float(float x) { return x; }
inline float to_float(_Float16 x) { return static_cast<float>(x); }
inline float to_float(Bf16 x) {  // the bits of a bfloat16 are the high half of a float32's
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Rounds to S as torch does when an op on such tensors computes in float32 (to nearest even;
// a bfloat16 NaN becomes c10's quiet NaN 0x7fc0).
template <typename S>
inline S from_float(float x) {
  return static_cast<S>(x);
}
template <>
inline Bf16 from_float<Bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<Bf16>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

template <typename S>
inline S* data(const at::Tensor& t) {
  return static_cast<S*>(t.data_ptr());
}

// Converts n elements to float32.
template <typename T>
inline void load_row(float* __restrict dst, const T* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// exp(x) to within ~2 ulp, written in plain arithmetic so loops over it vectorize (libm's expf
// does not, without -ffast-math): 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p of degree 7;
// 0 below -87 (where float32 exp underflows), -inf included.
inline float exp_approx(float x) {
  const float clamped = std::min(std::max(x, -87.f), 88.f);
  const float scaled = clamped * 1.44269504088896341f;
  const int32_t ni = static_cast<int32_t>(scaled + (scaled >= 0.f ? 0.5f : -0.5f));  // nearest
  const float n = static_cast<float>(ni);
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? 0.f : p * scale;
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// --- which path runs ---------------------------------------------------------------------------
//
// The linear kernels (bfloat16 and quantized weights) each have an AVX-512, an AVX2 + FMA and a
// portable path. The fastest this build and CPU can run serves, unless `set_quant_isa` chose a
// slower one (tests, A/B measurements: SONAR_CPU_ISA, read by sonar/kernels/native.py). avx512
// (compiled in with -march=native on a CPU with AVX512-BF16 and VNNI) serves bfloat16 x; float32
// x takes avx2 there.

bool cpu_has_avx2() {
#ifdef SONAR_AVX2
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

enum QuantIsa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

QuantIsa best_quant_isa() {
#ifdef SONAR_LINEAR_QUANT
  return kAvx512;
#else
  return cpu_has_avx2() ? kAvx2 : kPortable;
#endif
}

std::atomic<int64_t> g_quant_isa{-1};  // -1: best_quant_isa()

QuantIsa quant_isa_now() {
  const int64_t chosen = g_quant_isa.load(std::memory_order_relaxed);
  return chosen < 0 ? best_quant_isa() : static_cast<QuantIsa>(chosen);
}

const char* const kIsaNames[] = {"portable", "avx2", "avx512"};

std::string quant_isa() { return kIsaNames[quant_isa_now()]; }

// Chooses the path by name ("auto": the best one); a path this build or CPU cannot run is refused.
void set_quant_isa(const std::string& name) {
  if (name == "auto") {
    g_quant_isa.store(-1);
    return;
  }
  for (int64_t i = kPortable; i <= kAvx512; ++i) {
    if (name != kIsaNames[i]) continue;
    TORCH_CHECK(i <= best_quant_isa(), "sonar_cpu::set_quant_isa: ", name, " cannot run here (the best is ",
                kIsaNames[best_quant_isa()], ")");
    g_quant_isa.store(i);
    return;
  }
  TORCH_CHECK(false, "sonar_cpu::set_quant_isa: unknown path ", name, " (auto, portable, avx2, avx512)");
}

#ifdef SONAR_AVX512
// --- AVX-512 helpers: 16 floats at a time; the `n` variants touch only the first n lanes --------

inline __mmask16 first(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const Bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const _Float16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 loadn(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline __m512 loadn(const Bf16* p, int64_t n) {
  const __m256i h = _mm256_maskz_loadu_epi16(first(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 loadn(const _Float16* p, int64_t n) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(n), p));
}

// The bits of bfloat16(v) in the low half of each lane (`from_float<Bf16>` lane-wise).
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
}

inline void storen(float* p, __m512 v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
inline void storen(Bf16* p, __m512 v, int64_t n) {
  _mm256_mask_storeu_epi16(p, first(n), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
inline void storen(_Float16* p, __m512 v, int64_t n) {
  _mm256_mask_storeu_epi16(p, first(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// v rounded to S and back: what storing an intermediate result in a tensor of S does.
inline __m512 round_to(float*, __m512 v) { return v; }
inline __m512 round_to(Bf16*, __m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}
inline __m512 round_to(_Float16*, __m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <typename S>
inline __m512 round_to(__m512 v) {
  return round_to(static_cast<S*>(nullptr), v);
}

// `exp_approx` on 16 lanes.
inline __m512 exp16(__m512 x) {
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped));
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512 result = _mm512_scalef_ps(p, n);
  return _mm512_mask_mov_ps(result, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ), _mm512_setzero_ps());
}
#endif

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "sonar_cpu: ", name, " must be a CPU tensor");
}

void check_last_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 0 || t.stride(-1) == 1, "sonar_cpu: ", name, " needs a contiguous last dimension");
}

#define SONAR_DISPATCH(dtype, NAME, ...)                                              \
  [&] {                                                                               \
    switch (dtype) {                                                                  \
      case at::ScalarType::Float: { using scalar_t = float; return __VA_ARGS__(); }   \
      case at::ScalarType::BFloat16: { using scalar_t = Bf16; return __VA_ARGS__(); } \
      case at::ScalarType::Half: { using scalar_t = _Float16; return __VA_ARGS__(); } \
      default: TORCH_CHECK(false, "sonar_cpu::", NAME, ": unsupported dtype ", dtype); \
    }                                                                                 \
  }()

// --- decode attention over the paged KV cache ----------------------------------------------------
//
// One query token per sequence (a decode), attending to positions [start, seq_len) of its
// sequence, read straight from the cache blocks its block table names: no gather, no padding.
// Work is split over (sequence, KV head) pairs; the query heads of a group share each K/V row,
// converted once. Online softmax block by block (the flash-attention recurrence) in float32.
// Head dims that are a multiple of 16 up to 256 take the AVX-512 path when the CPU has it.

struct DecodeGeometry {
  int64_t head_dim, group, block_size, token_stride, block_stride, max_blocks;
  float scale;  // applied to the query, or to the scores by a kernel that says so (kScalesScores)
  float softcap;  // > 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2); 0: off
};

// What a block kernel does unless it says otherwise: the query it gets is already scaled, and its
// accumulators are in head_dim order.
struct BlockKernelDefaults {
  static constexpr bool kScalesScores = false;
  void finish(const DecodeGeometry&, float*) {}
};

// The online-softmax update for one block: scores s[g * block_size + t] (t in [t0, t1)) become
// probabilities relative to the running max m[g]; l[g] and the accumulator rescale.
inline void softmax_block(const DecodeGeometry& geo, int64_t t0, int64_t t1, float* s, float* m, float* l,
                          float* acc) {
  for (int64_t g = 0; g < geo.group; ++g) {
    float* sg = s + g * geo.block_size;
    if (geo.softcap > 0.f)
      for (int64_t t = t0; t < t1; ++t) sg[t] = geo.softcap * std::tanh(sg[t] / geo.softcap);
    float block_max = -std::numeric_limits<float>::infinity();
    for (int64_t t = t0; t < t1; ++t) block_max = std::max(block_max, sg[t]);
    const float new_max = std::max(m[g], block_max);
    const float correction = exp_approx(m[g] - new_max);  // 0 on the first block
    float sum = 0.f;
#ifdef SONAR_AVX512
    for (int64_t t = t0; t < t1; t += 16) {
      const __m512 p = exp16(_mm512_sub_ps(loadn(sg + t, t1 - t), _mm512_set1_ps(new_max)));
      sum += _mm512_mask_reduce_add_ps(first(t1 - t), p);
      storen(sg + t, p, t1 - t);
    }
#else
    for (int64_t t = t0; t < t1; ++t) {
      sg[t] = exp_approx(sg[t] - new_max);
      sum += sg[t];
    }
#endif
    l[g] = l[g] * correction + sum;
    m[g] = new_max;
    if (correction != 1.f) {
      float* a = acc + g * geo.head_dim;
      for (int64_t d = 0; d < geo.head_dim; ++d) a[d] *= correction;
    }
  }
}

// Portable: scores and the value accumulation over float rows converted once per block.
template <typename T>
struct PortableBlock : BlockKernelDefaults {
  std::vector<float> kf, vf;
  explicit PortableBlock(const DecodeGeometry& geo) : kf(geo.block_size * geo.head_dim), vf(kf.size()) {}

  void scores(const DecodeGeometry& geo, const T* keys, int64_t t0, int64_t t1, const float* q, float* s) {
    const int64_t n = geo.head_dim;
    for (int64_t t = t0; t < t1; ++t) load_row(&kf[t * n], keys + t * geo.token_stride, n);
    for (int64_t g = 0; g < geo.group; ++g)
      for (int64_t t = t0; t < t1; ++t) s[g * geo.block_size + t] = dot(q + g * n, &kf[t * n], n);
  }

  void accumulate(const DecodeGeometry& geo, const T* values, int64_t t0, int64_t t1, const float* p, float* acc) {
    const int64_t n = geo.head_dim;
    for (int64_t t = t0; t < t1; ++t) {
      float* v = &vf[t * n];
      load_row(v, values + t * geo.token_stride, n);
      for (int64_t g = 0; g < geo.group; ++g) {
        const float pt = p[g * geo.block_size + t];
        float* __restrict a = acc + g * n;
#pragma omp simd
        for (int64_t d = 0; d < n; ++d) a[d] += pt * v[d];
      }
    }
  }
};

#ifdef SONAR_AVX512
// AVX-512, any head_dim that is a multiple of 16: a block's K and V rows are converted to float32
// once (L1-resident), then each score is one horizontal sum and each output chunk accumulates over
// the block's tokens in a register.
template <typename T>
struct Avx512Block : BlockKernelDefaults {
  std::vector<float> kf, vf;
  explicit Avx512Block(const DecodeGeometry& geo) : kf(geo.block_size * geo.head_dim), vf(kf.size()) {}

  static void convert(float* dst, const T* src, int64_t t0, int64_t t1, const DecodeGeometry& geo) {
    const int64_t n = geo.head_dim;
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < n; c += 16) _mm512_storeu_ps(dst + t * n + c, load16(src + t * geo.token_stride + c));
  }

  void scores(const DecodeGeometry& geo, const T* keys, int64_t t0, int64_t t1, const float* q, float* s) {
    const int64_t n = geo.head_dim;
    convert(kf.data(), keys, t0, t1, geo);
    for (int64_t g = 0; g < geo.group; ++g) {
      const float* qg = q + g * n;
      for (int64_t t = t0; t < t1; ++t) {
        const float* k = &kf[t * n];
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(k));
        for (int64_t c = 16; c < n; c += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c), _mm512_loadu_ps(k + c), sum);
        s[g * geo.block_size + t] = _mm512_reduce_add_ps(sum);
      }
    }
  }

  void accumulate(const DecodeGeometry& geo, const T* values, int64_t t0, int64_t t1, const float* p, float* acc) {
    const int64_t n = geo.head_dim;
    convert(vf.data(), values, t0, t1, geo);
    for (int64_t g = 0; g < geo.group; ++g) {
      const float* pg = p + g * geo.block_size;
      for (int64_t c = 0; c < n; c += 16) {
        __m512 a = _mm512_loadu_ps(acc + g * n + c);
        for (int64_t t = t0; t < t1; ++t) a = _mm512_fmadd_ps(_mm512_set1_ps(pg[t]), _mm512_loadu_ps(&vf[t * n + c]), a);
        _mm512_storeu_ps(acc + g * n + c, a);
      }
    }
  }
};

// The 16 horizontal sums of 16 vectors p[0..15] (row i at p + 16 i) as one vector: lane i is
// the sum of row i. A transpose-and-add tree: 15 adds and 30 shuffles for 16 sums, where one
// horizontal sum alone costs 4 adds and 4 shuffles.
inline __m512 sum_rows16(const float* p) {
  __m512 u[8], w[4], x[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = _mm512_load_ps(p + 32 * i), b = _mm512_load_ps(p + 32 * i + 16);
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// AVX-512 for a group of G query heads per KV head and head_dim 16 * C, both known at compile
// time: the group's queries and accumulators stay in registers; K and V are read straight from
// the cache (converted in registers); the scores of 16 tokens come out of one `sum_rows16`.
template <typename T, int G, int C>
struct FixedAvx512Block : BlockKernelDefaults {
  alignas(64) float partial[G][16 * 16];

  explicit FixedAvx512Block(const DecodeGeometry&) {}

  void scores(const DecodeGeometry& geo, const T* keys, int64_t t0, int64_t t1, const float* q, float* s) {
    __m512 qv[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) qv[g][c] = _mm512_loadu_ps(q + g * 16 * C + c * 16);
    for (int64_t t16 = t0; t16 < t1; t16 += 16) {
      const int64_t n = std::min<int64_t>(16, t1 - t16);
      for (int64_t i = 0; i < 16; ++i) {
        if (i < n) {
          const T* row = keys + (t16 + i) * geo.token_stride;
          __m512 k[C];
          for (int c = 0; c < C; ++c) k[c] = load16(row + c * 16);
          for (int g = 0; g < G; ++g) {
            __m512 sum = _mm512_mul_ps(qv[g][0], k[0]);
            for (int c = 1; c < C; ++c) sum = _mm512_fmadd_ps(qv[g][c], k[c], sum);
            _mm512_store_ps(&partial[g][i * 16], sum);
          }
        } else {
          for (int g = 0; g < G; ++g) _mm512_store_ps(&partial[g][i * 16], _mm512_setzero_ps());
        }
      }
      for (int g = 0; g < G; ++g) storen(s + g * geo.block_size + t16, sum_rows16(partial[g]), n);
    }
  }

  void accumulate(const DecodeGeometry& geo, const T* values, int64_t t0, int64_t t1, const float* p, float* acc) {
    __m512 a[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * 16 * C + c * 16);
    for (int64_t t = t0; t < t1; ++t) {
      const T* row = values + t * geo.token_stride;
      __m512 v[C];
      for (int c = 0; c < C; ++c) v[c] = load16(row + c * 16);
      for (int g = 0; g < G; ++g) {
        const __m512 pt = _mm512_set1_ps(p[g * geo.block_size + t]);
        for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pt, v[c], a[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * 16 * C + c * 16, a[g][c]);
  }
};

#ifdef __AVX512BF16__
// bfloat16 caches on a CPU with AVX512-BF16, a group of G query heads and head_dim 16 * C: both
// products are dot products of bfloat16 pairs accumulated in float32 (`vdpbf16ps`), so K and V are
// never converted. Scores: the unscaled bfloat16 query against each K row, 32 elements per
// instruction, scaled in float32 afterwards. Values: two tokens' V rows interleaved element-wise
// (`vpunpck[lh]wd` within 128-bit lanes), weighted by their two probabilities rounded to bfloat16 (as
// torch's CPU flash attention rounds them for reduced-precision inputs), so the accumulators hold
// head_dim in a permuted order that `finish` undoes. About half the instructions per block of the
// float32 kernel above (SmolLM2's heads, batch 16, context 192, 30 layers' caches already in
// cache: 2.9 -> 2.0 ms); its mean error against a float32 reference equals torch's bfloat16 SDPA's.
template <int G, int C>
struct Bf16DotBlock : BlockKernelDefaults {
  static constexpr bool kScalesScores = true;
  static constexpr int P = C / 2;  // 32-element chunks of a head
  alignas(64) float partial[G][16 * 16];

  explicit Bf16DotBlock(const DecodeGeometry&) {}

  void scores(const DecodeGeometry& geo, const Bf16* keys, int64_t t0, int64_t t1, const float* q, float* s) {
    __m512bh qv[G][P];  // q holds bfloat16 values (unscaled), so this conversion is exact
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < P; ++c) {
        const float* src = q + g * 16 * C + c * 32;
        qv[g][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
      }
    const __m512 scale = _mm512_set1_ps(geo.scale);
    for (int64_t t16 = t0; t16 < t1; t16 += 16) {
      const int64_t n = std::min<int64_t>(16, t1 - t16);
      for (int64_t i = 0; i < 16; ++i) {
        if (i < n) {
          const Bf16* row = keys + (t16 + i) * geo.token_stride;
          __m512bh k[P];
          for (int c = 0; c < P; ++c) k[c] = (__m512bh)_mm512_loadu_si512(row + c * 32);
          for (int g = 0; g < G; ++g) {
            __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], k[0]);
            for (int c = 1; c < P; ++c) sum = _mm512_dpbf16_ps(sum, qv[g][c], k[c]);
            _mm512_store_ps(&partial[g][i * 16], sum);
          }
        } else {
          for (int g = 0; g < G; ++g) _mm512_store_ps(&partial[g][i * 16], _mm512_setzero_ps());
        }
      }
      for (int g = 0; g < G; ++g)
        storen(s + g * geo.block_size + t16, _mm512_mul_ps(sum_rows16(partial[g]), scale), n);
    }
  }

  void accumulate(const DecodeGeometry& geo, const Bf16* values, int64_t t0, int64_t t1, const float* p, float* acc) {
    __m512 a[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * 16 * C + c * 16);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t t16 = t0; t16 < t1; t16 += 16) {
      const int64_t n = std::min<int64_t>(16, t1 - t16);
      alignas(32) int32_t pairs[G][8];  // word j: the probabilities of tokens t16 + 2j and t16 + 2j + 1
      for (int g = 0; g < G; ++g)
        _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[g]),
                           (__m256i)_mm512_cvtneps_pbh(loadn(p + g * geo.block_size + t16, n)));
      for (int64_t i = 0; i < n; i += 2) {
        const Bf16* row = values + (t16 + i) * geo.token_stride;
        __m512bh lo[P], hi[P];
        for (int c = 0; c < P; ++c) {
          const __m512i v0 = _mm512_loadu_si512(row + c * 32);
          // an odd count's last pair: no second row (its probability is 0, the row may hold anything)
          const __m512i v1 = i + 1 < n ? _mm512_loadu_si512(row + geo.token_stride + c * 32) : zero;
          lo[c] = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
          hi[c] = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
        }
        for (int g = 0; g < G; ++g) {
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(pairs[g][i / 2]);
          for (int c = 0; c < P; ++c) {
            a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], lo[c], pp);
            a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], hi[c], pp);
          }
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * 16 * C + c * 16, a[g][c]);
  }

  // Accumulator lane 4L + m of the `lo` (h = 0) or `hi` (h = 1) half of 32-element chunk c holds
  // element 32c + 8L + 4h + m: put each back in place.
  void finish(const DecodeGeometry&, float* acc) {
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < P; ++c) {
        float* chunk = acc + g * 16 * C + c * 32;
        float permuted[32];
        std::memcpy(permuted, chunk, sizeof(permuted));
        for (int h = 0; h < 2; ++h)
          for (int lane = 0; lane < 4; ++lane)
            for (int m = 0; m < 4; ++m) chunk[8 * lane + 4 * h + m] = permuted[16 * h + 4 * lane + m];
      }
  }
};
#endif
#endif

// Blocks per share of a sequence that decode attention splits over its threads (see below): a
// share's merge costs about as much as a block.
constexpr int64_t kDecodeSplitBlocks = 8;

template <typename T, typename Kernel>
void decode_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& rows, double scale, int64_t window, double softcap,
                           const float* sinks) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_kv_heads = kv_cache.size(3);
  DecodeGeometry geo;
  geo.head_dim = query.size(2);
  geo.group = query.size(1) / num_kv_heads;
  geo.block_size = kv_cache.size(2);
  geo.token_stride = num_kv_heads * geo.head_dim;
  geo.block_stride = geo.block_size * geo.token_stride;
  geo.max_blocks = block_tables.size(1);
  geo.scale = static_cast<float>(scale);
  geo.softcap = static_cast<float>(softcap);
  const int64_t head_dim = geo.head_dim, group = geo.group, block_size = geo.block_size;
  const T* keys = data<const T>(kv_cache);
  const T* values = keys + kv_cache.size(1) * geo.block_stride;
  const T* q_base = data<const T>(query);
  T* o_base = data<T>(out);
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* row_of = rows.numel() ? rows.data_ptr<int64_t>() : nullptr;
  const float qscale = Kernel::kScalesScores ? 1.f : static_cast<float>(scale);

  // A unit of work is a sequence's KV heads [h0, h1) over a share of its blocks. With enough
  // sequences to keep every thread busy: all heads, all blocks (a block's K, then V, rows are then
  // read in address order, which the hardware prefetcher follows). With fewer: one head each over
  // all blocks, unless the longest sequence has `kDecodeSplitBlocks` blocks per share for two
  // units per thread; then all heads over a share of the blocks each (contiguous rows again, and
  // the threads' work even where the heads do not divide among them), each share's softmax
  // statistics and unnormalized output merged after (flash decoding).
  const int64_t threads = at::get_num_threads();
  int64_t longest = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) longest = std::max<int64_t>(longest, lens[seq]);
  const int64_t wanted = num_seqs >= 2 * threads ? 1 : (2 * threads + num_seqs - 1) / num_seqs;
  const int64_t shares = std::max<int64_t>(1, std::min(wanted, longest / block_size / kDecodeSplitBlocks));
  const int64_t heads_per_unit = num_seqs >= 2 * threads || shares > 1 ? num_kv_heads : 1;
  const int64_t units_per_seq = num_kv_heads / heads_per_unit * shares;
  const int64_t per_head = group * head_dim;
  const int64_t num_heads = num_kv_heads * group;
  const int64_t unit_bytes = heads_per_unit * head_dim * static_cast<int64_t>(sizeof(T));  // of a K or V row
  // with shares: each (sequence, share)'s running max, sum and accumulators of every query head
  std::vector<float> share_m(shares > 1 ? num_seqs * shares * num_heads : 0), share_l(share_m.size()),
      share_acc(share_m.size() * head_dim);
  at::parallel_for(0, num_seqs * units_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(heads_per_unit * per_head), acc(q.size()), s(group * block_size),
        m(heads_per_unit * group), l(m.size());
    Kernel kernel(geo);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t seq = unit / units_per_seq, share = unit % units_per_seq % shares;
      const int64_t h0 = unit % units_per_seq / shares * heads_per_unit;
      const int64_t len = lens[seq];
      const int64_t row = row_of ? row_of[seq] : seq;
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t first_block = start / block_size, blocks = (len + block_size - 1) / block_size - first_block;
      const int64_t b0 = first_block + blocks * share / shares, b1 = first_block + blocks * (share + 1) / shares;
      for (int64_t h = 0; h < heads_per_unit; ++h)
        for (int64_t g = 0; g < group; ++g) {
          const T* src = q_base + row * q_row + ((h0 + h) * group + g) * q_head;
          for (int64_t d = 0; d < head_dim; ++d) q[h * per_head + g * head_dim + d] = to_float(src[d]) * qscale;
        }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      // A sink (GPT-OSS) is a logit with no value: start each head's softmax as if it had seen it
      // (once: in the first share).
      if (sinks && share == 0)
        for (int64_t i = 0; i < heads_per_unit * group; ++i) {
          m[i] = sinks[h0 * group + i];
          l[i] = 1.f;
        }
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t block = tables[seq * geo.max_blocks + b];
        const int64_t t0 = std::max<int64_t>(start - b * block_size, 0);
        const int64_t t1 = std::min<int64_t>(len - b * block_size, block_size);
        // where the share's next block starts in the K (and V) half of the cache, -1 after its last
        const int64_t next = b + 1 < b1 ? tables[seq * geo.max_blocks + b + 1] * geo.block_stride : -1;
        for (int64_t h = 0; h < heads_per_unit; ++h) {
          const int64_t base = block * geo.block_stride + (h0 + h) * head_dim;
          kernel.scores(geo, keys + base, t0, t1, &q[h * per_head], s.data());
          softmax_block(geo, t0, t1, s.data(), &m[h * group], &l[h * group], &acc[h * per_head]);
          kernel.accumulate(geo, values + base, t0, t1, s.data(), &acc[h * per_head]);
          // The next block can be anywhere in the cache: ask for it (into L2) while this one is
          // computed, a share of its rows after each head, only the unit's heads of each row. (All
          // of it at once, into L1, before the block: 6.0 ms a step at batch 16 over
          // 30 layers of caches in memory; spread like this: 4.0 ms.)
          if (next >= 0) {
            for (int64_t t = h * block_size / heads_per_unit; t < (h + 1) * block_size / heads_per_unit; ++t) {
              const int64_t offset = next + t * geo.token_stride + h0 * head_dim;
              const char* k_row = reinterpret_cast<const char*>(keys + offset);
              const char* v_row = reinterpret_cast<const char*>(values + offset);
              for (int64_t byte = 0; byte < unit_bytes + 63; byte += 64) {
                const int64_t at = std::min(byte, unit_bytes - 1);
                __builtin_prefetch(k_row + at, 0, 2);
                __builtin_prefetch(v_row + at, 0, 2);
              }
            }
          }
        }
      }
      for (int64_t h = 0; h < heads_per_unit; ++h) kernel.finish(geo, &acc[h * per_head]);
      if (shares > 1) {
        const int64_t at = (seq * shares + share) * num_heads + h0 * group;
        std::copy(m.begin(), m.end(), share_m.begin() + at);
        std::copy(l.begin(), l.end(), share_l.begin() + at);
        std::copy(acc.begin(), acc.end(), share_acc.begin() + at * head_dim);
        continue;
      }
      for (int64_t h = 0; h < heads_per_unit; ++h)
        for (int64_t g = 0; g < group; ++g) {
          T* dst = o_base + row * o_row + ((h0 + h) * group + g) * o_head;
          const float inv = l[h * group + g] > 0.f ? 1.f / l[h * group + g] : 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = from_float<T>(acc[h * per_head + g * head_dim + d] * inv);
        }
    }
  });
  if (shares == 1) return;
  // the shares of each (sequence, query head) merged: rescaled to their common max, summed
  at::parallel_for(0, num_seqs * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(head_dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t seq = i / num_heads, head = i % num_heads;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t share = 0; share < shares; ++share) top = std::max(top, share_m[(seq * shares + share) * num_heads + head]);
      float sum = 0.f;
      std::fill(merged.begin(), merged.end(), 0.f);
      for (int64_t share = 0; share < shares; ++share) {
        const int64_t at = (seq * shares + share) * num_heads + head;
        const float weight = exp_approx(share_m[at] - top);  // 0 for a share that saw nothing
        if (weight == 0.f) continue;
        sum += share_l[at] * weight;
        for (int64_t d = 0; d < head_dim; ++d) merged[d] += share_acc[at * head_dim + d] * weight;
      }
      T* dst = o_base + (row_of ? row_of[seq] : seq) * o_row + head * o_head;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = from_float<T>(merged[d] * inv);
    }
  });
}

// The fixed kernel for (group, head_dim) in {1..8} x {64, 128} (for bfloat16 on a CPU with
// AVX512-BF16, the dot-product one), the generic AVX-512 one for other
// head dims that are a multiple of 16, the portable one otherwise.
template <typename T, int C, int G = 1>
void decode_attention_fixed(int64_t group, at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                            double scale, int64_t window, double softcap, const float* sinks) {
#ifdef SONAR_AVX512
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, Bf16>) {
    if (group == G)
      return decode_attention_impl<T, Bf16DotBlock<G, C>>(out, query, kv_cache, block_tables, seq_lens, rows, scale,
                                                          window, softcap, sinks);
  }
#endif
  if (group == G)
    return decode_attention_impl<T, FixedAvx512Block<T, G, C>>(out, query, kv_cache, block_tables, seq_lens, rows,
                                                              scale, window, softcap, sinks);
  if constexpr (G < 8) {
    return decode_attention_fixed<T, C, G + 1>(group, out, query, kv_cache, block_tables, seq_lens, rows, scale, window, softcap, sinks);
  }
  decode_attention_impl<T, Avx512Block<T>>(out, query, kv_cache, block_tables, seq_lens, rows, scale, window, softcap, sinks);
#endif
}

template <typename T>
void decode_attention_dispatch(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                               double scale, int64_t window, double softcap, const float* sinks) {
  const int64_t head_dim = query.size(2), group = query.size(1) / kv_cache.size(3);
#ifdef SONAR_AVX512
  if (head_dim == 64)
    return decode_attention_fixed<T, 4>(group, out, query, kv_cache, block_tables, seq_lens, rows, scale, window, softcap, sinks);
  if (head_dim == 128)
    return decode_attention_fixed<T, 8>(group, out, query, kv_cache, block_tables, seq_lens, rows, scale, window, softcap, sinks);
  if (head_dim % 16 == 0 && head_dim <= 256)
    return decode_attention_impl<T, Avx512Block<T>>(out, query, kv_cache, block_tables, seq_lens, rows, scale, window, softcap, sinks);
#endif
  decode_attention_impl<T, PortableBlock<T>>(out, query, kv_cache, block_tables, seq_lens, rows, scale, window, softcap, sinks);
}

void decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                      double scale, int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &query, &kv_cache, &block_tables, &seq_lens, &rows}) check_cpu(*t, "every tensor");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "sonar_cpu::decode_attention: query and out [tokens, heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "sonar_cpu::decode_attention: a contiguous kv_cache [2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(kv_cache.size(4) == query.size(2) && query.size(1) % kv_cache.size(3) == 0,
              "sonar_cpu::decode_attention: query heads must be a multiple of the cache's KV heads, same head_dim");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "sonar_cpu::decode_attention: query, out and kv_cache share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  block_tables.size(0) == seq_lens.size(0),
              "sonar_cpu::decode_attention: int32 block_tables [seqs, max_blocks] and seq_lens [seqs]");
  TORCH_CHECK(rows.numel() == 0 || (rows.scalar_type() == at::kLong && rows.numel() == seq_lens.size(0) && rows.is_contiguous()),
              "sonar_cpu::decode_attention: rows is empty or int64 [seqs]");
  TORCH_CHECK(rows.numel() != 0 || query.size(0) == seq_lens.size(0),
              "sonar_cpu::decode_attention: without rows, one query row per sequence");
  TORCH_CHECK(!sinks || (sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                         sinks->dim() == 1 && sinks->size(0) == query.size(1)),
              "sonar_cpu::decode_attention: sinks is a contiguous float32 [heads] CPU tensor");
  const float* sink_logits = sinks ? sinks->data_ptr<float>() : nullptr;
  check_last_contiguous(query, "query");
  check_last_contiguous(out, "out");
  SONAR_DISPATCH(query.scalar_type(), "decode_attention", [&] {
    decode_attention_dispatch<scalar_t>(out, query, kv_cache, block_tables, seq_lens, rows, scale, window, softcap, sink_logits);
  });
}

// --- bidirectional encoder attention -------------------------------------------------------------
//
// Every token of a sequence attends to every token of its own sequence (BERT-style encoders, no
// cache, no mask): q/k/v [tokens, heads, head_dim] (rows may be strided, e.g. views of one fused
// QKV projection), sequence i owning rows starts[i]..starts[i + 1]. A unit of work is one
// (sequence, head): its K and V are packed once into the layout the products want, then its
// queries go 16 rows at a time: all scores of the 16 rows (the whole sequence: no online softmax),
// softmax in float32, then P V; the rows are divided by their sums at the end. Head dims 32, 64
// and 128 (AVX-512); bfloat16 on a CPU with AVX512-BF16 multiplies bfloat16 pairs (`vdpbf16ps`),
// the probabilities rounded to bfloat16 before P V (as torch's CPU flash attention does for
// reduced-precision inputs), everything else computes in float32.

#ifdef SONAR_AVX512
constexpr int64_t kEncRows = 16;  // query rows per pass

// exp(x) for probabilities rounded to bfloat16 afterwards: `exp16`'s range reduction with a
// degree-4 polynomial (relative error ~4e-5, under a tenth of bfloat16's rounding step).
inline __m512 exp16_bf16(__m512 x) {
  const __m512 clamped = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped));
  __m512 p = _mm512_set1_ps(1.f / 24.f);
  for (const float c : {1.f / 6.f, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512 result = _mm512_scalef_ps(p, n);
  return _mm512_mask_mov_ps(result, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ), _mm512_setzero_ps());
}

// Softmax numerators of kEncRows rows of float32 scores s[r * padded + t] (keys past len masked),
// in place, or with `pairs` rounded to bfloat16 there instead ([r][padded / 2] pairs); their sums
// (of the float32 values) into sums.
template <bool ToBf16>
inline void encoder_softmax_rows(float* s, int64_t len, int64_t padded, float* sums, uint32_t* pairs = nullptr) {
  for (int64_t r = 0; r < kEncRows; ++r) {
    float* row = s + r * padded;
    for (int64_t t = len; t < padded; ++t) row[t] = -std::numeric_limits<float>::infinity();
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < padded; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(row + t));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += 16) {
#ifdef __AVX512BF16__
      if constexpr (ToBf16) {
        const __m512 p = exp16_bf16(_mm512_sub_ps(_mm512_loadu_ps(row + t), mx));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + r * padded / 2 + t / 2), (__m256i)_mm512_cvtneps_pbh(p));
        sum = _mm512_add_ps(sum, p);
        continue;
      }
#endif
      const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + t), mx));
      _mm512_storeu_ps(row + t, p);
      sum = _mm512_add_ps(sum, p);
    }
    sums[r] = _mm512_reduce_add_ps(sum);
  }
}

// Scores of query rows [0, rows) (a multiple of 4) against `tiles` 16-token tiles of packed keys,
// scaled, into s[r * stride + t]: 4 x 4 register tiles over the depth of `Dot`, which loads a
// key vector, broadcasts a query element and accumulates their product (float32 FMAs, or
// bfloat16 pairs through `vdpbf16ps`).
template <typename Dot>
inline void tiled_scores(const Dot& dot, int64_t rows, int64_t tiles, float scale, float* s, int64_t stride) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < rows; r0 += 4)
    for (int64_t j0 = 0; j0 < tiles; j0 += 4) {
      const int64_t nj = std::min<int64_t>(4, tiles - j0);
      __m512 acc[4][4];
      for (auto& a : acc)
        for (auto& x : a) x = _mm512_setzero_ps();
      for (int64_t i = 0; i < Dot::kDepth; ++i) {
        typename Dot::Vec kv[4];
        for (int64_t j = 0; j < 4; ++j) kv[j] = dot.key(j0 + std::min(j, nj - 1), i);
        for (int64_t r = 0; r < 4; ++r) {
          const typename Dot::Vec qb = dot.query(r0 + r, i);
          for (int64_t j = 0; j < 4; ++j) acc[r][j] = Dot::mac(acc[r][j], qb, kv[j]);
        }
      }
      for (int64_t r = 0; r < 4; ++r)
        for (int64_t j = 0; j < nj; ++j) _mm512_storeu_ps(s + (r0 + r) * stride + (j0 + j) * 16, _mm512_mul_ps(acc[r][j], sc));
    }
}

// Query rows of float32 q [row][D] against keys packed kp [tile][D][16].
template <int64_t D>
struct F32Dot {
  using Vec = __m512;
  static constexpr int64_t kDepth = D;
  const float* q;
  const float* kp;
  Vec key(int64_t tile, int64_t i) const { return _mm512_loadu_ps(kp + (tile * D + i) * 16); }
  Vec query(int64_t r, int64_t i) const { return _mm512_set1_ps(q[r * D + i]); }
  static __m512 mac(__m512 acc, Vec a, Vec b) { return _mm512_fmadd_ps(a, b, acc); }
};

template <typename T, int C>
struct EncoderF32 {
  static constexpr int64_t D = 16 * C;
  std::vector<float> kp, vp, q, s;  // K [tile][D][16], V [t][D], Q [kEncRows][D], S [kEncRows][padded]

  void pack(const T* k, const T* v, int64_t k_row, int64_t v_row, int64_t len, int64_t padded) {
    kp.assign(padded * D, 0.f);
    vp.assign(padded * D, 0.f);
    for (int64_t t = 0; t < len; ++t) {
      float* kt = kp.data() + (t / 16) * D * 16 + t % 16;
      for (int64_t d = 0; d < D; ++d) kt[d * 16] = to_float(k[t * k_row + d]);
      for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(vp.data() + t * D + 16 * c, load16(v + t * v_row + 16 * c));
    }
    s.resize(kEncRows * padded);
    q.resize(kEncRows * D);
  }

  void load_queries(const T* src, int64_t q_row, int64_t n, float scale) {
    std::fill(q.begin(), q.end(), 0.f);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t d = 0; d < D; ++d) q[r * D + d] = to_float(src[r * q_row + d]) * scale;
  }

  void scores(int64_t padded) { tiled_scores(F32Dot<D>{q.data(), kp.data()}, kEncRows, padded / 16, 1.f, s.data(), padded); }

  void softmax(int64_t len, int64_t padded, float* sums) { encoder_softmax_rows<false>(s.data(), len, padded, sums); }

  void values(int64_t padded, float* out) {  // out [kEncRows][D]
    constexpr int RB = C <= 2 ? 4 : (C <= 4 ? 2 : 1);
    for (int64_t r0 = 0; r0 < kEncRows; r0 += RB) {
      __m512 acc[RB][C];
      for (auto& a : acc)
        for (auto& x : a) x = _mm512_setzero_ps();
      for (int64_t t = 0; t < padded; ++t) {
        __m512 vv[C];
        for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(vp.data() + t * D + 16 * c);
        for (int r = 0; r < RB; ++r) {
          const __m512 p = _mm512_set1_ps(s[(r0 + r) * padded + t]);
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(p, vv[c], acc[r][c]);
        }
      }
      for (int r = 0; r < RB; ++r)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (r0 + r) * D + 16 * c, acc[r][c]);
    }
  }
};

#ifdef __AVX512BF16__
// Query rows of bfloat16 pairs q [row][DP] against keys packed as pairs kp [tile][DP][16].
template <int64_t DP>
struct PairDot {
  using Vec = __m512bh;
  static constexpr int64_t kDepth = DP;
  const uint32_t* q;
  const uint32_t* kp;
  Vec key(int64_t tile, int64_t i) const { return (__m512bh)_mm512_loadu_si512(kp + (tile * DP + i) * 16); }
  Vec query(int64_t r, int64_t i) const { return (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * DP + i])); }
  static __m512 mac(__m512 acc, Vec a, Vec b) { return _mm512_dpbf16_ps(acc, a, b); }
};

// P V of rows [0, rows) into acc [rows][16 C] (`add`: onto what acc holds, else over it): p
// [r][p_stride] bfloat16 pairs of probabilities, vp [pairs][16 C] token pairs of values.
template <int C>
inline void pair_values(const uint32_t* p, int64_t p_stride, const uint32_t* vp, int64_t pairs, int64_t rows,
                        float* acc, bool add) {
  constexpr int64_t D = 16 * C;
  constexpr int RB = C <= 2 ? 8 : (C <= 4 ? 4 : 2);
  for (int64_t r0 = 0; r0 < rows; r0 += RB) {
    const int nr = static_cast<int>(std::min<int64_t>(RB, rows - r0));
    __m512 a[RB][C];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < C; ++c)
        a[r][c] = add && r < nr ? _mm512_loadu_ps(acc + (r0 + r) * D + 16 * c) : _mm512_setzero_ps();
    for (int64_t tp = 0; tp < pairs; ++tp) {
      __m512bh vv[C];
      for (int c = 0; c < C; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + tp * D + 16 * c);
      for (int r = 0; r < nr; ++r) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[(r0 + r) * p_stride + tp]));
        for (int c = 0; c < C; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pb, vv[c]);
      }
    }
    for (int r = 0; r < nr; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (r0 + r) * D + 16 * c, a[r][c]);
  }
}

template <int C>
struct EncoderBf16 {
  static constexpr int64_t D = 16 * C, DP = D / 2;
  // K [tile][DP][16] and V [t / 2][D] of bfloat16 pairs (u32); Q [kEncRows][DP] pairs; S float32
  // [kEncRows][padded]; P [kEncRows][padded / 2] pairs
  std::vector<uint32_t> kp, vp, q, p;
  std::vector<float> s;

  void pack(const Bf16* k, const Bf16* v, int64_t k_row, int64_t v_row, int64_t len, int64_t padded) {
    kp.assign(padded * DP, 0u);
    vp.assign(padded / 2 * D, 0u);
    for (int64_t t = 0; t < len; ++t) {
      uint32_t* kt = kp.data() + (t / 16) * DP * 16 + t % 16;
      const Bf16* krow = k + t * k_row;
      for (int64_t i = 0; i < DP; ++i) std::memcpy(kt + i * 16, krow + 2 * i, 4);
      Bf16* vt = reinterpret_cast<Bf16*>(vp.data() + (t / 2) * D) + t % 2;
      const Bf16* vrow = v + t * v_row;
      for (int64_t d = 0; d < D; ++d) vt[2 * d] = vrow[d];
    }
    s.resize(kEncRows * padded);
    p.resize(kEncRows * padded / 2);
    q.resize(kEncRows * DP);
  }

  void load_queries(const Bf16* src, int64_t q_row, int64_t n, float) {  // scaled with the scores
    std::fill(q.begin(), q.end(), 0u);
    for (int64_t r = 0; r < n; ++r) std::memcpy(q.data() + r * DP, src + r * q_row, D * sizeof(Bf16));
  }

  void scores(int64_t padded, float scale) {
    tiled_scores(PairDot<DP>{q.data(), kp.data()}, kEncRows, padded / 16, scale, s.data(), padded);
  }

  void softmax(int64_t len, int64_t padded, float* sums) {
    encoder_softmax_rows<true>(s.data(), len, padded, sums, p.data());
  }

  void values(int64_t padded, float* out) {
    pair_values<C>(p.data(), padded / 2, vp.data(), padded / 2, kEncRows, out, false);
  }
};
#endif

template <typename T, typename Kernel>
void encoder_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const int32_t* starts, int64_t num_seqs, double scale) {
  const int64_t heads = q.size(1);
  constexpr int64_t D = Kernel::D;
  const T* qb = data<const T>(q);
  const T* kb = data<const T>(k);
  const T* vb = data<const T>(v);
  T* ob = data<T>(out);
  at::parallel_for(0, num_seqs * heads, 1, [&](int64_t begin, int64_t end) {
    Kernel kernel;
    alignas(64) float acc[kEncRows * D];
    float sums[kEncRows];
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t seq = unit / heads, h = unit % heads;
      const int64_t first = starts[seq], len = starts[seq + 1] - first;
      if (len <= 0) continue;
      const int64_t padded = (len + 15) / 16 * 16;
      kernel.pack(kb + first * k.stride(0) + h * k.stride(1), vb + first * v.stride(0) + h * v.stride(1), k.stride(0),
                  v.stride(0), len, padded);
      for (int64_t r0 = 0; r0 < len; r0 += kEncRows) {
        const int64_t n = std::min<int64_t>(kEncRows, len - r0);
        kernel.load_queries(qb + (first + r0) * q.stride(0) + h * q.stride(1), q.stride(0), n,
                            static_cast<float>(scale));
        if constexpr (std::is_same_v<Kernel, EncoderF32<T, Kernel::D / 16>>)
          kernel.scores(padded);
        else
          kernel.scores(padded, static_cast<float>(scale));
        kernel.softmax(len, padded, sums);
        kernel.values(padded, acc);
        for (int64_t r = 0; r < n; ++r) {
          T* dst = ob + (first + r0 + r) * out.stride(0) + h * out.stride(1);
          const __m512 inv = _mm512_set1_ps(1.f / sums[r]);
          for (int64_t c = 0; c < D; c += 16) storen(dst + c, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + c), inv), 16);
        }
      }
    }
  });
}

template <typename T, int C>
void encoder_attention_fixed(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const int32_t* starts, int64_t num_seqs, double scale) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, Bf16>)
    return encoder_attention_impl<T, EncoderBf16<C>>(out, q, k, v, starts, num_seqs, scale);
#endif
  encoder_attention_impl<T, EncoderF32<T, C>>(out, q, k, v, starts, num_seqs, scale);
}
#endif

bool has_encoder_attention() {
#ifdef SONAR_AVX512
  return true;
#else
  return false;
#endif
}

at::Tensor encoder_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& starts,
                             double scale) {
  for (const at::Tensor* t : {&q, &k, &v, &starts}) check_cpu(*t, "every tensor");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "sonar_cpu::encoder_attention: q, k and v [tokens, heads, head_dim] of one shape");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "sonar_cpu::encoder_attention: q, k and v share one dtype");
  TORCH_CHECK(starts.scalar_type() == at::kInt && starts.dim() == 1 && starts.is_contiguous() && starts.numel() >= 1,
              "sonar_cpu::encoder_attention: int32 starts [seqs + 1]");
  TORCH_CHECK(has_encoder_attention(), "sonar_cpu::encoder_attention: needs AVX-512");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 128,
              "sonar_cpu::encoder_attention: head_dim 32, 64 or 128");
  for (const at::Tensor* t : {&q, &k, &v}) check_last_contiguous(*t, "q, k and v");
  const int32_t* st = starts.data_ptr<int32_t>();
  const int64_t num_seqs = starts.numel() - 1;
  TORCH_CHECK(st[0] == 0 && st[num_seqs] == q.size(0), "sonar_cpu::encoder_attention: starts must span the rows");
  at::Tensor out = at::empty(q.sizes(), q.options());
#ifdef SONAR_AVX512
  SONAR_DISPATCH(q.scalar_type(), "encoder_attention", [&] {
    if (head_dim == 32) return encoder_attention_fixed<scalar_t, 2>(out, q, k, v, st, num_seqs, scale);
    if (head_dim == 64) return encoder_attention_fixed<scalar_t, 4>(out, q, k, v, st, num_seqs, scale);
    return encoder_attention_fixed<scalar_t, 8>(out, q, k, v, st, num_seqs, scale);
  });
#endif
  return out;
}

// --- prefill attention over the paged KV cache ---------------------------------------------------
//
// The query tokens of prefill chunks, causal over their sequence's context in the paged cache,
// bfloat16 on a CPU with AVX512-BF16. The decode kernel can serve a chunk a token at a time, but
// then every query re-reads its keys and pays a horizontal sum per score; here each (sequence, KV
// head)'s keys and values are first packed once into the layouts of `EncoderBf16` (K as 16-token
// tiles of bfloat16 pairs, V as token pairs), then 16 query rows of one head go at a time over
// spans of keys: scores as 4 x 4 register tiles, an online softmax per row from span to span (the
// flash recurrence), P V with the probabilities rounded to bfloat16 as torch's CPU flash attention
// rounds them. Rows of one unit are 16 consecutive tokens of one query head; units are taken from a
// shared counter, the longest (last) tiles first, so a thread that loses its core is covered.

#if defined(SONAR_AVX512) && defined(__AVX512BF16__)
constexpr int64_t kPrefillSpan = 512;  // keys per span: 16 rows' float32 scores, 32 KiB, stay in L1/L2

struct PrefillGeometry {
  int64_t kv_heads, group, block_size, token_stride, block_stride, max_blocks;
  const Bf16* keys;
  const Bf16* values;
  const int32_t* tables;
};

// One sequence's packed K and V for one KV head, as `EncoderBf16::pack` lays them out (tokens
// from `len` to the 16-token tile's end are zero: their probabilities are 0 and 0 * 0 stays 0).
template <int C>
void pack_prefill_context(const PrefillGeometry& geo, int64_t seq, int64_t head, int64_t len, uint32_t* kp,
                          uint32_t* vp) {
  constexpr int64_t D = 16 * C, DP = D / 2;
  const int64_t padded = (len + 15) / 16 * 16;
  for (int64_t t = 0; t < padded; ++t) {
    uint32_t* kt = kp + (t / 16) * DP * 16 + t % 16;
    Bf16* vt = reinterpret_cast<Bf16*>(vp + (t / 2) * D) + t % 2;
    if (t >= len) {
      for (int64_t i = 0; i < DP; ++i) kt[i * 16] = 0u;
      for (int64_t d = 0; d < D; ++d) vt[2 * d] = 0;
      continue;
    }
    const int64_t slot = geo.tables[seq * geo.max_blocks + t / geo.block_size] * geo.block_stride +
                         (t % geo.block_size) * geo.token_stride + head * D;
    const Bf16* krow = geo.keys + slot;
    const Bf16* vrow = geo.values + slot;
    for (int64_t i = 0; i < DP; ++i) std::memcpy(kt + i * 16, krow + 2 * i, 4);
    for (int64_t d = 0; d < D; ++d) vt[2 * d] = vrow[d];
  }
}

template <int C>
struct PrefillRows {
  static constexpr int64_t D = 16 * C, DP = D / 2, R = kEncRows;
  alignas(64) uint32_t q[R * DP];                  // the rows' queries as bfloat16 pairs, unscaled
  alignas(64) float s[R * kPrefillSpan];           // a span's scores, then (in place) nothing
  alignas(64) uint32_t p[R * kPrefillSpan / 2];    // a span's probabilities as bfloat16 pairs
  alignas(64) float acc[R * D];
  float m[R], l[R];

  // scores of rows [0, rows) (a multiple of 4) against keys [t0, t0 + padded) of the packed K
  void scores(const uint32_t* kp, int64_t t0, int64_t padded, int64_t rows, float scale) {
    tiled_scores(PairDot<DP>{q, kp + (t0 / 16) * DP * 16}, rows, padded / 16, scale, s, kPrefillSpan);
  }

  // Row r's online-softmax step over the span's keys, of which [a, b) are visible to it (relative
  // to the span; a < b); the probabilities go to p as bfloat16 pairs, zero outside [a, b).
  void softmax(int64_t r, int64_t a, int64_t b, int64_t padded) {
    float* row = s + r * kPrefillSpan;
    const float neg = -std::numeric_limits<float>::infinity();
    __m512 mx = _mm512_set1_ps(neg);
    for (int64_t t = 0; t < padded; t += 16) {
      const __mmask16 visible = visible_lanes(t, a, b);
      mx = _mm512_mask_max_ps(mx, visible, mx, _mm512_loadu_ps(row + t));
    }
    const float new_m = std::max(m[r], _mm512_reduce_max_ps(mx));
    const float correction = exp_approx(m[r] - new_m);  // 0 when nothing was seen before
    const __m512 shift = _mm512_set1_ps(new_m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += 16) {
      const __mmask16 visible = visible_lanes(t, a, b);
      const __m512 e = _mm512_maskz_mov_ps(visible, exp16_bf16(_mm512_sub_ps(_mm512_loadu_ps(row + t), shift)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + r * kPrefillSpan / 2 + t / 2), (__m256i)_mm512_cvtneps_pbh(e));
      sum = _mm512_add_ps(sum, e);
    }
    l[r] = l[r] * correction + _mm512_reduce_add_ps(sum);
    m[r] = new_m;
    if (correction != 1.f) {
      const __m512 c = _mm512_set1_ps(correction);
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), c));
    }
  }

  static __mmask16 visible_lanes(int64_t t, int64_t a, int64_t b) {
    const int64_t lo = std::max<int64_t>(a - t, 0), hi = std::min<int64_t>(b - t, 16);
    return lo >= hi ? __mmask16(0) : __mmask16(first(hi) & ~first(lo));
  }

  // acc[r] += P V over the span's keys [t0, t0 + padded), rows [0, rows)
  void values(const uint32_t* vp, int64_t t0, int64_t padded, int64_t rows) {
    pair_values<C>(p, kPrefillSpan / 2, vp + (t0 / 2) * D, padded / 2, rows, acc, true);
  }
};

template <int C>
void prefill_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const int32_t* lens, const int32_t* starts,
                            const int64_t* seqs, int64_t num_seqs, float scale, int64_t window, const float* sinks) {
  constexpr int64_t D = 16 * C, DP = D / 2, R = kEncRows;
  PrefillGeometry geo;
  geo.kv_heads = kv_cache.size(3);
  geo.group = query.size(1) / geo.kv_heads;
  geo.block_size = kv_cache.size(2);
  geo.token_stride = geo.kv_heads * D;
  geo.block_stride = geo.block_size * geo.token_stride;
  geo.max_blocks = block_tables.size(1);
  geo.keys = data<const Bf16>(kv_cache);
  geo.values = geo.keys + kv_cache.size(1) * geo.block_stride;
  geo.tables = block_tables.data_ptr<int32_t>();

  // where each (sequence, KV head)'s packed K and V go: padded * D words for the two together
  std::vector<int64_t> packed_at(num_seqs * geo.kv_heads + 1, 0);
  for (int64_t i = 0; i < num_seqs; ++i)
    for (int64_t h = 0; h < geo.kv_heads; ++h) {
      const int64_t padded = (lens[seqs[i]] + 15) / 16 * 16;
      packed_at[i * geo.kv_heads + h + 1] = packed_at[i * geo.kv_heads + h] + padded * D;
    }
  std::unique_ptr<uint32_t[]> packed(new uint32_t[packed_at.back()]);
  at::parallel_for(0, num_seqs * geo.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t i = unit / geo.kv_heads, h = unit % geo.kv_heads;
      const int64_t len = lens[seqs[i]], padded = (len + 15) / 16 * 16;
      uint32_t* kp = packed.get() + packed_at[unit];
      pack_prefill_context<C>(geo, seqs[i], h, len, kp, kp + padded * DP);
    }
  });

  // units: (sequence, query head, 16-row tile), the tiles that see the most keys first
  struct Unit {
    int64_t keys, index, head, row0;  // index: into seqs
  };
  std::vector<Unit> units;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t seq = seqs[i], q_len = starts[seq + 1] - starts[seq], pos0 = lens[seq] - q_len;
    for (int64_t row0 = 0; row0 < q_len; row0 += R)
      for (int64_t head = 0; head < query.size(1); ++head)
        units.push_back({pos0 + std::min(row0 + R, q_len), i, head, row0});
  }
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.keys > b.keys; });
  std::atomic<int64_t> next{0};
  const Bf16* q_base = data<const Bf16>(query);
  Bf16* o_base = data<Bf16>(out);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    auto rows = std::make_unique<PrefillRows<C>>();
    for (int64_t u = next++; u < static_cast<int64_t>(units.size()); u = next++) {
      const Unit& unit = units[u];
      const int64_t seq = seqs[unit.index], len = lens[seq], q_len = starts[seq + 1] - starts[seq];
      const int64_t pos0 = len - q_len + unit.row0, n = std::min<int64_t>(R, q_len - unit.row0);
      const int64_t kv_head = unit.head / geo.group;
      const int64_t padded_len = (len + 15) / 16 * 16;
      const uint32_t* kp = packed.get() + packed_at[unit.index * geo.kv_heads + kv_head];
      const uint32_t* vp = kp + padded_len * DP;
      std::fill(rows->q, rows->q + R * DP, 0u);
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(rows->q + r * DP, q_base + (starts[seq] + unit.row0 + r) * query.stride(0) + unit.head * query.stride(1),
                    D * sizeof(Bf16));
      std::fill(rows->acc, rows->acc + R * D, 0.f);
      for (int64_t r = 0; r < R; ++r) {  // a sink (GPT-OSS) is a logit with no value, seen first
        rows->m[r] = sinks ? sinks[unit.head] : -std::numeric_limits<float>::infinity();
        rows->l[r] = sinks ? 1.f : 0.f;
      }
      // keys [first, end): from the first row's window start (a whole tile) to the last row
      const int64_t end = pos0 + n;
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) / 16 * 16 : 0;
      const int64_t scored_rows = (n + 3) / 4 * 4;
      for (int64_t t0 = first; t0 < end; t0 += kPrefillSpan) {
        const int64_t t1 = std::min(end, t0 + kPrefillSpan), padded = (t1 - t0 + 15) / 16 * 16;
        rows->scores(kp, t0, padded, scored_rows, scale);
        for (int64_t r = 0; r < n; ++r) {
          const int64_t position = pos0 + r;
          const int64_t a = std::max<int64_t>(window > 0 ? position - window + 1 : 0, t0) - t0;
          const int64_t b = std::min(position + 1, t1) - t0;
          if (a < b) {
            rows->softmax(r, a, b, padded);
          } else {
            std::fill(rows->p + r * kPrefillSpan / 2, rows->p + r * kPrefillSpan / 2 + padded / 2, 0u);
          }
        }
        rows->values(vp, t0, padded, n);
      }
      for (int64_t r = 0; r < n; ++r) {
        Bf16* dst = o_base + (starts[seq] + unit.row0 + r) * out.stride(0) + unit.head * out.stride(1);
        const __m512 inv = _mm512_set1_ps(rows->l[r] > 0.f ? 1.f / rows->l[r] : 0.f);
        for (int64_t d = 0; d < D; d += 16) storen(dst + d, _mm512_mul_ps(_mm512_loadu_ps(rows->acc + r * D + d), inv), 16);
      }
    }
  });
}
#endif

bool has_prefill_attention() {
#if defined(SONAR_AVX512) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                       const at::Tensor& seqs, double scale, int64_t window, const std::optional<at::Tensor>& sinks) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &query, &kv_cache, &block_tables, &seq_lens,
                                                                      &query_start_loc, &seqs})
    check_cpu(*t, "every tensor");
  TORCH_CHECK(has_prefill_attention(), "sonar_cpu::prefill_attention: needs AVX512-BF16");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "sonar_cpu::prefill_attention: query and out [tokens, heads, head_dim]");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "sonar_cpu::prefill_attention: query, out and kv_cache are bfloat16");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "sonar_cpu::prefill_attention: a contiguous kv_cache [2, blocks, block_size, kv_heads, head_dim]");
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(kv_cache.size(4) == head_dim && query.size(1) % kv_cache.size(3) == 0,
              "sonar_cpu::prefill_attention: query heads must be a multiple of the cache's KV heads, same head_dim");
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 128, "sonar_cpu::prefill_attention: head_dim 32, 64 or 128");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && block_tables.size(0) == seq_lens.size(0),
              "sonar_cpu::prefill_attention: int32 block_tables [seqs, max_blocks] and seq_lens [seqs]");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                  query_start_loc.numel() == seq_lens.numel() + 1,
              "sonar_cpu::prefill_attention: int32 query_start_loc [seqs + 1]");
  TORCH_CHECK(seqs.scalar_type() == at::kLong && seqs.dim() == 1 && seqs.is_contiguous(),
              "sonar_cpu::prefill_attention: seqs is int64 [n]");
  TORCH_CHECK(!sinks || (sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                         sinks->dim() == 1 && sinks->size(0) == query.size(1)),
              "sonar_cpu::prefill_attention: sinks is a contiguous float32 [heads] CPU tensor");
  check_last_contiguous(query, "query");
  check_last_contiguous(out, "out");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int64_t* which = seqs.data_ptr<int64_t>();
  const int64_t num_seqs = seqs.numel();
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(which[i] >= 0 && which[i] < seq_lens.numel(), "sonar_cpu::prefill_attention: seqs out of range");
    const int64_t q_len = starts[which[i] + 1] - starts[which[i]];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[which[i]] && starts[which[i] + 1] <= query.size(0) &&
                    (lens[which[i]] + kv_cache.size(2) - 1) / kv_cache.size(2) <= block_tables.size(1),
                "sonar_cpu::prefill_attention: a sequence's query rows, length and block table disagree");
  }
#if defined(SONAR_AVX512) && defined(__AVX512BF16__)
  const float* sink_logits = sinks ? sinks->data_ptr<float>() : nullptr;
  const float s = static_cast<float>(scale);
  if (head_dim == 32) return prefill_attention_impl<2>(out, query, kv_cache, block_tables, lens, starts, which, num_seqs, s, window, sink_logits);
  if (head_dim == 64) return prefill_attention_impl<4>(out, query, kv_cache, block_tables, lens, starts, which, num_seqs, s, window, sink_logits);
  prefill_attention_impl<8>(out, query, kv_cache, block_tables, lens, starts, which, num_seqs, s, window, sink_logits);
#endif
}

// --- RMSNorm -------------------------------------------------------------------------------------
//
// out = weight * T(x * rsqrt(mean(x^2) + eps)), statistics in float32, the normalized row rounded
// to T before the weight multiplies (then rounded again), as the reference. Differs from it only
// in the order the squares are summed. With a residual: x = T(x + residual) first, also returned.

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor* residual, at::Tensor* summed,
                   const at::Tensor& weight, double eps) {
  const int64_t rows = x.numel() / x.size(-1), n = x.size(-1);
  const T* xs = data<const T>(x);
  const T* rs = residual ? data<const T>(*residual) : nullptr;
  T* ss = summed ? data<T>(*summed) : nullptr;
  const T* w = data<const T>(weight);
  T* os = data<T>(out);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
#ifndef SONAR_AVX512
    std::vector<float> row(n);
#endif
    for (int64_t r = begin; r < end; ++r) {
      const T* src = xs + r * n;
      T* dst = os + r * n;
#ifdef SONAR_AVX512
      __m512 squares = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        __m512 v = loadn(src + i, n - i);
        if (rs) {
          v = round_to<T>(_mm512_add_ps(v, loadn(rs + r * n + i, n - i)));
          storen(ss + r * n + i, v, n - i);
        }
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      if (rs) src = ss + r * n;
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(n) + feps));
      for (int64_t i = 0; i < n; i += 16) {
        const __m512 normed = round_to<T>(_mm512_mul_ps(loadn(src + i, n - i), inv));
        storen(dst + i, _mm512_mul_ps(loadn(w + i, n - i), normed), n - i);
      }
#else
      load_row(row.data(), src, n);
      if (rs)
        for (int64_t i = 0; i < n; ++i) {
          ss[r * n + i] = from_float<T>(row[i] + to_float(rs[r * n + i]));
          row[i] = to_float(ss[r * n + i]);
        }
      const float mean = dot(row.data(), row.data(), n) / static_cast<float>(n);
      const float inv = 1.f / std::sqrt(mean + feps);
      for (int64_t i = 0; i < n; ++i) {
        const float normed = to_float(from_float<T>(row[i] * inv));
        dst[i] = from_float<T>(to_float(w[i]) * normed);
      }
#endif
    }
  });
}

void check_rms_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "sonar_cpu::rms_norm: contiguous x [..., n] and weight [n]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "sonar_cpu::rms_norm: x and weight share one dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm(x, weight);
  at::Tensor out = at::empty_like(x);
  SONAR_DISPATCH(x.scalar_type(), "rms_norm", [&] { rms_norm_impl<scalar_t>(out, x, nullptr, nullptr, weight, eps); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  check_rms_norm(x, weight);
  check_cpu(residual, "residual");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "sonar_cpu::fused_add_rms_norm: residual shaped and typed as x, contiguous");
  at::Tensor out = at::empty_like(x), summed = at::empty_like(x);
  SONAR_DISPATCH(x.scalar_type(), "fused_add_rms_norm",
                 [&] { rms_norm_impl<scalar_t>(out, x, &residual, &summed, weight, eps); });
  return {out, summed};
}

// --- KV-cache write ------------------------------------------------------------------------------
//
// key/value [tokens, kv_heads, head_dim] (rows may be strided) into their slots of a cache
// [2, blocks, block_size, kv_heads, head_dim] of the same dtype; negative slots (padding) skipped.

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, const at::Tensor& slots) {
  for (const at::Tensor* t : {&key, &value, &slots}) check_cpu(*t, "every tensor");
  check_cpu(kv_cache, "kv_cache");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "sonar_cpu::write_kv_cache: a contiguous kv_cache [2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(1) == kv_cache.size(3) &&
                  key.size(2) == kv_cache.size(4),
              "sonar_cpu::write_kv_cache: key and value [tokens, kv_heads, head_dim] as the cache's");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "sonar_cpu::write_kv_cache: key, value and kv_cache share one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == key.size(0) && slots.is_contiguous(),
              "sonar_cpu::write_kv_cache: int64 slot_mapping [tokens]");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "sonar_cpu::write_kv_cache: contiguous head_dim");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  const int64_t total_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t row_bytes = dim * static_cast<int64_t>(kv_cache.element_size());
  const int64_t slot_bytes = heads * row_bytes;
  char* keys = static_cast<char*>(kv_cache.data_ptr());
  char* values = keys + total_slots * slot_bytes;
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t es = kv_cache.element_size();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0) continue;
    TORCH_CHECK(slot[t] < total_slots, "sonar_cpu::write_kv_cache: slot ", slot[t], " outside the cache");
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(keys + slot[t] * slot_bytes + h * row_bytes, k + (t * key.stride(0) + h * key.stride(1)) * es, row_bytes);
      std::memcpy(values + slot[t] * slot_bytes + h * row_bytes, v + (t * value.stride(0) + h * value.stride(1)) * es,
                  row_bytes);
    }
  }
}

// --- SiLU and multiply ---------------------------------------------------------------------------
//
// out = T(silu(gate)) * up for x = [gate | up], rounding after the SiLU and after the product as
// the reference's two torch ops do.

// One row: dst = T(T(silu(gate)) * up) over d elements, gate, up and dst in T or holding T's values
// in float32 (moe_quant's activations, rounded as this op rounds them).
template <typename T, typename In, typename Out>
inline void silu_and_mul_row(const In* gate, const In* up, Out* dst, int64_t d) {
#ifdef SONAR_AVX512
  for (int64_t i = 0; i < d; i += 16) {
    const __m512 g = loadn(gate + i, d - i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = round_to<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    const __m512 product = _mm512_mul_ps(silu, loadn(up + i, d - i));
    storen(dst + i, std::is_same_v<Out, T> ? product : round_to<T>(product), d - i);
  }
#else
  for (int64_t i = 0; i < d; ++i) {
    const float g = to_float(gate[i]);
    const float silu = to_float(from_float<T>(g / (1.f + exp_approx(-g))));
    dst[i] = from_float<Out>(to_float(from_float<T>(silu * to_float(up[i]))));
  }
#endif
}

template <typename T>
void silu_and_mul_impl(at::Tensor& out, const at::Tensor& x) {
  const int64_t d = out.size(-1), rows = out.numel() / d;
  const T* xs = data<const T>(x);
  T* os = data<T>(out);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_and_mul_row<T>(xs + r * 2 * d, xs + r * 2 * d + d, os + r * d, d);
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0, "sonar_cpu::silu_and_mul: contiguous x [..., 2 * d]");
  auto sizes = x.sizes().vec();
  sizes.back() /= 2;
  at::Tensor out = at::empty(sizes, x.options());
  SONAR_DISPATCH(x.scalar_type(), "silu_and_mul", [&] { silu_and_mul_impl<scalar_t>(out, x); });
  return out;
}

// --- each row's largest value and its index (greedy sampling) -----------------------------------
//
// torch.max(x, dim=-1) for float32 x [rows, n]: the largest value of each row and the index of its
// first occurrence, NaN counting as the largest (a row with one gives NaN and its first NaN's
// index). torch's reduction with indices is not vectorized on the CPU: ~50 us per row of a
// 49,152-token vocabulary, 1.5-2.7 ms for 64 rows on 2 cores. With AVX-512 one pass takes the
// maximum (NaNs noted apart), a second finds the first lane that holds it; the portable loop is
// one scalar pass.

void row_max_one(const float* x, int64_t n, float& best, int64_t& index) {
#ifdef SONAR_AVX512
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = lowest;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = i + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(lowest, lanes, x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(v, top);  // a NaN in v yields top: NaNs are noted above, not kept here
  }
  best = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(top);
  const __m512 wanted = _mm512_set1_ps(best);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = i + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(lowest, lanes, x + i);
    const __mmask16 hit = nan ? _mm512_mask_cmp_ps_mask(lanes, v, v, _CMP_UNORD_Q)
                              : _mm512_mask_cmp_ps_mask(lanes, v, wanted, _CMP_EQ_OQ);
    if (hit) {
      index = i + __builtin_ctz(hit);
      return;
    }
  }
  index = 0;  // not reached: the row holds its maximum (or a NaN)
#else
  best = -std::numeric_limits<float>::infinity();
  index = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] != x[i]) {  // the first NaN
      best = x[i];
      index = i;
      return;
    }
    if (x[i] > best) {  // strictly: the first of equal values stays
      best = x[i];
      index = i;
    }
  }
#endif
}

std::tuple<at::Tensor, at::Tensor> row_max(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) > 0,
              "sonar_cpu::row_max: contiguous float32 x [rows, n], n > 0");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor values = at::empty({rows}, x.options());
  at::Tensor indices = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xs = data<const float>(x);
  float* vs = data<float>(values);
  int64_t* is = data<int64_t>(indices);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_max_one(xs + r * n, n, vs[r], is[r]);
  });
  return {values, indices};
}

// --- rotary embedding (halves layout) ------------------------------------------------------------
//
// out = x * cos + rotate_half(x) * sin for x [tokens, heads, head_dim] and cos/sin [tokens,
// head_dim] already in T, each product and the sum rounded to T: bit for bit the reference's
// torch expression (sonar.kernels.reference.apply_rotary).

template <typename T>
void rotary_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t x_tok = x.stride(0), x_head = x.stride(1);
  const T* xs = data<const T>(x);
  const T* cs = data<const T>(cos);
  const T* ss = data<const T>(sin);
  T* os = data<T>(out);
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cs + t * dim;
      const T* s = ss + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* src = xs + t * x_tok + h * x_head;
        T* dst = os + (t * heads + h) * dim;
#ifdef SONAR_AVX512
        for (int64_t i = 0; i < half; i += 16) {
          const int64_t n = half - i;
          const __m512 x1 = loadn(src + i, n), x2 = loadn(src + half + i, n);
          const __m512 lo = _mm512_add_ps(round_to<T>(_mm512_mul_ps(x1, loadn(c + i, n))),
                                          round_to<T>(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), loadn(s + i, n))));
          const __m512 hi = _mm512_add_ps(round_to<T>(_mm512_mul_ps(x2, loadn(c + half + i, n))),
                                          round_to<T>(_mm512_mul_ps(x1, loadn(s + half + i, n))));
          storen(dst + i, lo, n);
          storen(dst + half + i, hi, n);
        }
#else
        for (int64_t i = 0; i < dim; ++i) {
          const float rotated = i < half ? -to_float(src[i + half]) : to_float(src[i - half]);
          const float a = to_float(from_float<T>(to_float(src[i]) * to_float(c[i])));
          const float b = to_float(from_float<T>(rotated * to_float(s[i])));
          dst[i] = from_float<T>(a + b);
        }
#endif
      }
    }
  });
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* t : {&x, &cos, &sin}) check_cpu(*t, "every tensor");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "sonar_cpu::rotary: x [tokens, heads, head_dim] with an even head_dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) && sin.sizes() == cos.sizes(),
              "sonar_cpu::rotary: contiguous cos and sin [tokens, head_dim]");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && sin.scalar_type() == cos.scalar_type(),
              "sonar_cpu::rotary: x, cos and sin share one dtype");
  check_last_contiguous(x, "x");
  at::Tensor out = at::empty(x.sizes(), x.options());
  SONAR_DISPATCH(x.scalar_type(), "rotary", [&] { rotary_impl<scalar_t>(out, x, cos, sin); });
  return out;
}

// --- bfloat16 linear layers for small batches ----------------------------------------------------
//
// y = x @ W.T (+ bias) for bfloat16 x [M, K] and W [N, K], with W packed once at load
// (sonar/kernels/linear.py) as [ceil(N / 16), K / 2, 16, 2]: a tile of 16 output columns is
// contiguous along K, each 64-byte row of it holding the 16 columns' weights for two consecutive
// k. One AVX512-BF16 dot-product instruction then advances 16 columns by two k for one row of x
// (its two values broadcast), accumulating in float32. A decode step reads each weight once (for
// up to 4 rows of x at a time, from cache for the next rows): the weights stream from memory at
// batch 1, and at batch 16 the work is the dot products. Each thread takes a contiguous range of
// tiles, 4 at a time. Bias is added in float32, the sum rounded to bfloat16 once.
//
// Above 4 rows each group of tiles is read from memory by its first block of rows and from cache
// by the others, and a core would stream, then compute, then stream again. So while a group's
// blocks of rows run, the thread prefetches (into L2) the next group it will take: the next four
// tiles of its range, or after its last group, its first group in the next linear layer when the
// caller names that layer (`decode_layers` does). Measured on SmolLM2's decode at batch 16: the
// layers' 120 linears 12.7-14.0 -> 11.5-11.8 ms, the whole step 22.8-25.4 -> 19.2-19.4 ms.
//
// On a CPU with AMX, from kLinearAmxRows rows the products run on the tile unit instead (below:
// `linear_amx`, same packed weight, same threads' split, no prefetch).

#ifdef SONAR_LINEAR_BF16

// Cache lines to prefetch while one block of rows runs: `count` lines from `lines`, spread over
// the block's iterations along K.
struct Prefetch {
  const char* lines = nullptr;
  int64_t count = 0;
};

template <int ROWS, int TILES>
inline void linear_block(const int32_t* x, int64_t kp_count, const int32_t* w, int64_t tile_stride, const Bf16* bias,
                         Bf16* y, int64_t y_stride, int64_t columns, Prefetch pf) {
  __m512 acc[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t per_kp = pf.count > 0 ? (pf.count + kp_count - 1) / kp_count : 0;
  for (int64_t kp = 0; kp < kp_count; ++kp) {
    for (int64_t j = kp * per_kp, stop = std::min(pf.count, j + per_kp); j < stop; ++j)
      _mm_prefetch(pf.lines + j * 64, _MM_HINT_T1);
    __m512bh wv[TILES];
    for (int t = 0; t < TILES; ++t) wv[t] = (__m512bh)_mm512_loadu_si512(w + t * tile_stride + kp * 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(x[r * kp_count + kp]);
      for (int t = 0; t < TILES; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[t], xb);
    }
  }
  for (int t = 0; t < TILES; ++t) {
    const int64_t n = columns - t * 16;
    const __m512 b = bias ? loadn(bias + t * 16, n) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) storen(y + r * y_stride + t * 16, _mm512_add_ps(acc[r][t], b), n);
  }
}

// Rows of x and tiles of W per register block: 16 float32 accumulators. (Measured on SmolLM2's
// shapes, 2 cores: 4x4, 6x4, 8x2 and 8x3 within 3 % of each other at 1, 16 and 64 rows; 16x1
// 1.4x slower; prefetching the weights a few lines ahead no faster: the next group, above, is.)
constexpr int kLinearRows = 4;
constexpr int kLinearTiles = 4;

template <int ROWS, int TILES = kLinearTiles>
inline void linear_rows(const int32_t* x, int64_t kp_count, const int32_t* w, int64_t tile_stride, const Bf16* bias,
                        Bf16* y, int64_t y_stride, int64_t tiles, int64_t columns, Prefetch pf = {}) {
  if constexpr (TILES > 1) {
    if (tiles < TILES)
      return linear_rows<ROWS, TILES - 1>(x, kp_count, w, tile_stride, bias, y, y_stride, tiles, columns, pf);
  }
  linear_block<ROWS, TILES>(x, kp_count, w, tile_stride, bias, y, y_stride, columns, pf);
}

// The last rows % kLinearRows rows.
template <int ROWS = kLinearRows - 1>
inline void linear_tail(int64_t rows, const int32_t* x, int64_t kp_count, const int32_t* w, int64_t tile_stride,
                        const Bf16* bias, Bf16* y, int64_t y_stride, int64_t tiles, int64_t columns) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) return linear_rows<ROWS>(x, kp_count, w, tile_stride, bias, y, y_stride, tiles, columns);
    linear_tail<ROWS - 1>(rows, x, kp_count, w, tile_stride, bias, y, y_stride, tiles, columns);
  }
}
#endif

// --- the AMX path (Intel Xeon since Sapphire Rapids), from kLinearAmxRows rows -------------------
//
// The packed layout is AMX's B-tile layout for `tdpbf16ps`: 16 K-pair rows of one column tile
// (64 bytes each: 16 columns x 2 bf16) are one 1 KB B tile, loaded in place (stride 64). A tiles
// are 16 rows of x x 32 k (stride K * 2 bytes), C tiles 16 x 16 float32. A register block is up to
// 2 blocks of 16 rows x 2 column tiles: 4 C tiles, 2 A, 2 B (tmm0-3, tmm4-5, tmm6-7; one tile
// configuration, every tile 16 rows x 64 bytes). A last block of fewer than 16 rows, and a K that
// is not a multiple of 32, read zero-padded copies (of x's last rows, of each tile's last K-pairs),
// so no tile reads past its tensor. The sums are stored to a scratch tile, the bias added in
// float32 and the sum rounded to bfloat16 once, as on the AVX-512 path; only the order of the
// float32 additions differs (results may differ from it in the last bit). The AMX instructions
// fault until the kernel grants this process the tile state: it is asked for once
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), and where that fails the AVX-512 path
// serves every row count. Threads split the tiles as on the AVX-512 path; no prefetch (the next
// group's weights are 1-2 KB per K step, and a block of rows reuses each one 16-32 times).
#if defined(SONAR_LINEAR_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SONAR_LINEAR_AMX 1

// From this many rows linear_bf16 takes the AMX path (measured: BENCHMARKS.md, "AMX").
constexpr int64_t kLinearAmxRows = 4;

bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void amx_configure() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.colsb[i] = 64;
    config.rows[i] = 16;
  }
  _tile_loadconfig(&config);
}

// C = A @ B over `steps` steps of 32 k for RB blocks of 16 rows (a[i], `a_stride` bytes per row)
// and CT column tiles (w[j], 512 bf16 per step; the last step from tail[j] when `tail` is set),
// stored to c[(i * CT + j) * 256 ...] as 16 x 16 float32.
template <int RB, int CT>
inline void amx_block(const Bf16* const* a, int64_t a_stride, const Bf16* const* w, const Bf16* const* tail,
                      int64_t steps, float* c) {
  _tile_zero(0);
  if constexpr (CT > 1) _tile_zero(1);
  if constexpr (RB > 1) _tile_zero(2);
  if constexpr (RB > 1 && CT > 1) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const bool last = tail != nullptr && s == steps - 1;
    _tile_loadd(4, a[0] + s * 32, a_stride);
    _tile_loadd(6, last ? tail[0] : w[0] + s * 512, 64);
    if constexpr (CT > 1) _tile_loadd(7, last ? tail[1] : w[1] + s * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RB > 1) {
      _tile_loadd(5, a[1] + s * 32, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (CT > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (CT > 1) _tile_stored(1, c + 256, 64);
  if constexpr (RB > 1) _tile_stored(2, c + CT * 256, 64);
  if constexpr (RB > 1 && CT > 1) _tile_stored(3, c + CT * 256 + 256, 64);
}

// Blocks of 16 rows per pass over a thread's column tiles: a pass's rows of x (128 x K bf16) stay in
// L2 while each pair of tiles reads them. Without it a prefill of 2048 rows re-read all of x from
// memory for every pair of tiles (SmolLM2's prefill at batch 16: 463 ms through oneDNN, 697 ms).
constexpr int64_t kAmxChunkBlocks = 8;

void linear_amx(const Bf16* xs, int64_t rows, int64_t k, const Bf16* ws, int64_t tiles, const Bf16* bs, Bf16* ys,
                int64_t out_features) {
  const int64_t kp_count = k / 2, steps = (kp_count + 15) / 16, tail_pairs = kp_count % 16;
  const int64_t tile_elems = kp_count * 32;  // bf16 per packed tile
  const int64_t blocks = (rows + 15) / 16, full_blocks = rows / 16;
  // x's rows as A tiles read them: in place when K is a multiple of 32, else a zero-padded copy;
  // the last partial block of rows from a zero-padded copy.
  const int64_t k_pad = steps * 32;
  std::vector<Bf16> padded;
  const Bf16* xa = xs;
  int64_t x_stride = k;  // elements
  if (k_pad != k) {
    padded.assign(blocks * 16 * k_pad, Bf16{});
    for (int64_t r = 0; r < rows; ++r) std::memcpy(padded.data() + r * k_pad, xs + r * k, k * sizeof(Bf16));
    xa = padded.data();
    x_stride = k_pad;
  }
  std::vector<Bf16> last_rows;
  if (blocks != full_blocks && k_pad == k) {
    last_rows.assign(16 * k, Bf16{});
    std::memcpy(last_rows.data(), xs + full_blocks * 16 * k, (rows - full_blocks * 16) * k * sizeof(Bf16));
  }
  const auto block_rows = [&](int64_t b) -> const Bf16* {
    return b < full_blocks || last_rows.empty() ? xa + b * 16 * x_stride : last_rows.data();
  };
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    amx_configure();
    alignas(64) float c[4 * 256];
    alignas(64) Bf16 tails[2][512];
    for (int64_t chunk = 0; chunk < blocks; chunk += kAmxChunkBlocks)
    for (int64_t t = begin; t < end; t += 2) {
      const int ct = std::min<int64_t>(2, end - t);
      const Bf16* w[2] = {ws + t * tile_elems, ws + (t + ct - 1) * tile_elems};
      const Bf16* tail[2] = {tails[0], tails[1]};
      if (tail_pairs != 0) {
        for (int j = 0; j < ct; ++j) {
          std::memset(tails[j], 0, sizeof(tails[j]));
          std::memcpy(tails[j], w[j] + (steps - 1) * 512, tail_pairs * 32 * sizeof(Bf16));
        }
      }
      const Bf16* const* tp = tail_pairs != 0 ? tail : nullptr;
      for (int64_t b = chunk, stop = std::min(blocks, chunk + kAmxChunkBlocks); b < stop; b += 2) {
        const int rb = std::min<int64_t>(2, stop - b);
        const Bf16* a[2] = {block_rows(b), block_rows(b + rb - 1)};
        const int64_t stride = x_stride * sizeof(Bf16);
        if (rb == 2 && ct == 2) amx_block<2, 2>(a, stride, w, tp, steps, c);
        else if (rb == 2) amx_block<2, 1>(a, stride, w, tp, steps, c);
        else if (ct == 2) amx_block<1, 2>(a, stride, w, tp, steps, c);
        else amx_block<1, 1>(a, stride, w, tp, steps, c);
        for (int i = 0; i < rb; ++i) {
          const int64_t row0 = (b + i) * 16, n_rows = std::min<int64_t>(16, rows - row0);
          for (int j = 0; j < ct; ++j) {
            const int64_t col = (t + j) * 16, n = std::min<int64_t>(16, out_features - col);
            const __m512 bias = bs ? loadn(bs + col, n) : _mm512_setzero_ps();
            const float* cs = c + (i * ct + j) * 256;
            for (int64_t r = 0; r < n_rows; ++r)
              storen(ys + (row0 + r) * out_features + col, _mm512_add_ps(_mm512_load_ps(cs + r * 16), bias), n);
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

// --- the AVX2 + FMA and portable paths of linear_bf16 --------------------------------------------
//
// The same packed weight as the AVX-512 path. A bfloat16 is the high half of a float32, so of 8
// packed units (8 columns' pairs) a shift gives the even k's weights as float32 and a mask the odd
// k's, exactly; x is widened to float32 once per call. Each product is one `vfmadd` in float32 in K
// order; the bias is added in float32 and the sum rounded to bfloat16 once, as on the AVX-512 path
// (which sums each pair before adding it: results may differ from it in the last bit).
//
// A register block is 4 rows x 1 tile (8 accumulators, 16 FMAs per K-pair for 2 weight loads) or,
// for a lone row (a decode at batch 1), 1 row x 4 tiles: 8 independent chains either way, enough to
// keep both FMA pipes busy, and at batch 1 the weights stream at memory speed. Rows are taken in
// chunks whose float32 x stays in L2 while each of the thread's tiles reads it.

#ifdef SONAR_AVX2
constexpr int kAvx2Bf16Rows = 4;
constexpr int kAvx2Bf16Tiles = 4;  // per block of a lone row
constexpr int64_t kAvx2Bf16ChunkBytes = 128 * 1024;

template <int ROWS, int TILES>
__attribute__((target("avx2,fma"))) void avx2_bf16_block(const float* x, int64_t k, const int32_t* w,
                                                        int64_t tile_stride, const Bf16* bias, Bf16* y,
                                                        int64_t y_stride, int64_t columns) {
  __m256 acc[ROWS][TILES][2];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t kp = 0, pairs = k / 2; kp < pairs; ++kp) {
    for (int t = 0; t < TILES; ++t) {
      for (int h = 0; h < 2; ++h) {
        const __m256i units = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + t * tile_stride + kp * 16 + h * 8));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(units, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(units, high));
        for (int r = 0; r < ROWS; ++r) {
          acc[r][t][h] = _mm256_fmadd_ps(even, _mm256_broadcast_ss(x + r * k + 2 * kp), acc[r][t][h]);
          acc[r][t][h] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(x + r * k + 2 * kp + 1), acc[r][t][h]);
        }
      }
    }
  }
  alignas(32) float sums[16];
  for (int t = 0; t < TILES; ++t) {
    const int64_t n = std::min<int64_t>(16, columns - t * 16);
    for (int r = 0; r < ROWS; ++r) {
      _mm256_store_ps(sums, acc[r][t][0]);
      _mm256_store_ps(sums + 8, acc[r][t][1]);
      for (int64_t c = 0; c < n; ++c)
        y[r * y_stride + t * 16 + c] = from_float<Bf16>(bias ? sums[c] + to_float(bias[t * 16 + c]) : sums[c]);
    }
  }
}

// Up to TILES tiles (`tiles` of them) against ROWS rows.
template <int ROWS, int TILES>
void avx2_bf16_tiles(const float* x, int64_t k, const int32_t* w, int64_t tile_stride, const Bf16* bias, Bf16* y,
                     int64_t y_stride, int64_t tiles, int64_t columns) {
  if constexpr (TILES > 1) {
    if (tiles < TILES) return avx2_bf16_tiles<ROWS, TILES - 1>(x, k, w, tile_stride, bias, y, y_stride, tiles, columns);
  }
  avx2_bf16_block<ROWS, TILES>(x, k, w, tile_stride, bias, y, y_stride, columns);
}

// Tiles [t, end) against ROWS rows, as many tiles per block as keep 8 accumulators or fewer.
template <int ROWS>
void avx2_bf16_rows(const float* x, int64_t k, const int32_t* ws, int64_t t, int64_t end, const Bf16* bs, Bf16* y,
                    int64_t out_features) {
  constexpr int kTiles = std::max(1, kAvx2Bf16Tiles / ROWS);
  const int64_t tile_stride = k / 2 * 16;
  for (; t < end; t += kTiles)
    avx2_bf16_tiles<ROWS, kTiles>(x, k, ws + t * tile_stride, tile_stride, bs ? bs + t * 16 : nullptr, y + t * 16,
                                  out_features, end - t, out_features - t * 16);
}

void linear_bf16_avx2(const float* xs, int64_t rows, int64_t k, const int32_t* ws, int64_t tiles, const Bf16* bs,
                      Bf16* ys, int64_t out_features) {
  const int64_t chunk = std::max<int64_t>(1, kAvx2Bf16ChunkBytes / (k * 4) / kAvx2Bf16Rows) * kAvx2Bf16Rows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t r1 = std::min(rows, r0 + chunk);
      // a group of tiles at a time: its weights stay in L2 for all of the chunk's rows
      for (int64_t t = begin; t < end; t += kAvx2Bf16Tiles) {
        const int64_t stop = std::min<int64_t>(end, t + kAvx2Bf16Tiles);
        int64_t r = r0;
        for (; r + kAvx2Bf16Rows <= r1; r += kAvx2Bf16Rows)
          avx2_bf16_rows<kAvx2Bf16Rows>(xs + r * k, k, ws, t, stop, bs, ys + r * out_features, out_features);
        const int64_t left = r1 - r;
        if (left == 3) avx2_bf16_rows<3>(xs + r * k, k, ws, t, stop, bs, ys + r * out_features, out_features);
        if (left == 2) avx2_bf16_rows<2>(xs + r * k, k, ws, t, stop, bs, ys + r * out_features, out_features);
        if (left == 1) avx2_bf16_rows<1>(xs + r * k, k, ws, t, stop, bs, ys + r * out_features, out_features);
      }
    }
  });
}
#endif

// The reference loop over the packed layout (SONAR_CPU_ISA=portable; no vector path needed).
void linear_bf16_portable(const Bf16* xs, int64_t rows, int64_t k, const uint32_t* ws, int64_t tiles, const Bf16* bs,
                          Bf16* ys, int64_t out_features) {
  const int64_t pairs = k / 2;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint32_t* w = ws + t * pairs * 16;
      const int64_t n = std::min<int64_t>(16, out_features - t * 16);
      for (int64_t r = 0; r < rows; ++r) {
        float acc[16] = {};
        for (int64_t kp = 0; kp < pairs; ++kp) {
          const float even = to_float(xs[r * k + 2 * kp]), odd = to_float(xs[r * k + 2 * kp + 1]);
          for (int c = 0; c < 16; ++c) {
            const uint32_t unit = w[kp * 16 + c];
            acc[c] += to_float(static_cast<Bf16>(unit & 0xffffu)) * even;
            acc[c] += to_float(static_cast<Bf16>(unit >> 16)) * odd;
          }
        }
        for (int64_t c = 0; c < n; ++c)
          ys[r * out_features + t * 16 + c] = from_float<Bf16>(bs ? acc[c] + to_float(bs[t * 16 + c]) : acc[c]);
      }
    }
  });
}

// The path linear_bf16 takes: the AVX-512 one wherever it is compiled in (a CPU with AVX512-BF16
// but not VNNI included), unless `set_quant_isa` chose a slower one.
QuantIsa linear_bf16_isa() {
#ifdef SONAR_LINEAR_BF16
  if (g_quant_isa.load(std::memory_order_relaxed) < 0) return kAvx512;
#endif
  return quant_isa_now();
}

// Called inside a parallel_for: the first tile this thread will take in the next parallel_for over
// `tiles` tiles with grain 1 (ATen's OpenMP split: the team's threads, at most one per tile, take
// equal contiguous chunks in thread order), or -1 if it takes none. Only a prefetch depends on it.
int64_t first_tile(int64_t tiles) {
#ifdef _OPENMP
  const int64_t team = omp_get_num_threads();
#else
  const int64_t team = at::get_num_threads();
#endif
  const int64_t threads = std::min<int64_t>(team, tiles);
  const int64_t chunk = (tiles + threads - 1) / threads, begin = at::get_thread_num() * chunk;
  return begin < tiles ? begin : -1;
}

#ifdef SONAR_LINEAR_BF16
// The lines of the first `group_tiles` tiles this thread will take of `next`, a packed weight (bf16
// or quantized) whose tiles are its first dimension, each one contiguous run of 64-byte lines.
Prefetch next_layer_lines(const at::Tensor& next, int64_t group_tiles) {
  const int64_t tiles = next.size(0), first = first_tile(tiles);
  if (first < 0) return {};
  const int64_t tile_lines = static_cast<int64_t>(next.nbytes()) / tiles / 64;
  return {static_cast<const char*>(next.data_ptr()) + first * tile_lines * 64,
          std::min<int64_t>(group_tiles, tiles - first) * tile_lines};
}
#endif

// y = x @ W.T (+ bias); `next`, when given, is the packed weight of the linear layer the caller
// runs next, whose first group this thread prefetches during its last one.
at::Tensor linear_bf16_then(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                            int64_t out_features, const at::Tensor* next) {
  check_cpu(x, "x");
  check_cpu(packed, "packed");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "sonar_cpu::linear_bf16: bfloat16 x and weights");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "sonar_cpu::linear_bf16: contiguous x [M, K], K even");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(1) * 2 == x.size(1) && packed.size(2) == 16 &&
                  packed.size(3) == 2 && out_features <= packed.size(0) * 16 && out_features > (packed.size(0) - 1) * 16,
              "sonar_cpu::linear_bf16: packed weights [ceil(N / 16), K / 2, 16, 2]");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == out_features,
                "sonar_cpu::linear_bf16: bfloat16 bias [N]");
  }
  const int64_t rows = x.size(0), tiles = packed.size(0);
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const Bf16* bs = bias ? data<const Bf16>(*bias) : nullptr;
  Bf16* ys = data<Bf16>(y);
  const QuantIsa isa = linear_bf16_isa();
  if (isa == kPortable) {
    linear_bf16_portable(data<const Bf16>(x), rows, x.size(1), data<const uint32_t>(packed), tiles, bs, ys, out_features);
    return y;
  }
#ifdef SONAR_AVX2
  if (isa == kAvx2) {
    const at::Tensor xf = x.to(at::kFloat);
    linear_bf16_avx2(data<const float>(xf), rows, x.size(1), data<const int32_t>(packed), tiles, bs, ys, out_features);
    return y;
  }
#endif
#ifdef SONAR_LINEAR_BF16
#ifdef SONAR_LINEAR_AMX
  if (rows >= kLinearAmxRows && amx_permitted()) {
    linear_amx(data<const Bf16>(x), rows, x.size(1), data<const Bf16>(packed), tiles, bs, ys, out_features);
    return y;
  }
#endif
  const int32_t* xs = data<const int32_t>(x);
  const int32_t* ws = data<const int32_t>(packed);
  const int64_t kp_count = packed.size(1), tile_stride = kp_count * 16;  // int32 pairs per tile
  const int64_t blocks = rows / kLinearRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t += kLinearTiles) {
      const int64_t count = std::min<int64_t>(kLinearTiles, end - t);
      const int64_t columns = std::min<int64_t>(count * 16, out_features - t * 16);
      const int32_t* w = ws + t * tile_stride;
      const Bf16* b = bs ? bs + t * 16 : nullptr;
      Prefetch group;  // the group this thread takes next, all of it (64-byte lines)
      if (blocks > 1 && t + count < end) {
        group = {reinterpret_cast<const char*>(w + count * tile_stride),
                 std::min<int64_t>(kLinearTiles, end - t - count) * kp_count};
      } else if (blocks > 1 && next != nullptr) {
        group = next_layer_lines(*next, kLinearTiles);
      }
      const int64_t share = (group.count + blocks - 1) / std::max<int64_t>(blocks, 1);
      int64_t r = 0;
      for (int64_t i = 0; r + kLinearRows <= rows; r += kLinearRows, ++i) {
        const int64_t from = std::min(group.count, i * share);
        const Prefetch part{group.lines + from * 64, std::min(share, group.count - from)};
        linear_rows<kLinearRows>(xs + r * kp_count, kp_count, w, tile_stride, b, ys + r * out_features + t * 16,
                                 out_features, count, columns, part);
      }
      linear_tail(rows - r, xs + r * kp_count, kp_count, w, tile_stride, b, ys + r * out_features + t * 16,
                  out_features, count, columns);
    }
  });
  return y;
#else
  (void)next;
  TORCH_CHECK(false, "sonar_cpu::linear_bf16: no ", kIsaNames[isa], " path in this build");
#endif
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t out_features) {
  return linear_bf16_then(x, packed, bias, out_features, nullptr);
}

// Whether linear_bf16 runs products of kLinearAmxRows rows or more on AMX tiles here (compiled in,
// and the kernel granted the tile state); 0 where it does not.
int64_t linear_amx_rows() {
#ifdef SONAR_LINEAR_AMX
  return amx_permitted() ? kLinearAmxRows : 0;
#else
  return 0;
#endif
}

bool has_linear_amx() { return linear_amx_rows() > 0; }

// Whether linear_bf16 has a vector path here (AVX-512 or AVX2): what the Python side packs weights
// for. Its portable path serves only when chosen.
bool has_linear_bf16() {
#ifdef SONAR_LINEAR_BF16
  return true;
#else
  return cpu_has_avx2();
#endif
}

// --- quantized linear layers ---------------------------------------------------------------------
//
// y = x @ W.T (+ bias) for bfloat16 or float32 x [M, K] (y and bias of x's dtype; float32 x takes
// the AVX2 path below, or the portable loop) and W in the logical layout of
// sonar/kernels/quant.py (w = v * scale + offset per group of `group` input columns of a row),
// packed once at load by sonar/kernels/quant_cpu.py as a byte tensor [ceil(N / 16), G, B]: per tile
// of 16 output columns and per group g, the group's weights in 64-byte lines, then the 16 columns'
// float32 scales (one line), then their float32 offsets (one line, when the weight has offsets).
// One tile is one contiguous run of bytes, read front to back, like linear_bf16's tiles.
//
// int8 takes llama.cpp's integer path: each row of x is quantized once per call to int8 per group
// (symmetric, scale_x = max |x| / 127, rounded to nearest even), and one AVX512-VNNI `vpdpbusd`
// multiplies 4 unsigned weight bytes by 4 signed activation bytes and adds them to a 32-bit lane,
// 16 output columns per instruction, exact in int32. A line holds 16 columns x 4 k, each column's
// 4 consecutive k in one 32-bit lane, stored as v + 128 (unsigned). Per group:
// y += scale scale_x sum((v + 128) xq) + (offset - 128 scale) scale_x sum(xq), sum(xq) the group's
// sum of the quantized x, so offsets stay exact relative to it. The output carries x's
// quantization error, at most scale_x / 2 sum |w| per group (as llama.cpp's does).
//
// int4 and fp8 keep bfloat16 x: their lines are unpacked in registers to bfloat16 vectors in
// linear_bf16's order (32-bit lane j: column j's weights at k and k + 1), fed to the same
// `vdpbf16ps`, accumulated in float32 one group at a time and scaled at the group's end:
// y += scale * sum_k(v x) + offset * sum_k(x), the sums of x per row and group computed once per
// call. The unpacking is exact: every int4 and e4m3 value is a bfloat16. (int4 through the integer
// path, 4 k per lane as low and high nibbles, measured on SmolLM2's shapes, 1 thread, 1.1-1.4x
// faster at 16 rows and up to 1.3x at 64, no faster at 1 row; but quantizing x for every layer
// moved the embedded SmolLM2's perplexity by 1.1 %, past the 1 % bar of
// tests/models/test_gguf_quant.py, where the int8 lm_head alone moves it by 0.1 %.)
//   int4: 16 columns x 8 k; each 16-bit lane holds the four nibbles of one (column, k parity) at
//     four consecutive k pairs. (nibble | 0x4300) read as bfloat16 is 128 + q exactly (one
//     vpternlogd per 32 values), so the dot product carries 128 * sum(x), taken back out with the
//     offset term: y += scale * dot + (offset - 128 scale) * sum(x).
//   fp8 (e4m3): 16 columns x 4 k, bytes in linear_bf16's pair order; with b sign-extended to 32
//     bits, ((b << 20) & 0x87f00000) read as float32 is the value times 2^-120, subnormals included
//     (as float32 subnormals); times 2^120, rounded (exactly) to bfloat16 by vcvtne2ps2bf16 (a
//     bfloat16 subnormal would be read as zero by vdpbf16ps, hence the float32 detour; the NaN
//     encoding, which no weight holds, reads as 480).
// Without AVX512-VNNI and AVX512-BF16 the AVX2 path (below) runs, or a portable loop that reads the
// same packing with the same quantized x for int8 bfloat16 x (same results up to float rounding of
// the per-group terms).
//
// mxfp4 (GGUF's MXFP4, OCP microscaling: 32 E2M1 values and one E8M0 exponent per block): the
// 4-bit codes in int4's lines, and in place of the float32 scale line the 16 columns' exponent
// bytes (16 bytes), so a 16 x 32 block takes 256 + 16 bytes, 17 bytes per 32 weights as in the
// file. A code is the E2M1 value doubled, an integer of kMxfp4Values (sign in bit 3), and the
// scale is 2^(e - 128) (ggml's e8m0_to_fp32_half), so every weight and scale is exact in float32.
// It runs on the AVX2 path (float32 x; bfloat16 x widened, also where AVX-512 serves the other
// formats) or the portable loop, never quantizing x.

enum QuantFormat : int64_t { kInt4 = 0, kInt8 = 1, kFp8 = 2, kMxfp4 = 3 };

// MXFP4's E2M1 values doubled, by code, and its E8M0 exponent as a float32 scale 2^(e - 128).
constexpr float kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

inline float e8m0_half(uint8_t e) {  // 2^(e - 128): subnormal for e < 2, as ggml builds it
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// The shape of a packed quantized weight, from the tensor and its format and group.
struct QuantGeometry {
  int64_t format, group, groups, k, tiles, group_bytes, meta_lines, stride_g, tile_bytes;
  bool offsets;

  static int64_t k_per_line(int64_t format) { return format == kInt4 || format == kMxfp4 ? 8 : 4; }

  QuantGeometry(const at::Tensor& packed, int64_t format_, int64_t group_, bool offsets_)
      : format(format_), group(group_), offsets(offsets_) {
    TORCH_CHECK(format >= kInt4 && format <= kMxfp4,
                "sonar_cpu::linear_quant: format 0 (int4), 1 (int8), 2 (fp8) or 3 (mxfp4)");
    TORCH_CHECK(format != kMxfp4 || !offsets, "sonar_cpu::linear_quant: mxfp4 has no offsets");
    TORCH_CHECK(group > 0 && group % k_per_line(format) == 0, "sonar_cpu::linear_quant: group ", group,
                " is not a multiple of ", k_per_line(format));
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous(),
                "sonar_cpu::linear_quant: packed weights: a contiguous uint8 [tiles, groups, bytes]");
    tiles = packed.size(0);
    groups = packed.size(1);
    k = groups * group;
    group_bytes = group / k_per_line(format) * 64;
    meta_lines = offsets ? 2 : 1;
    stride_g = group_bytes + (format == kMxfp4 ? 16 : meta_lines * 64);
    tile_bytes = groups * stride_g;
    TORCH_CHECK(packed.size(2) == stride_g, "sonar_cpu::linear_quant: packed weights of ", packed.size(2),
                " bytes per group, expected ", stride_g, " (group ", group, offsets ? ", with offsets)" : ")");
  }
};

// x as the kernels read it: per row `stride` 32-bit words (int8: the quantized x, 4 k per word;
// int4 / fp8: the bfloat16 x, 2 k per word) and per row and group `groups` floats of `sums`
// (int8: scale_x sum(xq); int4 / fp8: sum(x)) and of `scales` (int8: scale_x).
struct QuantX {
  const int32_t* x;
  int64_t stride;
  const float* sums;
  const float* scales;
  int64_t groups;

  QuantX from(int64_t row) const {
    return {x + row * stride, stride, sums + row * groups, scales ? scales + row * groups : nullptr, groups};
  }
};

// Per row of x and group: the sum of the row's values in the group, float32.
template <typename T>
std::vector<float> group_sums(const T* x, int64_t rows, int64_t k, int64_t group) {
  const int64_t groups = k / group;
  std::vector<float> sums(rows * groups);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < group; ++i) s += to_float(x[r * k + g * group + i]);
      sums[r * groups + g] = s;
    }
  return sums;
}

// x quantized per row and group to int8 (`xq`, rows x k bytes): scale_x = max |x| / 127 (zero for
// an all-zero group), xq = x / scale_x rounded to nearest even; `sums` and `scales` as in QuantX.
void quantize_rows(const Bf16* x, int64_t rows, int64_t k, int64_t group, int8_t* xq, float* sums, float* scales) {
  const int64_t groups = k / group;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const Bf16* xg = x + r * k + g * group;
      int8_t* qg = xq + r * k + g * group;
      float amax = 0.f;
      for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(to_float(xg[i])));
      const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < group; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(to_float(xg[i]) * inverse));
        qg[i] = static_cast<int8_t>(q);
        sum += q;
      }
      scales[r * groups + g] = scale;
      sums[r * groups + g] = scale * static_cast<float>(sum);
    }
}

#ifdef SONAR_LINEAR_QUANT

// One 64-byte int4 or fp8 line of a tile, unpacked one k pair at a time into bfloat16 pair vectors.
template <int FORMAT>
struct QuantLine {
  static constexpr int kPairs = FORMAT == kInt4 ? 4 : 2;
  __m512i w;  // int4: the line; fp8: unused (each pair is loaded from memory, widened)
  const uint8_t* line;

  QuantLine() = default;
  explicit QuantLine(const uint8_t* p) : line(p) {
    if constexpr (FORMAT == kInt4) w = _mm512_loadu_si512(p);
  }

  __m512bh pair(int p) const {
    if constexpr (FORMAT == kInt4) {
      const __m512i nibble = _mm512_set1_epi16(0x000f), high = _mm512_set1_epi16(0x4300);
      if (p == 3) return (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 12), high);
      const __m512i shifted = p == 0 ? w : _mm512_srli_epi16(w, 4 * p);
      return (__m512bh)_mm512_ternarylogic_epi32(shifted, nibble, high, 0xea);  // (w & nibble) | high
    } else {
      __m512 half[2];
      for (int h = 0; h < 2; ++h) {
        const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + p * 32 + h * 16)));
        const __m512i bits = _mm512_and_si512(_mm512_slli_epi32(b, 20), _mm512_set1_epi32(int32_t(0x87f00000u)));
        half[h] = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
      }
      return _mm512_cvtne2ps_pbh(half[1], half[0]);
    }
  }
};

// Bytes ahead in its tile at which a block prefetches while it reads a line: the unpacking keeps a
// core busy long enough that the hardware prefetcher alone leaves it waiting on memory at batch 1
// (measured, 1 thread, SmolLM2's gate_up: 512 bytes ahead ~10 % faster, 0 / 1024 / 2048 within noise).
constexpr int64_t kQuantAhead = 512;

// Independent accumulator chains a block keeps in flight: a small block splits each group's sums
// over interleaved accumulators.
template <int ROWS, int TILES>
constexpr int kQuantSplit = ROWS * TILES >= 8 ? 1 : 8 / (ROWS * TILES);

// ROWS rows of x against TILES int8 tiles (`columns` output columns from the first tile's first):
// per group, int32 sums by `vpdpbusd`, then scaled into float32.
template <int ROWS, int TILES>
inline void int8_block(const QuantX& x, const uint8_t* w, const QuantGeometry& geo, const Bf16* bias, Bf16* y,
                       int64_t y_stride, int64_t columns, Prefetch pf) {
  constexpr int SPLIT = kQuantSplit<ROWS, TILES>;
  const int64_t lines = geo.group_bytes / 64;
  __m512 out[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) out[r][t] = _mm512_setzero_ps();
  const int64_t per_line = pf.count > 0 ? (pf.count + geo.groups * lines - 1) / (geo.groups * lines) : 0;
  int64_t fetched = 0;
  for (int64_t g = 0; g < geo.groups; ++g) {
    const uint8_t* wg = w + g * geo.stride_g;
    __m512i acc[SPLIT][ROWS][TILES];
    for (int i = 0; i < SPLIT; ++i)
      for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < TILES; ++t) acc[i][r][t] = _mm512_setzero_si512();
    for (int64_t l = 0; l < lines; ++l) {
      for (const int64_t stop = std::min(pf.count, fetched + per_line); fetched < stop; ++fetched)
        _mm_prefetch(pf.lines + fetched * 64, _MM_HINT_T1);
      __m512i v[TILES];
      for (int t = 0; t < TILES; ++t) {
        const uint8_t* line = wg + t * geo.tile_bytes + l * 64;
        v[t] = _mm512_loadu_si512(line);
        _mm_prefetch(line + kQuantAhead, _MM_HINT_T0);
      }
      const int i = static_cast<int>(l % SPLIT);
      for (int r = 0; r < ROWS; ++r) {
        const __m512i xb = _mm512_set1_epi32(x.x[r * x.stride + g * lines + l]);
        for (int t = 0; t < TILES; ++t) acc[i][r][t] = _mm512_dpbusd_epi32(acc[i][r][t], v[t], xb);
      }
    }
    for (int i = 1; i < SPLIT; ++i)
      for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < TILES; ++t) acc[0][r][t] = _mm512_add_epi32(acc[0][r][t], acc[i][r][t]);
    for (int t = 0; t < TILES; ++t) {
      const float* meta = reinterpret_cast<const float*>(wg + t * geo.tile_bytes + geo.group_bytes);
      const __m512 scale = _mm512_loadu_ps(meta);
      const __m512 given = geo.offsets ? _mm512_loadu_ps(meta + 16) : _mm512_setzero_ps();
      const __m512 offset = _mm512_fnmadd_ps(scale, _mm512_set1_ps(128.f), given);  // offset - 128 scale
      for (int r = 0; r < ROWS; ++r) {
        const __m512 scaled = _mm512_mul_ps(scale, _mm512_set1_ps(x.scales[r * geo.groups + g]));
        out[r][t] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x.sums[r * geo.groups + g]),
                                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[0][r][t]), scaled, out[r][t]));
      }
    }
  }
  for (int t = 0; t < TILES; ++t) {
    const int64_t n = columns - t * 16;
    if (n <= 0) break;
    const __m512 b = bias ? loadn(bias + t * 16, n) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) storen(y + r * y_stride + t * 16, _mm512_add_ps(out[r][t], b), n);
  }
}

// ROWS rows of x against TILES int4 / fp8 tiles, unpacked line by line or read from `scratch`
// (SCRATCH).
template <int FORMAT, int ROWS, int TILES, bool SCRATCH>
inline void bf16_block(const QuantX& x, const uint8_t* w, const QuantGeometry& geo, const Bf16* bias, Bf16* y,
                      int64_t y_stride, int64_t columns, Prefetch pf, const int32_t* scratch) {
  constexpr int P = QuantLine<FORMAT>::kPairs;
  constexpr int SPLIT = kQuantSplit<ROWS, TILES>;
  const int64_t lines = geo.group_bytes / 64, kp_count = x.stride;
  __m512 out[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TILES; ++t) out[r][t] = _mm512_setzero_ps();
  const int64_t per_line = pf.count > 0 ? (pf.count + geo.groups * lines - 1) / (geo.groups * lines) : 0;
  int64_t fetched = 0;
  for (int64_t g = 0; g < geo.groups; ++g) {
    const uint8_t* wg = w + g * geo.stride_g;
    __m512 acc[SPLIT][ROWS][TILES];
    for (int i = 0; i < SPLIT; ++i)
      for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < TILES; ++t) acc[i][r][t] = _mm512_setzero_ps();
    for (int64_t l = 0; l < lines; ++l) {
      for (const int64_t stop = std::min(pf.count, fetched + per_line); fetched < stop; ++fetched)
        _mm_prefetch(pf.lines + fetched * 64, _MM_HINT_T1);
      const int32_t* xl = x.x + (g * lines + l) * P;
      QuantLine<FORMAT> raw[TILES];
      if constexpr (!SCRATCH) {
        for (int t = 0; t < TILES; ++t) {
          raw[t] = QuantLine<FORMAT>(wg + t * geo.tile_bytes + l * 64);
          _mm_prefetch(wg + t * geo.tile_bytes + l * 64 + kQuantAhead, _MM_HINT_T0);
        }
      }
      for (int p = 0; p < P; ++p) {
        __m512bh v[TILES];
        for (int t = 0; t < TILES; ++t) {
          if constexpr (SCRATCH) {
            v[t] = (__m512bh)_mm512_loadu_si512(scratch + t * kp_count * 16 + ((g * lines + l) * P + p) * 16);
          } else {
            v[t] = raw[t].pair(p);
          }
        }
        for (int r = 0; r < ROWS; ++r) {
          const __m512bh xb = (__m512bh)_mm512_set1_epi32(xl[r * kp_count + p]);
          for (int t = 0; t < TILES; ++t) acc[p % SPLIT][r][t] = _mm512_dpbf16_ps(acc[p % SPLIT][r][t], v[t], xb);
        }
      }
    }
    for (int i = 1; i < SPLIT; ++i)
      for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < TILES; ++t) acc[0][r][t] = _mm512_add_ps(acc[0][r][t], acc[i][r][t]);
    for (int t = 0; t < TILES; ++t) {
      const float* meta = reinterpret_cast<const float*>(wg + t * geo.tile_bytes + geo.group_bytes);
      const __m512 scale = _mm512_loadu_ps(meta);
      if (FORMAT == kInt4 || geo.offsets) {
        const __m512 given = geo.offsets ? _mm512_loadu_ps(meta + 16) : _mm512_setzero_ps();
        const __m512 offset = FORMAT == kInt4 ? _mm512_fnmadd_ps(scale, _mm512_set1_ps(128.f), given) : given;
        for (int r = 0; r < ROWS; ++r)
          out[r][t] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x.sums[r * geo.groups + g]),
                                      _mm512_fmadd_ps(acc[0][r][t], scale, out[r][t]));
      } else {
        for (int r = 0; r < ROWS; ++r) out[r][t] = _mm512_fmadd_ps(acc[0][r][t], scale, out[r][t]);
      }
    }
  }
  for (int t = 0; t < TILES; ++t) {
    const int64_t n = columns - t * 16;
    if (n <= 0) break;
    const __m512 b = bias ? loadn(bias + t * 16, n) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) storen(y + r * y_stride + t * 16, _mm512_add_ps(out[r][t], b), n);
  }
}

// The work of one thread, a group of kQuantTiles tiles at a time: blocks of kQuantRows rows, two
// tiles each; the last rows % kQuantRows rows in blocks of up to 3 rows and 4 tiles (a decode at
// batch 1 gets 4 tiles x 2 split accumulators in flight).
constexpr int kQuantRows = 8;
constexpr int kQuantTiles = 4;
constexpr int kQuantBlockTiles = 2;

template <int FORMAT, int ROWS, int TILES>
inline void quant_rows(int64_t tiles, const QuantX& x, const uint8_t* w, const QuantGeometry& geo, const Bf16* bias,
                       Bf16* y, int64_t y_stride, int64_t columns, Prefetch pf, const int32_t* scratch) {
  if constexpr (TILES > 1) {
    if (tiles < TILES)
      return quant_rows<FORMAT, ROWS, TILES - 1>(tiles, x, w, geo, bias, y, y_stride, columns, pf, scratch);
  }
  if constexpr (FORMAT == kInt8) {
    int8_block<ROWS, TILES>(x, w, geo, bias, y, y_stride, columns, pf);
  } else if (scratch != nullptr) {
    bf16_block<FORMAT, ROWS, TILES, true>(x, w, geo, bias, y, y_stride, columns, pf, scratch);
  } else {
    bf16_block<FORMAT, ROWS, TILES, false>(x, w, geo, bias, y, y_stride, columns, pf, nullptr);
  }
}

// `tiles` tiles (at most kQuantTiles) for ROWS rows, TILES tiles per block.
template <int FORMAT, int ROWS, int TILES>
inline void quant_tiles(int64_t tiles, const QuantX& x, const uint8_t* w, const QuantGeometry& geo, const Bf16* bias,
                        Bf16* y, int64_t y_stride, int64_t columns, Prefetch pf, const int32_t* scratch) {
  for (int64_t t = 0; t < tiles; t += TILES) {
    quant_rows<FORMAT, ROWS, TILES>(std::min<int64_t>(TILES, tiles - t), x, w + t * geo.tile_bytes, geo,
                                    bias ? bias + t * 16 : nullptr, y + t * 16, y_stride, columns - t * 16,
                                    t == 0 ? pf : Prefetch{}, scratch ? scratch + t * (geo.k / 2) * 16 : nullptr);
  }
}

template <int FORMAT, int ROWS = kQuantRows - 1>
inline void quant_tail(int64_t rows, int64_t tiles, const QuantX& x, const uint8_t* w, const QuantGeometry& geo,
                       const Bf16* bias, Bf16* y, int64_t y_stride, int64_t columns, const int32_t* scratch) {
  if constexpr (ROWS > 0) {
    if (rows == ROWS) {
      constexpr int tiles_per_block = ROWS <= 3 ? kQuantTiles : kQuantBlockTiles;
      return quant_tiles<FORMAT, ROWS, tiles_per_block>(tiles, x, w, geo, bias, y, y_stride, columns, {}, scratch);
    }
    quant_tail<FORMAT, ROWS - 1>(rows, tiles, x, w, geo, bias, y, y_stride, columns, scratch);
  }
}

// From this many blocks of rows on, a group of fp8 tiles is unpacked once into a scratch buffer of
// bfloat16 pairs (linear_bf16's tile layout, in L2) that every block of rows reads, instead of each
// block unpacking it again (measured with SmolLM2's lm_head shape unpacked from int8 bytes the same
// way, 1 thread, 64 rows: 0.77 -> 0.93x bf16's time; at 16 rows slower; for int4, whose unpacking
// is cheap, slower at every count).
constexpr int64_t kFp8ScratchBlocks = 4;

// `tiles` fp8 tiles unpacked into `scratch` (per tile K / 2 pairs of 16 lanes), prefetching `pf`.
void unpack_tiles(const uint8_t* w, int64_t tiles, const QuantGeometry& geo, int32_t* scratch, Prefetch pf) {
  constexpr int P = QuantLine<kFp8>::kPairs;
  const int64_t lines = geo.group_bytes / 64, kp_count = geo.k / 2;
  const int64_t per_line = pf.count > 0 ? (pf.count + tiles * geo.groups * lines - 1) / (tiles * geo.groups * lines) : 0;
  int64_t fetched = 0;
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t g = 0; g < geo.groups; ++g)
      for (int64_t l = 0; l < lines; ++l) {
        for (const int64_t stop = std::min(pf.count, fetched + per_line); fetched < stop; ++fetched)
          _mm_prefetch(pf.lines + fetched * 64, _MM_HINT_T1);
        const uint8_t* line = w + t * geo.tile_bytes + g * geo.stride_g + l * 64;
        _mm_prefetch(line + kQuantAhead, _MM_HINT_T0);
        const QuantLine<kFp8> raw(line);
        int32_t* out = scratch + t * kp_count * 16 + (g * lines + l) * P * 16;
        for (int p = 0; p < P; ++p) _mm512_storeu_si512(out + p * 16, (__m512i)raw.pair(p));
      }
}

// Tiles [begin, end) of `ws` against `rows` rows of x: y[r * y_stride + c] for column c from tile
// `begin`'s first (below `out_features`), bias `bs` (of every column, or null) added. One thread's
// share of linear_quant_avx512, and a work item of moe_quant: its groups of kQuantTiles tiles start
// at `begin`, so two callers whose ranges start at the same tile modulo kQuantTiles compute the same
// blocks, bit for bit. `next`: as in linear_quant_then; `scratch`: fp8's unpacked tiles, sized here.
template <int FORMAT>
void avx512_tiles(const QuantX& xs, int64_t rows, const uint8_t* ws, const QuantGeometry& geo, const Bf16* bs,
                  int64_t begin, int64_t end, Bf16* y, int64_t y_stride, int64_t out_features, const at::Tensor* next,
                  std::vector<int32_t>& scratch) {
  const int64_t blocks = rows / kQuantRows;
  const bool unpacked = FORMAT == kFp8 && blocks >= kFp8ScratchBlocks;
  if (unpacked) scratch.resize(kQuantTiles * (geo.k / 2) * 16);
  for (int64_t t = begin; t < end; t += kQuantTiles) {
    const int64_t count = std::min<int64_t>(kQuantTiles, end - t);
    const int64_t columns = std::min<int64_t>(count * 16, out_features - t * 16);
    const uint8_t* w = ws + t * geo.tile_bytes;
    const Bf16* b = bs ? bs + t * 16 : nullptr;
    Bf16* yt = y + (t - begin) * 16;
    Prefetch group;  // as linear_bf16: the tiles this thread takes next, or the next layer's first
    if (blocks > 1 && t + count < end) {
      group = {reinterpret_cast<const char*>(w + count * geo.tile_bytes),
               std::min<int64_t>(kQuantTiles, end - t - count) * geo.tile_bytes / 64};
    } else if (blocks > 1 && next != nullptr) {
      group = next_layer_lines(*next, kQuantTiles);
    }
    const int64_t share = (group.count + blocks - 1) / std::max<int64_t>(blocks, 1);
    const int32_t* from_scratch = nullptr;
    if (unpacked) {
      unpack_tiles(w, count, geo, scratch.data(), group);
      group = {};  // prefetched while unpacking
      from_scratch = scratch.data();
    }
    int64_t r = 0;
    for (int64_t i = 0; r + kQuantRows <= rows; r += kQuantRows, ++i) {
      const int64_t from = std::min(group.count, i * share);
      const Prefetch part{group.lines + from * 64, std::min(share, group.count - from)};
      quant_tiles<FORMAT, kQuantRows, kQuantBlockTiles>(count, xs.from(r), w, geo, b, yt + r * y_stride, y_stride,
                                                        columns, part, from_scratch);
    }
    quant_tail<FORMAT>(rows - r, count, xs.from(r), w, geo, b, yt + r * y_stride, y_stride, columns, from_scratch);
  }
}

template <int FORMAT>
void linear_quant_avx512(const QuantX& xs, int64_t rows, const uint8_t* ws, const QuantGeometry& geo, const Bf16* bs,
                         Bf16* ys, int64_t out_features, const at::Tensor* next) {
  at::parallel_for(0, geo.tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> scratch;
    avx512_tiles<FORMAT>(xs, rows, ws, geo, bs, begin, end, ys + begin * 16, out_features, out_features, next, scratch);
  });
}
#endif

// The portable loop: per tile and group, the group's weights unpacked once (int8 with bfloat16 x:
// as the stored unsigned bytes, multiplied with the quantized x; otherwise to float32), then every
// row's 16 column sums over them. T is x's (and y's) element type: float x keeps every format in
// float32, int8 included (no activation rounding).
// One tile of the portable loop: out[r * 16 + c] = row r's dot product with the tile's column c,
// for the tile at `w`; `wf` and `wi` scratch of group * 16 each.
template <typename T>
void portable_tile(const QuantX& xs, int64_t rows, const uint8_t* w, const QuantGeometry& geo, float* wf, int32_t* wi,
                   float* out) {
  const bool integer = geo.format == kInt8 && std::is_same_v<T, Bf16>;
  std::fill(out, out + rows * 16, 0.f);
  for (int64_t g = 0; g < geo.groups; ++g) {
    const uint8_t* wg = w + g * geo.stride_g;
    for (int64_t i = 0; i < geo.group; ++i) {  // k = g * group + i
      const int64_t line = i / QuantGeometry::k_per_line(geo.format), within = i % QuantGeometry::k_per_line(geo.format);
      for (int64_t c = 0; c < 16; ++c) {
        if (geo.format == kInt4 || geo.format == kMxfp4) {
          const uint8_t* lane = wg + line * 64 + (c * 2 + within % 2) * 2;
          const uint16_t word = static_cast<uint16_t>(lane[0] | lane[1] << 8);
          const int code = (word >> (4 * (within / 2))) & 0xf;
          wf[i * 16 + c] = geo.format == kInt4 ? static_cast<float>(code) : kMxfp4Values[code];
        } else if (geo.format == kInt8) {
          const uint8_t byte = wg[line * 64 + c * 4 + within];
          wi[i * 16 + c] = byte;
          wf[i * 16 + c] = static_cast<float>(static_cast<int8_t>(byte ^ 0x80));
        } else {
          const uint8_t byte = wg[line * 64 + (within / 2) * 32 + c * 2 + within % 2];
          const uint32_t bits =
              (static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(byte))) << 20) & 0x87f00000u;
          float v;
          std::memcpy(&v, &bits, sizeof v);
          wf[i * 16 + c] = v * 0x1p120f;
        }
      }
    }
    float exponent_scale[16];
    if (geo.format == kMxfp4)
      for (int64_t c = 0; c < 16; ++c) exponent_scale[c] = e8m0_half(wg[geo.group_bytes + c]);
    const float* scale =
        geo.format == kMxfp4 ? exponent_scale : reinterpret_cast<const float*>(wg + geo.group_bytes);
    const float* offset = geo.offsets ? scale + 16 : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      const QuantX xr = xs.from(r);
      const float s = xr.sums[g];
      float* o = out + r * 16;
      if (integer) {
        const int8_t* xq = reinterpret_cast<const int8_t*>(xr.x) + g * geo.group;
        int32_t acc[16] = {};
        for (int64_t i = 0; i < geo.group; ++i)
          for (int64_t c = 0; c < 16; ++c) acc[c] += xq[i] * wi[i * 16 + c];
        for (int64_t c = 0; c < 16; ++c) {
          const float off = (offset ? offset[c] : 0.f) - 128.f * scale[c];
          o[c] += static_cast<float>(acc[c]) * (scale[c] * xr.scales[g]) + off * s;
        }
      } else {
        const T* xb = reinterpret_cast<const T*>(xr.x) + g * geo.group;
        float acc[16] = {};
        for (int64_t i = 0; i < geo.group; ++i) {
          const float xi = to_float(xb[i]);
#pragma omp simd
          for (int64_t c = 0; c < 16; ++c) acc[c] += xi * wf[i * 16 + c];
        }
        for (int64_t c = 0; c < 16; ++c) o[c] += acc[c] * scale[c] + (offset ? offset[c] * s : 0.f);
      }
    }
  }
}

// The portable loop: per tile and group, the group's weights unpacked once (int8 with bfloat16 x:
// as the stored unsigned bytes, multiplied with the quantized x; otherwise to float32), then every
// row's 16 column sums over them. T is x's (and y's) element type: float x keeps every format in
// float32, int8 included (no activation rounding).
template <typename T>
void linear_quant_portable(const QuantX& xs, int64_t rows, const uint8_t* ws, const QuantGeometry& geo, const T* bs,
                           T* ys, int64_t out_features) {
  at::parallel_for(0, geo.tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(geo.group * 16), out(rows * 16);
    std::vector<int32_t> wi(geo.group * 16);
    for (int64_t t = begin; t < end; ++t) {
      portable_tile<T>(xs, rows, ws + t * geo.tile_bytes, geo, wf.data(), wi.data(), out.data());
      const int64_t columns = std::min<int64_t>(16, out_features - t * 16);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < columns; ++c) {
          const float b = bs ? to_float(bs[t * 16 + c]) : 0.f;
          ys[r * out_features + t * 16 + c] = from_float<T>(out[r * 16 + c] + b);
        }
    }
  });
}

// --- the AVX2 + FMA path -------------------------------------------------------------------------
//
// For CPUs without AVX-512 (AVX2-only EPYCs and Cores) and for float32 x on every x86 CPU: x in
// float32 (a bfloat16 x is widened once per call), every format unpacked in registers to exact
// float32 values, 8 output columns per 256-bit vector, multiplied by `vfmadd` and accumulated in
// float32 one group at a time, then y += scale * sum_k(v x) + offset * sum_k(x) as on the other
// paths. No activation rounding for int8 either: the result is the float32 reference's up to
// summation order. Compiled with the target attribute rather than -march, so it is in every x86
// build and chosen at run time (`set_quant_isa`, `__builtin_cpu_supports`).
//   int4: a 32-bit lane per column holds 8 nibbles (k = 2 pair + parity at bits 16 parity + 4 pair);
//     shift, mask, convert.
//   int8: a lane holds 4 consecutive k as v + 128; xor 0x80 gives v's bits, shifted up and back
//     down arithmetically to sign-extend each byte.
//   fp8: bytes (pair, column, parity); a pair's 16 bytes widened as 8 16-bit words, each parity
//     sign-extended, then the float32 bit trick of the AVX-512 path (exact, subnormals included).
//   mxfp4: int4's nibbles; the low 3 bits pick the magnitude from an 8-float table
//     (`vpermps`), bit 3 moved to the float's sign. The exponents become scales through a
//     256-float table (`vgatherdps`), once per group and 8 columns.

#ifdef SONAR_AVX2

// e8m0_half of every exponent byte, for the gather.
const std::array<float, 256> kE8m0Half = [] {
  std::array<float, 256> table{};
  for (int e = 0; e < 256; ++e) table[e] = e8m0_half(static_cast<uint8_t>(e));
  return table;
}();

// Value kk (0 .. k per line - 1) of the 8 columns of half `h` of a 64-byte line, as float32.
template <int FORMAT, int KK>
SONAR_AVX2_FN __m256 avx2_value(const uint8_t* line, int h) {
  if constexpr (FORMAT == kInt4) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * h));
    constexpr int shift = 16 * (KK % 2) + 4 * (KK / 2);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, shift), _mm256_set1_epi32(0xf)));
  } else if constexpr (FORMAT == kMxfp4) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * h));
    constexpr int shift = 16 * (KK % 2) + 4 * (KK / 2);
    const __m256i code = _mm256_srli_epi32(w, shift);  // vpermps reads the low 3 bits only
    const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 6, 8, 12), code);
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(code, 28), _mm256_set1_epi32(int32_t(0x80000000u)));
    return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
  } else if constexpr (FORMAT == kInt8) {
    const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * h)),
                                       _mm256_set1_epi32(int32_t(0x80808080u)));
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 24 - 8 * KK), 24));
  } else {
    const __m256i words =
        _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + (KK / 2) * 32 + h * 16)));
    const __m256i b = KK % 2 ? _mm256_srai_epi32(words, 8) : _mm256_srai_epi32(_mm256_slli_epi32(words, 24), 24);
    const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32(int32_t(0x87f00000u)));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
  }
}

// Independent accumulator chains per block (FMA latency x throughput ~ 8 in flight).
template <int ROWS, int TILES>
constexpr int kAvx2Split = ROWS * TILES * 2 >= 8 ? 1 : 8 / (ROWS * TILES * 2);

template <int FORMAT, int ROWS, int TILES, int SPLIT, int KK>
SONAR_AVX2_FN void avx2_step(const uint8_t* wl, int64_t tile_bytes, const float* xk, int64_t x_stride,
                             __m256 (&acc)[SPLIT][ROWS][2 * TILES]) {
  __m256 v[2 * TILES];
  for (int t = 0; t < TILES; ++t)
    for (int h = 0; h < 2; ++h) v[2 * t + h] = avx2_value<FORMAT, KK>(wl + t * tile_bytes, h);
  for (int r = 0; r < ROWS; ++r) {
    const __m256 xb = _mm256_broadcast_ss(xk + r * x_stride + KK);
    for (int j = 0; j < 2 * TILES; ++j) acc[KK % SPLIT][r][j] = _mm256_fmadd_ps(v[j], xb, acc[KK % SPLIT][r][j]);
  }
  if constexpr (KK + 1 < (FORMAT == kInt4 || FORMAT == kMxfp4 ? 8 : 4))
    avx2_step<FORMAT, ROWS, TILES, SPLIT, KK + 1>(wl, tile_bytes, xk, x_stride, acc);
}

// ROWS rows of x (float32, `x_stride` apart; `sums` their per-group sums, `groups` apart) against
// TILES tiles from `w`: out[r * 16 TILES + c] = the rows' dot products with the tiles' columns.
template <int FORMAT, int ROWS, int TILES>
SONAR_AVX2_FN void avx2_block(const float* x, int64_t x_stride, const float* sums, const uint8_t* w,
                              const QuantGeometry& geo, float* out) {
  constexpr int SPLIT = kAvx2Split<ROWS, TILES>, H = 2 * TILES;
  constexpr int64_t KL = FORMAT == kInt4 || FORMAT == kMxfp4 ? 8 : 4;
  const int64_t lines = geo.group / KL;
  __m256 total[ROWS][H];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < H; ++j) total[r][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < geo.groups; ++g) {
    const uint8_t* wg = w + g * geo.stride_g;
    __m256 acc[SPLIT][ROWS][H];
    for (int s = 0; s < SPLIT; ++s)
      for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < H; ++j) acc[s][r][j] = _mm256_setzero_ps();
    for (int64_t l = 0; l < lines; ++l) {
      for (int t = 0; t < TILES; ++t) _mm_prefetch(wg + t * geo.tile_bytes + l * 64 + 512, _MM_HINT_T0);
      avx2_step<FORMAT, ROWS, TILES, SPLIT, 0>(wg + l * 64, geo.tile_bytes, x + g * geo.group + l * KL, x_stride, acc);
    }
    for (int s = 1; s < SPLIT; ++s)
      for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < H; ++j) acc[0][r][j] = _mm256_add_ps(acc[0][r][j], acc[s][r][j]);
    for (int t = 0; t < TILES; ++t) {
      const uint8_t* meta_bytes = wg + t * geo.tile_bytes + geo.group_bytes;
      const float* meta = reinterpret_cast<const float*>(meta_bytes);
      for (int h = 0; h < 2; ++h) {
        __m256 scale;
        if constexpr (FORMAT == kMxfp4) {
          const __m128i e = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta_bytes + 8 * h));
          scale = _mm256_i32gather_ps(kE8m0Half.data(), _mm256_cvtepu8_epi32(e), 4);
        } else {
          scale = _mm256_loadu_ps(meta + 8 * h);
        }
        for (int r = 0; r < ROWS; ++r) total[r][2 * t + h] = _mm256_fmadd_ps(acc[0][r][2 * t + h], scale, total[r][2 * t + h]);
        if (geo.offsets) {
          const __m256 offset = _mm256_loadu_ps(meta + 16 + 8 * h);
          for (int r = 0; r < ROWS; ++r)
            total[r][2 * t + h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(sums[r * geo.groups + g]), total[r][2 * t + h]);
        }
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < H; ++j) _mm256_storeu_ps(out + r * 16 * TILES + 8 * j, total[r][j]);
}

// Per tile, rows are taken 4 at a time (the unpacked weights reused by 4 rows), the last 1-3 in one
// block; a lone row (a decode at batch 1) runs over two tiles at a time (8 accumulator chains).
constexpr int kAvx2Rows = 4;

// Tiles [begin, end) of `ws` against `rows` rows of x (float32, k apart; `sums` their per-group
// sums): y[r * y_stride + c] for the tiles' columns below `out_features`. One thread's share of
// linear_quant_avx2, and a work item of moe_quant.
template <int FORMAT>
__attribute__((target("avx2,fma"))) void avx2_tiles(const float* x, const float* sums, int64_t rows,
                                                   const uint8_t* ws, const QuantGeometry& geo, int64_t begin,
                                                   int64_t end, float* y, int64_t y_stride, int64_t out_features) {
  float out[kAvx2Rows * 32];
  const auto emit = [&](int64_t r0, int64_t nrows, int64_t t, int64_t tiles) {
    for (int64_t r = 0; r < nrows; ++r)
      for (int64_t c = 0; c < std::min<int64_t>(16 * tiles, out_features - t * 16); ++c)
        y[(r0 + r) * y_stride + t * 16 + c] = out[r * 16 * tiles + c];
  };
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* w = ws + t * geo.tile_bytes;
    int64_t r = 0;
    for (; r + kAvx2Rows <= rows; r += kAvx2Rows) {
      avx2_block<FORMAT, kAvx2Rows, 1>(x + r * geo.k, geo.k, sums + r * geo.groups, w, geo, out);
      emit(r, kAvx2Rows, t, 1);
    }
    const int64_t left = rows - r;
    const float* xr = x + r * geo.k;
    const float* sr = sums + r * geo.groups;
    if (rows == 1 && t + 1 < end) {  // a decode: two tiles at once
      avx2_block<FORMAT, 1, 2>(xr, geo.k, sr, w, geo, out);
      emit(r, 1, t, 2);
      ++t;
    } else if (left == 1) {
      avx2_block<FORMAT, 1, 1>(xr, geo.k, sr, w, geo, out);
      emit(r, 1, t, 1);
    } else if (left == 2) {
      avx2_block<FORMAT, 2, 1>(xr, geo.k, sr, w, geo, out);
      emit(r, 2, t, 1);
    } else if (left == 3) {
      avx2_block<FORMAT, 3, 1>(xr, geo.k, sr, w, geo, out);
      emit(r, 3, t, 1);
    }
  }
}

template <int FORMAT>
void linear_quant_avx2(const float* x, const float* sums, int64_t rows, const uint8_t* ws, const QuantGeometry& geo,
                       float* y, int64_t out_features) {
  at::parallel_for(0, geo.tiles, 1, [&](int64_t begin, int64_t end) {
    avx2_tiles<FORMAT>(x, sums, rows, ws, geo, begin, end, y, out_features, out_features);
  });
}

#endif

// y = x @ W.T (+ bias) over a packed quantized weight; `next` as in linear_bf16_then.
at::Tensor linear_quant_then(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                             int64_t format, int64_t out_features, int64_t group, bool offsets, const at::Tensor* next) {
  check_cpu(x, "x");
  check_cpu(packed, "packed");
  const QuantGeometry geo(packed, format, group, offsets);
  const bool is_float = x.scalar_type() == at::kFloat;
  TORCH_CHECK((is_float || x.scalar_type() == at::kBFloat16) && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) == geo.k,
              "sonar_cpu::linear_quant: contiguous bfloat16 or float32 x [M, ", geo.k, "]");
  TORCH_CHECK(out_features <= geo.tiles * 16 && out_features > (geo.tiles - 1) * 16,
              "sonar_cpu::linear_quant: ", out_features, " output features in ", geo.tiles, " tiles of 16");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == out_features,
                "sonar_cpu::linear_quant: a bias [N] of x's dtype");
  }
  const int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const QuantIsa isa = quant_isa_now();
#ifdef SONAR_AVX2
  if (isa == kAvx2 || (isa == kAvx512 && (is_float || format == kMxfp4))) {
    at::Tensor xf = is_float ? x : x.to(at::kFloat);
    const float* xs = data<const float>(xf);
    std::vector<float> sums = group_sums(xs, rows, geo.k, group);
    at::Tensor yf = is_float ? y : at::empty({rows, out_features}, x.options().dtype(at::kFloat));
    if (format == kInt4) linear_quant_avx2<kInt4>(xs, sums.data(), rows, data<const uint8_t>(packed), geo, data<float>(yf), out_features);
    else if (format == kInt8) linear_quant_avx2<kInt8>(xs, sums.data(), rows, data<const uint8_t>(packed), geo, data<float>(yf), out_features);
    else if (format == kMxfp4) linear_quant_avx2<kMxfp4>(xs, sums.data(), rows, data<const uint8_t>(packed), geo, data<float>(yf), out_features);
    else linear_quant_avx2<kFp8>(xs, sums.data(), rows, data<const uint8_t>(packed), geo, data<float>(yf), out_features);
    if (bias) yf.add_(*bias);
    if (!is_float) y.copy_(yf);
    return y;
  }
#endif
  const uint8_t* ws = data<const uint8_t>(packed);
  if (is_float) {
    const float* xs = data<const float>(x);
    std::vector<float> sums = group_sums(xs, rows, geo.k, group);
    const QuantX qx{reinterpret_cast<const int32_t*>(xs), geo.k, sums.data(), nullptr, geo.groups};
    linear_quant_portable<float>(qx, rows, ws, geo, bias ? data<const float>(*bias) : nullptr, data<float>(y),
                                 out_features);
    return y;
  }
  const Bf16* xb = data<const Bf16>(x);
  std::vector<float> sums, scales;
  std::vector<int32_t> xq;  // int8: the quantized x, 4 bytes per word
  QuantX xs{reinterpret_cast<const int32_t*>(xb), geo.k / 2, nullptr, nullptr, geo.groups};
  if (format != kInt8) {
    sums = group_sums(xb, rows, geo.k, group);
  } else {
    sums.resize(rows * geo.groups);
    scales.resize(rows * geo.groups);
    xq.resize(rows * geo.k / 4);
    quantize_rows(xb, rows, geo.k, group, reinterpret_cast<int8_t*>(xq.data()), sums.data(), scales.data());
    xs = {xq.data(), geo.k / 4, nullptr, scales.data(), geo.groups};
  }
  xs.sums = sums.data();
  const Bf16* bs = bias ? data<const Bf16>(*bias) : nullptr;
  Bf16* ys = data<Bf16>(y);
#ifdef SONAR_LINEAR_QUANT
  if (isa == kAvx512) {
    if (format == kInt4) linear_quant_avx512<kInt4>(xs, rows, ws, geo, bs, ys, out_features, next);
    else if (format == kInt8) linear_quant_avx512<kInt8>(xs, rows, ws, geo, bs, ys, out_features, next);
    else linear_quant_avx512<kFp8>(xs, rows, ws, geo, bs, ys, out_features, next);
    return y;
  }
#endif
  (void)next;
  linear_quant_portable<Bf16>(xs, rows, ws, geo, bs, ys, out_features);
  return y;
}

at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                        int64_t format, int64_t out_features, int64_t group, bool offsets) {
  return linear_quant_then(x, packed, bias, format, out_features, group, offsets, nullptr);
}

bool has_linear_quant() {
#ifdef SONAR_LINEAR_QUANT
  return true;
#else
  return false;
#endif
}

// --- batched LoRA adapters -----------------------------------------------------------------------
//
// y[i] += B[s] (A[s] x[i]) for each row i whose adapter slot s = rows[i] is not negative, for each
// sub-projection j of the layer (`splits`): its output columns off_j .. off_j + splits[j] take
// rows j R .. (j + 1) R of A[s] [J R, in] and the same columns' rows of B[s] [out, R] (ranks
// zero-padded to R, the scaling folded into B). The contract of sonar.kernels.reference.lora_add:
// the shrink t = A[s] x[i] accumulates in float32 and is rounded to the dtype, the expand
// accumulates in float32 and its sum with y is rounded once.
//
// Rows are grouped by slot first (a counting sort), so a slot's weights are read from memory once
// per call and from cache for its other rows, and slots no row uses are not read at all. The
// expand reads B in linear_bf16's packed layout (`lora_pack_b`: per tile of 16 output columns,
// lane c of pair p holds B[o + c, 2p] and B[o + c, 2p + 1]), which the adapter slots keep beside
// B, packed once when an adapter is written (`b_packed`; without it a call packs what it reads).
// bfloat16 with an even R on AVX512-BF16: the shrink runs 4 rows of x by 4 rows of A per register
// block, 32 k per `vdpbf16ps`, parallel over A's rows; the expand advances 16 columns of a row by
// two r per `vdpbf16ps`, parallel over the tiles. bfloat16 on AVX2 + FMA: the same blocks in
// float32 (x widened once per call; 4 rows of x by 2 rows of A, 8 k per FMA; the expand splits
// each packed pair into its two bfloat16 halves, 8 columns per FMA). Each thread prefetches the
// weights it will read first. Anything else (float32, float16, an odd R on AVX-512, a CPU without
// AVX2): plain loops over the rows, in parallel.

// The active rows, slot by slot: slot s's rows are order[starts[s] .. starts[s + 1]).
struct SlotRows {
  std::vector<int64_t> order, starts;

  int64_t slots() const { return static_cast<int64_t>(starts.size()) - 1; }
};

SlotRows group_by_slot(const at::Tensor& rows, int64_t slots) {
  const int64_t n = rows.size(0);
  const int64_t* slot = rows.data_ptr<int64_t>();
  SlotRows g;
  g.starts.assign(slots + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slot[i] < slots, "sonar_cpu::lora_add: row ", i, " names slot ", slot[i], " of ", slots);
    if (slot[i] >= 0) ++g.starts[slot[i] + 1];
  }
  for (int64_t s = 0; s < slots; ++s) g.starts[s + 1] += g.starts[s];
  g.order.resize(g.starts[slots]);
  std::vector<int64_t> next(g.starts.begin(), g.starts.end() - 1);
  for (int64_t i = 0; i < n; ++i)
    if (slot[i] >= 0) g.order[next[slot[i]]++] = i;
  return g;
}

struct LoraShape {
  int64_t in, out, rank, shrunk;  // shrunk: A's rows per slot, J R
  std::vector<int64_t> offsets;   // the sub-projections' first columns, then out
};

// The expand's tiles of 16 output columns, sub-projection by sub-projection (a tile never straddles
// two): each tile's sub-projection and first column.
struct LoraTiles {
  std::vector<int64_t> split, column;

  explicit LoraTiles(const std::vector<int64_t>& offsets) {
    for (size_t j = 0; j + 1 < offsets.size(); ++j)
      for (int64_t c = offsets[j]; c < offsets[j + 1]; c += 16) {
        split.push_back(static_cast<int64_t>(j));
        column.push_back(c);
      }
  }
  int64_t count() const { return static_cast<int64_t>(split.size()); }
};

std::vector<int64_t> lora_offsets(at::IntArrayRef splits, const char* op) {
  TORCH_CHECK(!splits.empty(), "sonar_cpu::", op, ": at least one sub-projection");
  std::vector<int64_t> offsets{0};
  for (const int64_t size : splits) {
    TORCH_CHECK(size > 0, "sonar_cpu::", op, ": sub-projections of positive sizes");
    offsets.push_back(offsets.back() + size);
  }
  return offsets;
}

// B [S, out, R] in the expand's layout, in tiles of 16 columns: float32 [S, tiles, R, 16] with
// element [s, t, r, c] = B[s, o + c, r] for tile t's first column o; bfloat16 as int32 pairs
// [S, tiles, ceil(R / 2), 16] with element [s, t, p, c] = B[s, o + c, 2p] | B[s, o + c, 2p + 1] << 16
// (linear_bf16's layout). Zero for columns past the tile's sub-projection and for r = R.
template <typename T>
void lora_pack_tiles(const T* src, uint32_t* dst, int64_t slots, int64_t out, int64_t rank,
                     const std::vector<int64_t>& offsets) {
  const LoraTiles tiles(offsets);
  constexpr bool kPairs = std::is_same_v<T, Bf16>;
  const int64_t steps = kPairs ? (rank + 1) / 2 : rank;
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t t = 0; t < tiles.count(); ++t) {
      const int64_t c0 = tiles.column[t], columns = std::min<int64_t>(16, offsets[tiles.split[t] + 1] - c0);
      for (int64_t p = 0; p < steps; ++p)
        for (int64_t c = 0; c < 16; ++c) {
          const T* row = src + (s * out + c0 + c) * rank;
          uint32_t word = 0;
          if constexpr (kPairs) {
            if (c < columns) word = row[2 * p] | (2 * p + 1 < rank ? uint32_t(row[2 * p + 1]) << 16 : 0u);
          } else if (c < columns) {
            std::memcpy(&word, row + p, sizeof word);
          }
          dst[((s * tiles.count() + t) * steps + p) * 16 + c] = word;
        }
    }
}

// The shape lora_pack_b gives B [slots, out, rank] of `dtype`.
std::vector<int64_t> lora_packed_shape(at::ScalarType dtype, int64_t slots, int64_t rank, const std::vector<int64_t>& offsets) {
  return {slots, LoraTiles(offsets).count(), dtype == at::kBFloat16 ? (rank + 1) / 2 : rank, 16};
}

at::Tensor lora_pack_b(const at::Tensor& b, at::IntArrayRef splits) {
  check_cpu(b, "b");
  const at::ScalarType dtype = b.scalar_type();
  TORCH_CHECK(b.dim() == 3 && b.is_contiguous() && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "sonar_cpu::lora_pack_b: a contiguous float32 or bfloat16 b [S, out, R]");
  const std::vector<int64_t> offsets = lora_offsets(splits, "lora_pack_b");
  TORCH_CHECK(b.size(1) == offsets.back(), "sonar_cpu::lora_pack_b: b [S, ", offsets.back(), ", R]");
  const int64_t slots = b.size(0), out = b.size(1), rank = b.size(2);
  at::Tensor packed = at::empty(lora_packed_shape(dtype, slots, rank, offsets), b.options().dtype(dtype == at::kFloat ? at::kFloat : at::kInt));
  if (dtype == at::kFloat) lora_pack_tiles(data<const float>(b), data<uint32_t>(packed), slots, out, rank, offsets);
  else lora_pack_tiles(data<const Bf16>(b), data<uint32_t>(packed), slots, out, rank, offsets);
  return packed;
}

template <typename T>
inline float dot_float(const T* __restrict w, const float* __restrict x, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += to_float(w[i]) * x[i];
  return acc;
}

// The grain for at::parallel_for over `units` units of `work` multiply-adds in all: as many threads
// as get kLoraThreadWork each, so a decode step's small layers run on the calling thread (waking
// the others costs more than their share of the work), and the units split evenly between them (a
// grain of units * kLoraThreadWork / work left one thread 14 of SmolLM2's 16 gate_up blocks).
constexpr int64_t kLoraThreadWork = 1 << 18;

int64_t lora_grain(int64_t units, int64_t work) {
  const int64_t threads = std::clamp<int64_t>(work / kLoraThreadWork, 1, at::get_num_threads());
  return std::max<int64_t>(1, (units + threads - 1) / threads);
}

template <typename T>
void lora_portable(T* y, const T* x, const T* a, const T* b, const SlotRows& g, const LoraShape& s) {
  const int64_t active = static_cast<int64_t>(g.order.size());
  std::vector<int64_t> slot_at(active);
  for (int64_t slot = 0; slot < g.slots(); ++slot)
    std::fill(slot_at.begin() + g.starts[slot], slot_at.begin() + g.starts[slot + 1], slot);
  const int64_t work = active * (s.shrunk * s.in + s.out * s.rank);
  at::parallel_for(0, active, lora_grain(active, work), [&](int64_t begin, int64_t end) {
    std::vector<float> xf(s.in), t(s.shrunk);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t row = g.order[p];
      const T* as = a + slot_at[p] * s.shrunk * s.in;
      const T* bs = b + slot_at[p] * s.out * s.rank;
      load_row(xf.data(), x + row * s.in, s.in);
      for (int64_t r = 0; r < s.shrunk; ++r) t[r] = to_float(from_float<T>(dot_float(as + r * s.in, xf.data(), s.in)));
      T* yr = y + row * s.out;
      for (size_t j = 0; j + 1 < s.offsets.size(); ++j)
        for (int64_t o = s.offsets[j]; o < s.offsets[j + 1]; ++o)
          yr[o] = from_float<T>(to_float(yr[o]) + dot_float(bs + o * s.rank, t.data() + j * s.rank, s.rank));
    }
  });
}

#ifdef SONAR_AVX2
constexpr int kLoraRows = 4;  // rows of x per register block (shrink and expand)
constexpr int64_t kLoraChunk = 32;  // the AVX2 shrink's positions per pass over a block of A rows

// Asks for `bytes` from `p` on (into L2) ahead of their use, while `budget` (bytes, shared by a
// thread's calls) lasts: a slot's weights are cold in a decode step (each layer's are read once per
// step) and the loops below would touch them a block at a time, one miss after another; a prefill
// with many slots would evict what it fetched before using it. Measured on SmolLM2's decode at 16
// rows, one thread, 30 layers' adapters: 12-22 ms without, 6 ms with.
constexpr int64_t kLoraPrefetchBytes = 512 << 10;

inline void prefetch_range(const void* p, int64_t bytes, int64_t& budget) {
  const char* c = static_cast<const char*>(p);
  bytes = std::min(bytes, budget);
  budget -= bytes;
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
}

// prefetch_range of `bytes` from `first + slot * stride` (elements of T) for each slot some
// position uses, within one kLoraPrefetchBytes budget: a work item's share of the slots' factors.
template <typename T>
inline void prefetch_slots(const T* first, int64_t stride, int64_t bytes, const SlotRows& g) {
  int64_t budget = kLoraPrefetchBytes;
  for (int64_t slot = 0; slot < g.slots(); ++slot)
    if (g.starts[slot] < g.starts[slot + 1]) prefetch_range(first + slot * stride, bytes, budget);
}

// at(p) for the kLoraRows positions from p0, the last one before `end` repeated past it (a short
// block computes that row again rather than branching; only valid rows are stored).
template <typename P, typename F>
inline void block_rows(const P** out, int64_t p0, int64_t end, F&& at) {
  for (int i = 0; i < kLoraRows; ++i) out[i] = at(std::min(p0 + i, end - 1));
}
// 8 elements widened to float32 (bfloat16: the high halves of float32s), and back (rounded as
// from_float<Bf16> rounds: to nearest even, NaN 0x7fc0).
SONAR_AVX2_FN __m256 avx2_load(const float* p) { return _mm256_loadu_ps(p); }
SONAR_AVX2_FN __m256 avx2_load(const Bf16* p) {
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}
SONAR_AVX2_FN void avx2_store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
SONAR_AVX2_FN void avx2_store(Bf16* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i bits = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  // packus keeps 128-bit lanes apart: quadwords 0 and 2 hold the 8 words in order
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(words));
}

SONAR_AVX2_FN float avx2_sum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// tf[p * t_stride + j 2P + r] = A[slot(p)][j R + r] . x[order[p]] rounded to T (as float32) for
// every active position p (xf: x's active rows widened, in the order of the positions).
template <typename T>
__attribute__((target("avx2,fma"))) void lora_shrink_avx2(const float* xf, const T* a, float* tf, int64_t t_stride,
                                                          const SlotRows& g, const LoraShape& s) {
  constexpr int W = 2;  // rows of A per register block: 4 x 2 accumulators, 8 FMAs in flight
  const int64_t in = s.in, body = in - in % 8, blocks = (s.shrunk + W - 1) / W, pairs = (s.rank + 1) / 2;
  const int64_t work = static_cast<int64_t>(g.order.size()) * s.shrunk * in;
  at::parallel_for(0, blocks, lora_grain(blocks, work), [&](int64_t begin, int64_t end) {
    const int64_t first_row = begin * W, rows = std::min(end * W, s.shrunk) - first_row;
    prefetch_slots(a + first_row * in, s.shrunk * in, rows * in * sizeof(T), g);
    for (int64_t slot = 0; slot < g.slots(); ++slot) {
      const int64_t from = g.starts[slot], to = g.starts[slot + 1];
      const T* as = a + slot * s.shrunk * in;
      // a prefill's positions in chunks, each read from L2 by every block of A rather than from
      // memory once per block
      for (int64_t c0 = from; c0 < to; c0 += kLoraChunk) {
        const int64_t c1 = std::min(to, c0 + kLoraChunk);
        for (int64_t wb = begin; wb < end; ++wb) {
          const int64_t r0 = wb * W, wrows = std::min<int64_t>(W, s.shrunk - r0);
          const T* w[W];
          for (int q = 0; q < W; ++q) w[q] = as + (r0 + std::min<int64_t>(q, wrows - 1)) * in;
          for (int64_t p0 = c0; p0 < c1; p0 += kLoraRows) {
            const float* xr[kLoraRows];
            block_rows(xr, p0, c1, [&](int64_t p) { return xf + p * in; });
            __m256 acc[kLoraRows][W];
            for (int i = 0; i < kLoraRows; ++i)
              for (int q = 0; q < W; ++q) acc[i][q] = _mm256_setzero_ps();
            for (int64_t k = 0; k < body; k += 8) {
              __m256 wv[W];
              for (int q = 0; q < W; ++q) wv[q] = avx2_load(w[q] + k);
              for (int i = 0; i < kLoraRows; ++i) {
                const __m256 xv = _mm256_loadu_ps(xr[i] + k);
                for (int q = 0; q < W; ++q) acc[i][q] = _mm256_fmadd_ps(wv[q], xv, acc[i][q]);
              }
            }
            for (int64_t i = 0; i < std::min<int64_t>(kLoraRows, c1 - p0); ++i)
              for (int64_t q = 0; q < wrows; ++q) {
                float sum = avx2_sum(acc[i][q]);
                for (int64_t k = body; k < in; ++k) sum += to_float(w[q][k]) * xr[i][k];
                const int64_t r = r0 + q, j = r / s.rank;
                tf[(p0 + i) * t_stride + j * 2 * pairs + r - j * s.rank] = to_float(from_float<T>(sum));
              }
          }
        }
      }
    }
  });
}

// y[order[p], o] += B[slot(p)][o] . t[p, j ..] for every active position p and column o, B packed
// (`lora_pack_b`), 2 x 8 columns by 4 rows per block. float32: 16 columns of one r per step;
// bfloat16: each int32 lane split into its two halves (the low one shifted up, the high one
// masked), two r per step.
template <typename T>
__attribute__((target("avx2,fma"))) void lora_expand_avx2(T* y, const float* tf, int64_t t_stride,
                                                          const uint32_t* packed, const SlotRows& g, const LoraShape& s) {
  constexpr bool kPairs = std::is_same_v<T, Bf16>;
  const LoraTiles tiles(s.offsets);
  const int64_t pairs = (s.rank + 1) / 2, count = tiles.count(), tile_words = (kPairs ? pairs : s.rank) * 16;
  const int64_t work = static_cast<int64_t>(g.order.size()) * s.out * s.rank;
  at::parallel_for(0, count, lora_grain(count, work), [&](int64_t begin, int64_t end) {
    prefetch_slots(packed + begin * tile_words, count * tile_words, (end - begin) * tile_words * 4, g);
    const __m256i high_half = _mm256_set1_epi32(int32_t(0xffff0000u));
    for (int64_t slot = 0; slot < g.slots(); ++slot) {
      const int64_t from = g.starts[slot], to = g.starts[slot + 1];
      for (int64_t tile = begin; tile < end && from < to; ++tile) {
        const int64_t j = tiles.split[tile], c0 = tiles.column[tile];
        const int64_t columns = std::min<int64_t>(16, s.offsets[j + 1] - c0);
        const uint32_t* w = packed + (slot * count + tile) * tile_words;
        for (int64_t p0 = from; p0 < to; p0 += kLoraRows) {
          const float* tr[kLoraRows];
          block_rows(tr, p0, to, [&](int64_t p) { return tf + p * t_stride + j * 2 * pairs; });
          __m256 acc[kLoraRows][2];
          for (int i = 0; i < kLoraRows; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
          if constexpr (kPairs) {
            for (int64_t p = 0; p < pairs; ++p) {
              __m256 low[2], high[2];
              for (int h = 0; h < 2; ++h) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 16 + 8 * h));
                low[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                high[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high_half));
              }
              for (int i = 0; i < kLoraRows; ++i) {
                const __m256 t0 = _mm256_set1_ps(tr[i][2 * p]), t1 = _mm256_set1_ps(tr[i][2 * p + 1]);
                for (int h = 0; h < 2; ++h)
                  acc[i][h] = _mm256_fmadd_ps(high[h], t1, _mm256_fmadd_ps(low[h], t0, acc[i][h]));
              }
            }
          } else {
            const float* wf = reinterpret_cast<const float*>(w);
            for (int64_t r = 0; r < s.rank; ++r) {
              const __m256 w0 = _mm256_loadu_ps(wf + r * 16), w1 = _mm256_loadu_ps(wf + r * 16 + 8);
              for (int i = 0; i < kLoraRows; ++i) {
                const __m256 tv = _mm256_set1_ps(tr[i][r]);
                acc[i][0] = _mm256_fmadd_ps(w0, tv, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(w1, tv, acc[i][1]);
              }
            }
          }
          for (int64_t i = 0; i < std::min<int64_t>(kLoraRows, to - p0); ++i) {
            T* yr = y + g.order[p0 + i] * s.out + c0;
            if (columns == 16) {
              for (int h = 0; h < 2; ++h) avx2_store(yr + 8 * h, _mm256_add_ps(avx2_load(yr + 8 * h), acc[i][h]));
            } else {
              float sums[16];
              _mm256_storeu_ps(sums, acc[i][0]);
              _mm256_storeu_ps(sums + 8, acc[i][1]);
              for (int64_t c = 0; c < columns; ++c) yr[c] = from_float<T>(to_float(yr[c]) + sums[c]);
            }
          }
        }
      }
    }
  });
}

// The AVX2 path of lora_add (float32 or bfloat16), B packed.
template <typename T>
void lora_avx2(T* y, const T* x, const T* a, const uint32_t* packed, const SlotRows& g, const LoraShape& s) {
  const int64_t active = static_cast<int64_t>(g.order.size());
  const int64_t t_stride = static_cast<int64_t>(s.offsets.size() - 1) * 2 * ((s.rank + 1) / 2);
  std::vector<float> xf(active * s.in), tf(active * t_stride, 0.f);  // tf's padding (an odd R) stays zero
  for (int64_t p = 0; p < active; ++p) load_row(xf.data() + p * s.in, x + g.order[p] * s.in, s.in);
  lora_shrink_avx2<T>(xf.data(), a, tf.data(), t_stride, g, s);
  lora_expand_avx2<T>(y, tf.data(), t_stride, packed, g, s);
}
#endif

#ifdef SONAR_LINEAR_BF16

// t[p, r] = bf16(A[slot(p)][r] . x[order[p]]) for every active position p.
void lora_shrink_bf16(const Bf16* x, const Bf16* a, Bf16* t, const SlotRows& g, const LoraShape& s) {
  constexpr int W = 4;  // rows of A per register block
  const int64_t in = s.in, blocks = (s.shrunk + W - 1) / W;
  const int64_t work = static_cast<int64_t>(g.order.size()) * s.shrunk * in;
  at::parallel_for(0, blocks, lora_grain(blocks, work), [&](int64_t begin, int64_t end) {
    const int64_t first_row = begin * W, rows = std::min(end * W, s.shrunk) - first_row;
    prefetch_slots(a + first_row * in, s.shrunk * in, rows * in * 2, g);
    for (int64_t slot = 0; slot < g.slots(); ++slot) {
      const int64_t from = g.starts[slot], to = g.starts[slot + 1];
      const Bf16* as = a + slot * s.shrunk * in;
      for (int64_t wb = begin; wb < end && from < to; ++wb) {
        const int64_t r0 = wb * W, wrows = std::min<int64_t>(W, s.shrunk - r0);
        const Bf16* w[W];
        for (int q = 0; q < W; ++q) w[q] = as + (r0 + std::min<int64_t>(q, wrows - 1)) * in;
        for (int64_t p0 = from; p0 < to; p0 += kLoraRows) {
          const Bf16* xr[kLoraRows];
          block_rows(xr, p0, to, [&](int64_t p) { return x + g.order[p] * in; });
          __m512 acc[kLoraRows][W];
          for (int i = 0; i < kLoraRows; ++i)
            for (int q = 0; q < W; ++q) acc[i][q] = _mm512_setzero_ps();
          for (int64_t k = 0; k < in; k += 32) {
            const __mmask32 mask = in - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (in - k)) - 1;
            __m512bh wv[W];
            for (int q = 0; q < W; ++q) wv[q] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[q] + k);
            for (int i = 0; i < kLoraRows; ++i) {
              const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xr[i] + k);
              for (int q = 0; q < W; ++q) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], wv[q], xv);
            }
          }
          for (int64_t i = 0; i < std::min<int64_t>(kLoraRows, to - p0); ++i)
            for (int64_t q = 0; q < wrows; ++q)
              t[(p0 + i) * s.shrunk + r0 + q] = from_float<Bf16>(_mm512_reduce_add_ps(acc[i][q]));
        }
      }
    }
  });
}

// linear_bf16's packing of 16 rows of B (`rows`: int32 pairs, `stride` apart, the first `columns`
// present, the others read as zeros): packed[p * 16 + c] = rows[c * stride + p], p < pairs. Eight
// pairs at a time, rows c and c + 8 side by side in one register: two 8 x 8 transposes at once.
// (Gathering each lane instead made the whole call ~1.5x slower on SmolLM2's gate_up at 16 rows.)
inline void pack_tile(const int32_t* rows, int64_t stride, int64_t columns, int64_t pairs, int32_t* packed) {
  const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int64_t p0 = 0; p0 < pairs; p0 += 8) {
    const int64_t width = std::min<int64_t>(8, pairs - p0);
    const __mmask8 mask = static_cast<__mmask8>((1u << width) - 1u);
    const auto row = [&](int64_t c) {
      return c < columns ? _mm256_maskz_loadu_epi32(mask, rows + c * stride + p0) : _mm256_setzero_si256();
    };
    __m512i z[8], t[8], u[8];
    for (int c = 0; c < 8; ++c) z[c] = _mm512_inserti64x4(_mm512_castsi256_si512(row(c)), row(c + 8), 1);
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {  // u[4 i + q]: pair q (low 128-bit lanes) and q + 4 (high) of four rows
      u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int q = 0; q < 4; ++q) {
      if (q < width) _mm512_storeu_si512(packed + (p0 + q) * 16, _mm512_permutex2var_epi64(u[q], low, u[q + 4]));
      if (q + 4 < width) _mm512_storeu_si512(packed + (p0 + q + 4) * 16, _mm512_permutex2var_epi64(u[q], high, u[q + 4]));
    }
  }
}

// y[order[p], o] += B[slot(p)][o] . t[p, j R ..] for every active position p and column o; B's
// tiles read from `prepacked` (`lora_pack_b`), or packed here per tile and slot when it is null.
void lora_expand_bf16(Bf16* y, const Bf16* t, const Bf16* b, const int32_t* prepacked, const SlotRows& g,
                      const LoraShape& s) {
  const LoraTiles tile_of(s.offsets);
  const int64_t pairs = s.rank / 2;
  const int64_t tiles = tile_of.count();
  const int64_t work = static_cast<int64_t>(g.order.size()) * s.out * s.rank;
  at::parallel_for(0, tiles, lora_grain(tiles, work), [&](int64_t begin, int64_t end) {
    std::vector<int32_t> packed(prepacked ? 0 : pairs * 16);
    const int64_t first_column = tile_of.column[begin];
    const int64_t span = (end < tiles ? tile_of.column[end] : s.out) - first_column;  // this thread's columns
    if (prepacked) prefetch_slots(prepacked + begin * pairs * 16, tiles * pairs * 16, (end - begin) * pairs * 64, g);
    else prefetch_slots(b + first_column * s.rank, s.out * s.rank, span * s.rank * 2, g);
    for (int64_t slot = 0; slot < g.slots(); ++slot) {
      const int64_t from = g.starts[slot], to = g.starts[slot + 1];
      const int32_t* bs = reinterpret_cast<const int32_t*>(b + slot * s.out * s.rank);
      for (int64_t tile = begin; tile < end && from < to; ++tile) {
        const int64_t j = tile_of.split[tile], c0 = tile_of.column[tile];
        const int64_t columns = std::min<int64_t>(16, s.offsets[j + 1] - c0);
        if (!prepacked) pack_tile(bs + c0 * pairs, pairs, columns, pairs, packed.data());
        const int32_t* w = prepacked ? prepacked + (slot * tiles + tile) * pairs * 16 : packed.data();
        for (int64_t p0 = from; p0 < to; p0 += kLoraRows) {
          const int32_t* tr[kLoraRows];
          block_rows(tr, p0, to,
                     [&](int64_t p) { return reinterpret_cast<const int32_t*>(t + p * s.shrunk + j * s.rank); });
          __m512 acc[kLoraRows];
          for (int i = 0; i < kLoraRows; ++i) acc[i] = _mm512_setzero_ps();
          for (int64_t p = 0; p < pairs; ++p) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + p * 16);
            for (int i = 0; i < kLoraRows; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], wv, (__m512bh)_mm512_set1_epi32(tr[i][p]));
          }
          for (int64_t i = 0; i < std::min<int64_t>(kLoraRows, to - p0); ++i) {
            Bf16* yr = y + g.order[p0 + i] * s.out + c0;
            storen(yr, _mm512_add_ps(loadn(yr, columns), acc[i]), columns);
          }
        }
      }
    }
  });
}
#endif

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& rows,
              at::IntArrayRef splits, const std::optional<at::Tensor>& b_packed) {
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&y), &x, &a, &b, &rows}) check_cpu(*t, "every tensor");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 3 && b.dim() == 3,
              "sonar_cpu::lora_add: x [n, in], y [n, out], a [S, J R, in] and b [S, out, R]");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && a.is_contiguous() && b.is_contiguous() && rows.is_contiguous(),
              "sonar_cpu::lora_add: contiguous tensors");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  b.scalar_type() == x.scalar_type(),
              "sonar_cpu::lora_add: y, x, a and b share one dtype");
  std::vector<int64_t> offsets = lora_offsets(splits, "lora_add");
  const int64_t n = x.size(0), in = x.size(1), parts = static_cast<int64_t>(splits.size());
  TORCH_CHECK(y.size(0) == n && y.size(1) == offsets.back(), "sonar_cpu::lora_add: y [", n, ", ", offsets.back(), "]");
  TORCH_CHECK(a.size(2) == in && a.size(1) > 0 && a.size(1) % parts == 0,
              "sonar_cpu::lora_add: a [S, ", parts, " R, ", in, "]");
  const int64_t rank = a.size(1) / parts;
  TORCH_CHECK(b.size(0) == a.size(0) && b.size(1) == offsets.back() && b.size(2) == rank,
              "sonar_cpu::lora_add: b [", a.size(0), ", ", offsets.back(), ", ", rank, "]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.size(0) == n,
              "sonar_cpu::lora_add: int64 rows [", n, "]");
  const bool packable = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat;
  if (b_packed) {
    const at::Tensor& p = *b_packed;
    check_cpu(p, "b_packed");
    TORCH_CHECK(packable && p.is_contiguous() &&
                    p.scalar_type() == (x.scalar_type() == at::kFloat ? at::kFloat : at::kInt) &&
                    p.sizes() == at::IntArrayRef(lora_packed_shape(x.scalar_type(), b.size(0), rank, offsets)),
                "sonar_cpu::lora_add: b_packed is lora_pack_b(b, splits) (float32 or bfloat16 b)");
  }
  const SlotRows groups = group_by_slot(rows, a.size(0));
  if (groups.order.empty()) return;
  const LoraShape shape{in, offsets.back(), rank, a.size(1), std::move(offsets)};
#ifdef SONAR_LINEAR_BF16
  if (x.scalar_type() == at::kBFloat16 && rank % 2 == 0) {
    std::vector<Bf16> t(groups.order.size() * shape.shrunk);
    lora_shrink_bf16(data<const Bf16>(x), data<const Bf16>(a), t.data(), groups, shape);
    lora_expand_bf16(data<Bf16>(y), t.data(), data<const Bf16>(b), b_packed ? data<const int32_t>(*b_packed) : nullptr,
                     groups, shape);
    return;
  }
#endif
#ifdef SONAR_AVX2
  if (packable && cpu_has_avx2()) {
    const at::Tensor packed = b_packed ? *b_packed : lora_pack_b(b, splits);
    if (x.scalar_type() == at::kFloat)
      lora_avx2(data<float>(y), data<const float>(x), data<const float>(a), data<const uint32_t>(packed), groups, shape);
    else
      lora_avx2(data<Bf16>(y), data<const Bf16>(x), data<const Bf16>(a), data<const uint32_t>(packed), groups, shape);
    return;
  }
#endif
  SONAR_DISPATCH(x.scalar_type(), "lora_add", [&] {
    lora_portable<scalar_t>(data<scalar_t>(y), data<const scalar_t>(x), data<const scalar_t>(a),
                            data<const scalar_t>(b), groups, shape);
  });
}

// --- a decode step's decoder layers in one call ------------------------------------------------
//
// The layer loop of sonar/models/decoder.py for a step whose rows are all decodes (one new token
// per sequence, row i is sequence i), calling the kernels above directly: the same kernels in the
// same order as the per-op path, so the same bits, without ~10 Python-level operator calls per
// layer (about 4 ms of a 28 ms step at batch 16 on 2 cores). Each linear layer is one tensor and a
// kind (`kinds`, four per layer: qkv, o, gate_up, down): a plain [N, K] matrix for `at::linear`,
// packed for `linear_bf16`, or packed for `linear_quant` in one of its formats (with `groups` its
// group size), so layers of different formats mix; biases are optional per kind of layer (empty
// lists: none). With `lora_rows` (each row's adapter slot), lora_add follows every linear layer
// whose entry of `lora_a` / `lora_b` (four per layer, as `kinds`) is not empty, as each LoRA
// layer of the per-op path does. Returns the final norm of the last hidden state.

// A linear layer's kind in `decode_layers`: plain, bf16 packed, or 2 + 2 * format + has_offsets.
enum LinearKind : int64_t { kPlain = 0, kPackedBf16 = 1, kQuantFirst = 2, kQuantLast = 9 };

struct AnyLinear {
  const at::Tensor* weight;
  int64_t kind, group;

  int64_t in_features() const {
    if (kind == kPlain) return weight->size(1);
    if (kind == kPackedBf16) return weight->size(1) * 2;
    return weight->size(1) * group;
  }
};

at::Tensor linear_any(const at::Tensor& x, const AnyLinear& w, const std::optional<at::Tensor>& bias,
                      int64_t out_features, const AnyLinear* next) {
  const at::Tensor* then = next != nullptr && next->kind != kPlain ? next->weight : nullptr;
  if (w.kind == kPlain) return at::linear(x, *w.weight, bias);
  if (w.kind == kPackedBf16) return linear_bf16_then(x, *w.weight, bias, out_features, then);
  const int64_t code = w.kind - kQuantFirst;
  return linear_quant_then(x, *w.weight, bias, code / 2, out_features, w.group, code % 2 == 1, then);
}

std::optional<at::Tensor> nth(const at::TensorList& list, size_t i) {
  return list.empty() ? std::nullopt : std::optional<at::Tensor>(list[i]);
}

at::Tensor decode_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList input_norms, at::TensorList qkv, at::TensorList qkv_bias, at::TensorList o,
                         at::TensorList o_bias, at::TensorList post_norms, at::TensorList gate_up,
                         at::TensorList mlp_bias, at::TensorList down, const at::Tensor& final_norm,
                         at::TensorList kv_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, at::IntArrayRef windows, int64_t num_heads, double eps,
                         double scale, at::IntArrayRef kinds, at::IntArrayRef groups, at::TensorList lora_a,
                         at::TensorList lora_b, const std::optional<at::Tensor>& lora_rows,
                         at::TensorList lora_b_packed) {
  const size_t layers = kv_caches.size();
  TORCH_CHECK(layers > 0 && input_norms.size() == layers && qkv.size() == layers && o.size() == layers &&
                  post_norms.size() == layers && gate_up.size() == layers && down.size() == layers &&
                  windows.size() == layers,
              "sonar_cpu::decode_layers: one entry per layer in every list");
  TORCH_CHECK(kinds.size() == 4 * layers && groups.size() == 4 * layers,
              "sonar_cpu::decode_layers: a kind and a group per linear layer (four per layer)");
  for (const int64_t kind : kinds)
    TORCH_CHECK(kind >= kPlain && kind <= kQuantLast, "sonar_cpu::decode_layers: unknown linear kind ", kind);
  TORCH_CHECK((qkv_bias.empty() || qkv_bias.size() == layers) && (o_bias.empty() || o_bias.size() == layers) &&
                  (mlp_bias.empty() || mlp_bias.size() == 2 * layers),
              "sonar_cpu::decode_layers: bias lists empty or one per layer (two for the MLP)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) == seq_lens.size(0),
              "sonar_cpu::decode_layers: contiguous x [seqs, hidden], one row per sequence");
  TORCH_CHECK(!lora_rows || (lora_a.size() == 4 * layers && lora_b.size() == 4 * layers),
              "sonar_cpu::decode_layers: with lora_rows, an A and a B per linear layer (four per layer)");
  TORCH_CHECK(lora_b_packed.empty() || lora_b_packed.size() == lora_b.size(),
              "sonar_cpu::decode_layers: lora_b_packed empty or one per entry of lora_b");
  std::vector<AnyLinear> linears;
  for (size_t l = 0; l < layers; ++l) {
    const at::Tensor* weights[4] = {&qkv[l], &o[l], &gate_up[l], &down[l]};
    for (size_t i = 0; i < 4; ++i) linears.push_back({weights[i], kinds[4 * l + i], groups[4 * l + i]});
  }
  const int64_t n = x.size(0), hidden = x.size(1);
  const int64_t kv_heads = kv_caches[0].size(3), head_dim = kv_caches[0].size(4);
  const int64_t q_size = num_heads * head_dim, kv_size = kv_heads * head_dim;
  const int64_t inter = linears[3].in_features();
  const at::Tensor no_rows = at::empty({0}, slot_mapping.options());
  // lora_add on the output `y` of linear layer i (of the four per layer) from its input `in`
  const auto lora = [&](at::Tensor& y, const at::Tensor& in, size_t i, at::IntArrayRef splits) {
    if (!lora_rows || lora_a[i].numel() == 0) return;
    const bool packed = !lora_b_packed.empty() && lora_b_packed[i].numel() > 0;
    lora_add(y, in, lora_a[i], lora_b[i], *lora_rows, splits, packed ? std::optional<at::Tensor>(lora_b_packed[i]) : std::nullopt);
  };
  at::Tensor h = rms_norm(x, input_norms[0], eps), residual = x, out = x;
  for (size_t l = 0; l < layers; ++l) {
    const AnyLinear* w = &linears[4 * l];
    if (l > 0) std::tie(h, residual) = fused_add_rms_norm(out, residual, input_norms[l], eps);
    at::Tensor proj = linear_any(h, w[0], nth(qkv_bias, l), q_size + 2 * kv_size, &w[1]);
    lora(proj, h, 4 * l, {q_size, kv_size, kv_size});
    const at::Tensor qk = rotary(proj.narrow(1, 0, q_size + kv_size).view({n, num_heads + kv_heads, head_dim}), cos, sin);
    const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, kv_heads);
    const at::Tensor v = proj.narrow(1, q_size + kv_size, kv_size).view({n, kv_heads, head_dim});
    write_kv_cache(k, v, kv_caches[l], slot_mapping);
    at::Tensor attn = at::empty(q.sizes(), q.options());
    decode_attention(attn, q, kv_caches[l], block_tables, seq_lens, no_rows, scale, windows[l], 0.0, std::nullopt);
    const at::Tensor attn_rows = attn.view({n, q_size});
    at::Tensor attended = linear_any(attn_rows, w[1], nth(o_bias, l), hidden, &w[2]);
    lora(attended, attn_rows, 4 * l + 1, {hidden});
    std::tie(h, residual) = fused_add_rms_norm(attended, residual, post_norms[l], eps);
    at::Tensor gate_up_out = linear_any(h, w[2], nth(mlp_bias, 2 * l), 2 * inter, &w[3]);
    lora(gate_up_out, h, 4 * l + 2, {inter, inter});
    const at::Tensor gated = silu_and_mul(gate_up_out);
    out = linear_any(gated, w[3], nth(mlp_bias, 2 * l + 1), hidden, l + 1 < layers ? &w[4] : nullptr);
    lora(out, gated, 4 * l + 3, {hidden});
  }
  return std::get<0>(fused_add_rms_norm(out, residual, final_norm, eps));
}

}  // namespace

TORCH_LIBRARY(sonar_cpu, m) {
  m.def("decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor rows, float scale, int window, float softcap=0.0, Tensor? sinks=None) -> ()");
  m.def("encoder_attention(Tensor q, Tensor k, Tensor v, Tensor starts, float scale) -> Tensor");
  m.def("has_encoder_attention() -> bool", &has_encoder_attention);
  m.def("prefill_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, Tensor seqs, float scale, int window, Tensor? sinks=None) -> ()");
  m.def("has_prefill_attention() -> bool", &has_prefill_attention);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("row_max(Tensor x) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("has_linear_bf16() -> bool", &has_linear_bf16);
  m.def("has_linear_amx() -> bool", &has_linear_amx);
  m.def("linear_amx_rows() -> int", &linear_amx_rows);
  m.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] input_norms, Tensor[] qkv, Tensor[] qkv_bias, "
        "Tensor[] o, Tensor[] o_bias, Tensor[] post_norms, Tensor[] gate_up, Tensor[] mlp_bias, Tensor[] down, "
        "Tensor final_norm, Tensor(a!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "int[] windows, int num_heads, float eps, float scale, int[] kinds, int[] groups, Tensor[] lora_a, "
        "Tensor[] lora_b, Tensor? lora_rows, Tensor[] lora_b_packed) -> Tensor");
  m.def("linear_quant(Tensor x, Tensor packed, Tensor? bias, int format, int out_features, int group, bool offsets) "
        "-> Tensor");
  m.def("has_linear_quant() -> bool", &has_linear_quant);
  m.def("quant_isa() -> str", &quant_isa);
  m.def("set_quant_isa(str name) -> ()", &set_quant_isa);
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor rows, int[] splits, Tensor? b_packed=None) -> ()");
  m.def("lora_pack_b(Tensor b, int[] splits) -> Tensor");
}

TORCH_LIBRARY_IMPL(sonar_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("encoder_attention", &encoder_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("row_max", &row_max);
  m.impl("rotary", &rotary);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_quant", &linear_quant);
  m.impl("decode_layers", &decode_layers);
  m.impl("lora_add", &lora_add);
  m.impl("lora_pack_b", &lora_pack_b);
}

// --- fused mixture of experts --------------------------------------------------------------------
//
// out[t] = sum_j weights[t, j] * w2[e] @ silu_and_mul(w13[e] @ x[t]) with e = ids[t, j] (GPT-OSS:
// biases after each product and the clamped SwiGLU for silu_and_mul), the
// contract of sonar.kernels.moe.fused_experts_reference: the (token, expert) pairs are
// counting-sorted by expert and their rows of x gathered, so each expert that has tokens runs its
// two GEMMs (at::mm, with its own threads) once over all of them; then every token sums its rows,
// weighted, in float32 and in expert order (the reference's order: bit for bit its sum of the same
// rows) and rounds once. An id of -1 (an expert another expert-parallel rank holds) is skipped: the
// pair adds nothing here, and the ranks' outputs sum to the whole layer's.

#include <ATen/ops/mm.h>

namespace {

// The active (token, expert) pairs counting-sorted by expert (id -1 skipped): expert e's rows are
// start[e] .. start[e + 1], each the pair's token in row_token, each pair's row in pair_row (-1:
// skipped); pairs of one expert keep token order.
struct MoePairs {
  std::vector<int64_t> start, row_token, pair_row;

  MoePairs(const int64_t* id, int64_t pairs, int64_t top_k, int64_t experts, const char* op) : start(experts + 1, 0) {
    for (int64_t p = 0; p < pairs; ++p) {
      TORCH_CHECK(id[p] >= -1 && id[p] < experts, op, ": expert id ", id[p], " outside [-1, ", experts, ")");
      if (id[p] >= 0) ++start[id[p] + 1];
    }
    for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    row_token.resize(start[experts]);
    pair_row.assign(pairs, -1);
    for (int64_t p = 0; p < pairs; ++p) {
      if (id[p] < 0) continue;
      const int64_t r = next[id[p]]++;
      row_token[r] = p / top_k;
      pair_row[p] = r;
    }
  }

  int64_t rows() const { return start.back(); }
};

template <typename T>
void moe_combine(at::Tensor& out, const at::Tensor& rows, const std::vector<int64_t>& pair_row, const float* weights,
                 const int64_t* ids, int64_t top_k) {
  const int64_t n = out.size(0), h = out.size(1);
  const T* ys = data<const T>(rows);
  T* os = data<T>(out);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(h);
    std::vector<int64_t> order(top_k);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t* chosen = ids + t * top_k;
      for (int64_t j = 0; j < top_k; ++j) order[j] = j;
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return chosen[a] < chosen[b]; });
      std::fill(acc.begin(), acc.end(), 0.f);
      for (const int64_t j : order) {
        if (chosen[j] < 0) continue;  // another rank's expert: no row here
        const float w = weights[t * top_k + j];
        const T* y = ys + pair_row[t * top_k + j] * h;
        for (int64_t i = 0; i < h; ++i) acc[i] += to_float(y[i]) * w;
      }
      T* dst = os + t * h;
      for (int64_t i = 0; i < h; ++i) dst[i] = from_float<T>(acc[i]);
    }
  });
}

// GPT-OSS's expert activation (sonar.kernels.reference.clamped_swiglu), op by op in the rows'
// dtype as transformers rounds it.
at::Tensor clamped_swiglu(const at::Tensor& gate_up, double limit, double alpha) {
  const int64_t inter = gate_up.size(1) / 2;
  const at::Tensor gate = gate_up.narrow(1, 0, inter).clamp_max(limit);
  const at::Tensor up = gate_up.narrow(1, inter, inter).clamp(-limit, limit);
  return up.add(1).mul(gate.mul(gate.mul(alpha).sigmoid()));
}

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const at::Tensor& w13,
                     const at::Tensor& w2, const std::optional<at::Tensor>& b13, const std::optional<at::Tensor>& b2,
                     std::optional<double> swiglu_limit, double swiglu_alpha) {
  for (const auto* t : {&x, &weights, &ids, &w13, &w2}) check_cpu(*t, "fused_moe input");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "sonar_cpu::fused_moe: contiguous x [n, h]");
  const int64_t n = x.size(0), h = x.size(1);
  TORCH_CHECK(w13.dim() == 3 && w13.is_contiguous() && w13.size(2) == h && w13.size(1) % 2 == 0 &&
                  w13.scalar_type() == x.scalar_type(),
              "sonar_cpu::fused_moe: contiguous w13 [E, 2 I, h] in x's dtype");
  const int64_t experts = w13.size(0), inter = w13.size(1) / 2;
  TORCH_CHECK(w2.dim() == 3 && w2.is_contiguous() && w2.size(0) == experts && w2.size(1) == h && w2.size(2) == inter &&
                  w2.scalar_type() == x.scalar_type(),
              "sonar_cpu::fused_moe: contiguous w2 [E, h, I] in x's dtype");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == n && ids.is_contiguous() && ids.scalar_type() == at::kLong,
              "sonar_cpu::fused_moe: contiguous int64 ids [n, top_k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.is_contiguous() && weights.scalar_type() == at::kFloat,
              "sonar_cpu::fused_moe: contiguous float32 weights [n, top_k]");
  TORCH_CHECK(!b13 || (b13->device().is_cpu() && b13->dim() == 2 && b13->size(0) == experts &&
                       b13->size(1) == 2 * inter && b13->scalar_type() == x.scalar_type()),
              "sonar_cpu::fused_moe: b13 [E, 2 I] in x's dtype");
  TORCH_CHECK(!b2 || (b2->device().is_cpu() && b2->dim() == 2 && b2->size(0) == experts && b2->size(1) == h &&
                      b2->scalar_type() == x.scalar_type()),
              "sonar_cpu::fused_moe: b2 [E, h] in x's dtype");
  const int64_t top_k = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  const MoePairs sorted(id, n * top_k, top_k, experts, "sonar_cpu::fused_moe");
  const std::vector<int64_t>&start = sorted.start, &row_token = sorted.row_token, &pair_row = sorted.pair_row;
  const int64_t local = sorted.rows();
  at::Tensor gathered = at::empty({local, h}, x.options());
  const int64_t row_bytes = h * x.element_size();
  const char* xs = static_cast<const char*>(x.data_ptr());
  char* gs = static_cast<char*>(gathered.data_ptr());
  at::parallel_for(0, local, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::memcpy(gs + r * row_bytes, xs + row_token[r] * row_bytes, row_bytes);
  });
  at::Tensor rows = at::empty({local, h}, x.options());
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = start[e + 1] - start[e];
    if (count == 0) continue;
    at::Tensor gate_up = at::mm(gathered.narrow(0, start[e], count), w13[e].t());
    if (b13) gate_up.add_((*b13)[e]);
    const at::Tensor act = swiglu_limit ? clamped_swiglu(gate_up, *swiglu_limit, swiglu_alpha) : silu_and_mul(gate_up);
    at::Tensor expert_rows = rows.narrow(0, start[e], count);
    at::mm_out(expert_rows, act, w2[e].t());
    if (b2) expert_rows.add_((*b2)[e]);
  }
  at::Tensor out = at::empty({n, h}, x.options());
  SONAR_DISPATCH(x.scalar_type(), "fused_moe", [&] {
    moe_combine<scalar_t>(out, rows, pair_row, weights.data_ptr<float>(), id, top_k);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sonar_cpu, m) {
  m.def("fused_moe(Tensor x, Tensor weights, Tensor ids, Tensor w13, Tensor w2, Tensor? b13=None, Tensor? b2=None, "
        "float? swiglu_limit=None, float swiglu_alpha=1.702) -> Tensor");
}

TORCH_LIBRARY_IMPL(sonar_cpu, CPU, m) { m.impl("fused_moe", &fused_moe); }

// --- quantized mixture of experts ----------------------------------------------------------------
//
// moe_quant: fused_moe's contract over quantized experts, every expert of a block packed as
// linear_quant reads it and stacked, one uint8 tensor per projection: w13 [E, tiles, G, B] (each
// expert's gate rows then its up rows, 2 I outputs over h inputs), w2 [E, tiles, G, B] (h outputs
// over I inputs); one format, group and offsets flag per projection, shared by its experts. In one
// call: the (token, expert) pairs counting-sorted by expert and their rows of x gathered, then per
// active expert its rows against its gate_up tiles, the activation, its rows against its down
// tiles, and every token's weighted sum in float32 in expert order, rounded once to x's dtype.
// Threads take (expert, run of tiles) work items, so an expert with one token and one with a
// hundred both spread over every core.
//
// Each projection runs the tile code linear_quant runs for x of this dtype on the path
// set_quant_isa chose (`MoePath`), its input formed as linear_quant forms x (`MoeRows`): on
// AVX-512, bfloat16 x, int4 / int8 / fp8 experts, the AVX-512 tiles (avx512_tiles: int8 experts
// quantize their rows to int8 per group, as quantize_rows does for linear_quant, and multiply with
// VNNI); mxfp4 experts and float32 x the AVX2 tiles (avx2_tiles, float32 rows) there as on AVX2;
// the portable loop's tiles (portable_tile, bfloat16 x in its int8-quantized form for int8) where
// it was chosen. A work item's run of tiles starts at a multiple of the tiles the path groups (4 on
// AVX-512, 2 on AVX2), so its blocks are those linear_quant computes on one thread. bfloat16 x is
// rounded where the per-expert path (sonar.models.moe.QuantizedExperts) rounds it: each product,
// each bias sum and the activation (silu_and_mul's row code; GPT-OSS's clamped SwiGLU op by op, as
// sonar.kernels.reference.clamped_swiglu). So on one thread the output is the per-expert path's bit
// for bit (tests/kernels/test_moe_quant.py), but for GPT-OSS's sigmoid (std::exp here, torch's
// vectorized exp there: the last bit); on more, where linear_quant's thread ranges do not start on
// such a multiple, its blocks and so its float32 summation order may differ.

namespace {

template <typename T>
inline float round_as(float v) {
  return to_float(from_float<T>(v));
}

// Per row and group of `rows` float32 rows (k apart): the group's sum, in linear_quant's order.
void row_group_sums(const float* x, int64_t begin, int64_t end, int64_t k, int64_t group, float* sums) {
  const int64_t groups = k / group;
  for (int64_t r = begin; r < end; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < group; ++i) s += x[r * k + g * group + i];
      sums[r * groups + g] = s;
    }
}

// The tile code one projection runs: linear_quant's path for x of the operator's dtype on the
// chosen ISA (AVX-512: bfloat16 x, int4 / int8 / fp8; mxfp4 and float32 x take the AVX2 tiles).
enum class MoePath { kPortable, kAvx2, kAvx512 };

MoePath moe_path(QuantIsa isa, bool bf16, int64_t format) {
#ifdef SONAR_LINEAR_QUANT
  if (isa == kAvx512 && bf16 && format != kMxfp4) return MoePath::kAvx512;
#endif
#ifdef SONAR_AVX2
  if (isa != kPortable) return MoePath::kAvx2;
#endif
  return MoePath::kPortable;
}

// One projection's input rows (the routed rows of x, or the activations), written as float32
// values into `f`, then `finish`ed into the form its path reads, as linear_quant forms x: float32
// rows and their group sums (the AVX2 tiles; the portable loop for float32 x), or for bfloat16 x
// on the AVX-512 tiles and the portable loop a QuantX: the rows as bfloat16 pairs and their group
// sums, or for int8 experts quantized to int8 per group (quantize_rows). The values in `f` are
// bfloat16 values there (x's, or rounded as the per-expert path rounds them), so the conversion is
// exact and the sums are linear_quant's.
struct MoeRows {
  const QuantGeometry& geo;
  bool bf16;  // the QuantX form
  std::vector<float> f, sums, scales;
  std::vector<int32_t> words;  // bfloat16 pairs, or int8 quads

  MoeRows(int64_t rows, const QuantGeometry& geo_, bool bf16_)
      : geo(geo_), bf16(bf16_), f(rows * geo.k), sums(rows * geo.groups) {
    if (!bf16) return;
    const bool int8 = geo.format == kInt8;
    words.resize(rows * geo.k / (int8 ? 4 : 2));
    if (int8) scales.resize(rows * geo.groups);
  }

  void finish(int64_t begin, int64_t end) {
    if (!bf16 || geo.format != kInt8) row_group_sums(f.data(), begin, end, geo.k, geo.group, sums.data());
    if (!bf16) return;
    std::vector<Bf16> row(geo.format == kInt8 ? geo.k : 0);
    for (int64_t r = begin; r < end; ++r) {
      Bf16* b = geo.format == kInt8 ? row.data() : reinterpret_cast<Bf16*>(words.data() + r * geo.k / 2);
      for (int64_t i = 0; i < geo.k; ++i) b[i] = from_float<Bf16>(f[r * geo.k + i]);
      if (geo.format == kInt8)
        quantize_rows(b, 1, geo.k, geo.group, reinterpret_cast<int8_t*>(words.data() + r * geo.k / 4),
                      sums.data() + r * geo.groups, scales.data() + r * geo.groups);
    }
  }

  // Rows from `first` on, as linear_quant's tile code reads them.
  QuantX from(int64_t first) const {
    const QuantX all = bf16 ? QuantX{words.data(), geo.k / (geo.format == kInt8 ? 4 : 2), sums.data(),
                                     scales.empty() ? nullptr : scales.data(), geo.groups}
                            : QuantX{reinterpret_cast<const int32_t*>(f.data()), geo.k, sums.data(), nullptr, geo.groups};
    return all.from(first);
  }
};

// Tiles [begin, end) of one expert's packed projection `w` against its rows of the input (`rows`
// from `first`): y[r * out_features + c], float32 (the AVX-512 tiles' bfloat16 outputs widened).
struct MoeTiles {
  MoePath path;
  std::vector<float> wf, out;
  std::vector<int32_t> wi, scratch;
  std::vector<Bf16> ob;

  void run(const MoeRows& in, int64_t first, int64_t rows, const uint8_t* w, const QuantGeometry& geo, int64_t begin,
           int64_t end, float* y, int64_t out_features) {
#ifdef SONAR_LINEAR_QUANT
    if (path == MoePath::kAvx512) {
      const int64_t width = (end - begin) * 16, columns = std::min(width, out_features - begin * 16);
      ob.resize(rows * width);
      const QuantX xs = in.from(first);
      if (geo.format == kInt4) avx512_tiles<kInt4>(xs, rows, w, geo, nullptr, begin, end, ob.data(), width, out_features, nullptr, scratch);
      else if (geo.format == kInt8) avx512_tiles<kInt8>(xs, rows, w, geo, nullptr, begin, end, ob.data(), width, out_features, nullptr, scratch);
      else avx512_tiles<kFp8>(xs, rows, w, geo, nullptr, begin, end, ob.data(), width, out_features, nullptr, scratch);
      for (int64_t r = 0; r < rows; ++r) load_row(y + r * out_features + begin * 16, ob.data() + r * width, columns);
      return;
    }
#endif
#ifdef SONAR_AVX2
    if (path == MoePath::kAvx2) {
      const float* x = in.f.data() + first * geo.k;
      const float* sums = in.sums.data() + first * geo.groups;
      if (geo.format == kInt4) avx2_tiles<kInt4>(x, sums, rows, w, geo, begin, end, y, out_features, out_features);
      else if (geo.format == kInt8) avx2_tiles<kInt8>(x, sums, rows, w, geo, begin, end, y, out_features, out_features);
      else if (geo.format == kMxfp4) avx2_tiles<kMxfp4>(x, sums, rows, w, geo, begin, end, y, out_features, out_features);
      else avx2_tiles<kFp8>(x, sums, rows, w, geo, begin, end, y, out_features, out_features);
      return;
    }
#endif
    wf.resize(geo.group * 16);
    wi.resize(geo.group * 16);
    out.resize(rows * 16);
    const QuantX xs = in.from(first);
    for (int64_t t = begin; t < end; ++t) {
      if (in.bf16) portable_tile<Bf16>(xs, rows, w + t * geo.tile_bytes, geo, wf.data(), wi.data(), out.data());
      else portable_tile<float>(xs, rows, w + t * geo.tile_bytes, geo, wf.data(), wi.data(), out.data());
      const int64_t columns = std::min<int64_t>(16, out_features - t * 16);
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(y + r * out_features + t * 16, out.data() + r * 16, columns * sizeof(float));
    }
  }
};

// One projection of every active expert: rows start[e] .. start[e + 1] of `in` through expert e's
// tiles, into y (out_features apart); work items of `chunk` tiles, a multiple of the tiles the path
// takes at a time from the first of a thread's range (AVX-512: kQuantTiles; AVX2: two, for a lone
// row), so each item's blocks are the ones linear_quant computes on one thread.
void moe_projection(const MoePairs& pairs, const MoeRows& in, const at::Tensor& w, const QuantGeometry& geo, float* y,
                    int64_t out_features, MoePath path) {
  const int64_t experts = w.size(0);
  const int64_t expert_bytes = geo.tiles * geo.tile_bytes;
  int64_t active = 0;
  for (int64_t e = 0; e < experts; ++e) active += pairs.start[e + 1] > pairs.start[e];
  // about four items per thread (uneven experts even out)
  const int64_t wanted = std::max<int64_t>(1, 4 * at::get_num_threads());
#ifdef SONAR_LINEAR_QUANT
  const int64_t align = path == MoePath::kAvx512 ? kQuantTiles : 2;
#else
  const int64_t align = 2;
#endif
  const int64_t chunk = std::clamp<int64_t>((active * geo.tiles + wanted - 1) / wanted, align, 16) / align * align;
  std::vector<std::pair<int64_t, int64_t>> items;  // (expert, first tile)
  for (int64_t e = 0; e < experts; ++e)
    if (pairs.start[e + 1] > pairs.start[e])
      for (int64_t t = 0; t < geo.tiles; t += chunk) items.emplace_back(e, t);
  const uint8_t* ws = data<const uint8_t>(w);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    MoeTiles tiles{path, {}, {}, {}, {}, {}};
    for (int64_t i = begin; i < end; ++i) {
      const auto [e, t] = items[i];
      const int64_t first = pairs.start[e], rows = pairs.start[e + 1] - first;
      tiles.run(in, first, rows, ws + e * expert_bytes, geo, t, std::min(t + chunk, geo.tiles),
                y + first * out_features, out_features);
    }
  });
}

// A bias [E, d] of float32 or bfloat16, read as float32 (absent: zero).
struct MoeBias {
  const void* data = nullptr;
  bool is_float = true;
  int64_t d = 0;

  float at(int64_t e, int64_t i) const {
    if (data == nullptr) return 0.f;
    return is_float ? static_cast<const float*>(data)[e * d + i] : to_float(static_cast<const Bf16*>(data)[e * d + i]);
  }
};

template <typename T>
void moe_quant_impl(at::Tensor& out, const at::Tensor& x, const float* weights, const int64_t* ids, int64_t top_k,
                    const MoePairs& pairs, const at::Tensor& w13, const QuantGeometry& geo13, const at::Tensor& w2,
                    const QuantGeometry& geo2, const MoeBias& b13, const MoeBias& b2,
                    std::optional<double> swiglu_limit, double swiglu_alpha, QuantIsa isa) {
  const int64_t n = x.size(0), h = x.size(1), inter = geo2.k, local = pairs.rows();
  std::vector<int64_t> row_expert(local);
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(pairs.start.size()); ++e)
    std::fill(row_expert.begin() + pairs.start[e], row_expert.begin() + pairs.start[e + 1], e);
  constexpr bool bf16 = std::is_same_v<T, Bf16>;
  const MoePath path13 = moe_path(isa, bf16, geo13.format), path2 = moe_path(isa, bf16, geo2.format);
  // the bfloat16 form where linear_quant takes bfloat16 x: the AVX-512 tiles, the portable loop
  const auto quant_x = [&](MoePath path) { return bf16 && path != MoePath::kAvx2; };
  // the routed rows of x
  MoeRows in13(local, geo13, quant_x(path13));
  const T* xs = data<const T>(x);
  at::parallel_for(0, local, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) load_row(in13.f.data() + r * h, xs + pairs.row_token[r] * h, h);
    in13.finish(begin, end);
  });
  std::vector<float> gate_up(local * 2 * inter);
  moe_projection(pairs, in13, w13, geo13, gate_up.data(), 2 * inter, path13);
  // the activation, rounded as the per-expert path rounds it, the down projection's input
  MoeRows in2(local, geo2, quant_x(path2));
  const float limit = swiglu_limit ? static_cast<float>(*swiglu_limit) : 0.f;
  const float alpha = static_cast<float>(swiglu_alpha);
  at::parallel_for(0, local, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t e = row_expert[r];
      float* gu = gate_up.data() + r * 2 * inter;
      float* a = in2.f.data() + r * inter;
      for (int64_t j = 0; j < 2 * inter; ++j) {
        gu[j] = round_as<T>(gu[j]);
        if (b13.data != nullptr) gu[j] = round_as<T>(gu[j] + b13.at(e, j));
      }
      if (!swiglu_limit) {
        silu_and_mul_row<T>(gu, gu + inter, a, inter);
        continue;
      }
      for (int64_t j = 0; j < inter; ++j) {
        const float g = std::min(gu[j], limit), u = std::clamp(gu[inter + j], -limit, limit);
        const float sig = round_as<T>(1.f / (1.f + std::exp(-round_as<T>(g * alpha))));
        a[j] = round_as<T>(round_as<T>(u + 1.f) * round_as<T>(g * sig));
      }
    }
    in2.finish(begin, end);
  });
  std::vector<float> y(local * h);
  moe_projection(pairs, in2, w2, geo2, y.data(), h, path2);
  // every token's rows, weighted, summed in float32 in expert order
  T* os = data<T>(out);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(h);
    std::vector<int64_t> order(top_k);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t* chosen = ids + t * top_k;
      for (int64_t j = 0; j < top_k; ++j) order[j] = j;
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return chosen[a] < chosen[b]; });
      std::fill(acc.begin(), acc.end(), 0.f);
      for (const int64_t j : order) {
        const int64_t r = pairs.pair_row[t * top_k + j];
        if (r < 0) continue;  // another rank's expert
        const float w = weights[t * top_k + j];
        const float* yr = y.data() + r * h;
        for (int64_t i = 0; i < h; ++i) {
          float v = round_as<T>(yr[i]);
          if (b2.data != nullptr) v = round_as<T>(v + b2.at(chosen[j], i));
          acc[i] += v * w;
        }
      }
      for (int64_t i = 0; i < h; ++i) os[t * h + i] = from_float<T>(acc[i]);
    }
  });
}

MoeBias moe_bias(const std::optional<at::Tensor>& b, int64_t experts, int64_t d, const at::Tensor& x,
                 const char* name) {
  if (!b) return {};
  TORCH_CHECK(b->device().is_cpu() && b->dim() == 2 && b->size(0) == experts && b->size(1) == d &&
                  b->is_contiguous() && (b->scalar_type() == at::kFloat || b->scalar_type() == x.scalar_type()),
              "sonar_cpu::moe_quant: ", name, " a contiguous [", experts, ", ", d, "] of float32 or x's dtype");
  return {b->data_ptr(), b->scalar_type() == at::kFloat, d};
}

at::Tensor moe_quant(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const at::Tensor& w13,
                     int64_t format13, int64_t group13, bool offsets13, const at::Tensor& w2, int64_t format2,
                     int64_t group2, bool offsets2, const std::optional<at::Tensor>& b13,
                     const std::optional<at::Tensor>& b2, std::optional<double> swiglu_limit, double swiglu_alpha) {
  for (const auto* t : {&x, &weights, &ids, &w13, &w2}) check_cpu(*t, "moe_quant input");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "sonar_cpu::moe_quant: contiguous bfloat16 or float32 x [n, h]");
  TORCH_CHECK(w13.dim() == 4 && w13.size(0) > 0 && w2.dim() == 4 && w2.size(0) == w13.size(0) &&
                  w13.is_contiguous() && w2.is_contiguous(),
              "sonar_cpu::moe_quant: contiguous packed experts w13, w2 [E, tiles, groups, bytes] of one E");
  const int64_t n = x.size(0), h = x.size(1), experts = w13.size(0);
  const QuantGeometry geo13(w13.select(0, 0), format13, group13, offsets13);
  const QuantGeometry geo2(w2.select(0, 0), format2, group2, offsets2);
  const int64_t inter = geo2.k;
  TORCH_CHECK(geo13.k == h, "sonar_cpu::moe_quant: w13 takes ", geo13.k, " inputs, x has ", h);
  TORCH_CHECK(2 * inter <= geo13.tiles * 16 && 2 * inter > (geo13.tiles - 1) * 16,
              "sonar_cpu::moe_quant: w13's ", geo13.tiles, " tiles of 16 do not hold 2 x ", inter, " outputs");
  TORCH_CHECK(h <= geo2.tiles * 16 && h > (geo2.tiles - 1) * 16, "sonar_cpu::moe_quant: w2's ", geo2.tiles,
              " tiles of 16 do not hold ", h, " outputs");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == n && ids.is_contiguous() && ids.scalar_type() == at::kLong,
              "sonar_cpu::moe_quant: contiguous int64 ids [n, top_k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.is_contiguous() && weights.scalar_type() == at::kFloat,
              "sonar_cpu::moe_quant: contiguous float32 weights [n, top_k]");
  const MoeBias bias13 = moe_bias(b13, experts, 2 * inter, x, "b13");
  const MoeBias bias2 = moe_bias(b2, experts, h, x, "b2");
  const int64_t top_k = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  const MoePairs pairs(id, n * top_k, top_k, experts, "sonar_cpu::moe_quant");
  const QuantIsa isa = quant_isa_now();
  at::Tensor out = at::empty({n, h}, x.options());
  if (x.scalar_type() == at::kFloat) {
    moe_quant_impl<float>(out, x, weights.data_ptr<float>(), id, top_k, pairs, w13, geo13, w2, geo2, bias13, bias2,
                          swiglu_limit, swiglu_alpha, isa);
  } else {
    moe_quant_impl<Bf16>(out, x, weights.data_ptr<float>(), id, top_k, pairs, w13, geo13, w2, geo2, bias13, bias2,
                         swiglu_limit, swiglu_alpha, isa);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sonar_cpu, m) {
  m.def("moe_quant(Tensor x, Tensor weights, Tensor ids, Tensor w13, int format13, int group13, bool offsets13, "
        "Tensor w2, int format2, int group2, bool offsets2, Tensor? b13=None, Tensor? b2=None, "
        "float? swiglu_limit=None, float swiglu_alpha=1.702) -> Tensor");
}

TORCH_LIBRARY_IMPL(sonar_cpu, CPU, m) { m.impl("moe_quant", &moe_quant); }
