// sgdfuse's native onnxruntime kernel for ai.sgdfuse::SGD (version 1).
//
// One loop over the elements reads parameters, gradient, accum and stat once and writes parameters_out,
// accum_out and stat_out once, computing the operator contract (docs/contract.md, sgdfuse/reference.py):
//
//   grad    = gradient + parameters * wd          if wd != 0, else gradient
//   accum_t = accum * m + grad
//   if d != 0:  accum_t = accum_t - grad * (1 - stat) * d
//   p_out   = parameters - (grad + accum_t * m) * lr    if nesterov
//           = parameters - accum_t * lr                  otherwise
//   if m != 0:  accum_out = accum_t, stat_out = +0
//   else:       accum_out = accum, stat_out = stat (bit for bit)
//
// Every intermediate is FLOAT, one rounding per operation in the order written (build with
// -ffp-contract=off and without -ffast-math, so the compiler neither fuses a multiply-add nor reorders;
// vectorising an elementwise loop changes no rounding),
// and FLOAT16/BFLOAT16 results are rounded back to nearest, ties to even. NaN payloads are not part of the
// contract; a NaN stays a (quiet) NaN.
//
// Only the C API (onnxruntime_c_api.h) is used, and only what API version 16 (onnxruntime 1.16) has, so one
// build loads into any onnxruntime from 1.16 on. The header comes from a registry package at build time
// (sgdfuse/ortkernel/__init__.py); it is not part of this repository.

#include <onnxruntime_c_api.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SGDFUSE_F16C 1  // x86-64: SSE always, AVX and F16C when the CPU has them (checked at run time)
#endif

namespace {

constexpr uint32_t kApiVersion = 16;  // CreateKernelV2 / KernelComputeV2 (error status from a kernel)
constexpr const char* kDomain = "ai.sgdfuse";
constexpr const char* kOpType = "SGD";
constexpr size_t kInputs = 6;   // parameters, gradient, learning_rate, accum, momentum, stat
constexpr size_t kOutputs = 3;  // parameters_out, accum_out, stat_out

const OrtApi* g_api = nullptr;

// --- element conversions (FLOAT intermediates) -----------------------------------------------------------

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// Each element type: how it is stored, the type its arithmetic is done in, and the conversions.
struct F32 {
  using Storage = float;
  using Compute = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};

// DOUBLE is not a contract dtype: it is what sgdfuse.lift makes of a model to compare coefficients without
// FLOAT rounding, and the lifted function body computes the formula in DOUBLE with the FLOAT attributes
// taken exactly as stored. The kernel does the same, so a lifted fused model runs with it registered.
struct F64 {
  using Storage = double;
  using Compute = double;
  static double load(double x) { return x; }
  static double store(double x) { return x; }
};

// IEEE binary16. Widening is exact; narrowing rounds to nearest, ties to even, overflowing to Inf.
// Written without branches (every case computed, the right one selected) so the loop vectorises.
struct F16 {
  using Storage = uint16_t;
  using Compute = float;
  static float load(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t magnitude = h & 0x7FFFu;
    // Normal: move exponent and mantissa into place and rebias the exponent (15 -> 127); Inf and NaN get
    // the rebias twice, which takes exponent 31 to FLOAT's 255.
    uint32_t u = (magnitude << 13) + ((127u - 15u) << 23);
    u = magnitude >= 0x7C00u ? u + ((127u - 15u) << 23) : u;
    // Zero or subnormal: mantissa * 2^-24, exact in FLOAT.
    const float subnormal = static_cast<float>(static_cast<int32_t>(magnitude)) * 0x1p-24f;
    u = magnitude < 0x0400u ? bits_of(subnormal) : u;
    return float_of(u | sign);
  }
  static uint16_t store(float x) {
    const uint32_t u = bits_of(x);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t magnitude = u & 0x7FFFFFFFu;
    // Below the smallest normal (2^-14) the result is a multiple of 2^-24. Adding 0.5 puts |x| where
    // FLOAT's spacing is exactly 2^-24, so the FPU's own round-to-nearest-even does the rounding; the bits
    // above 0.5's are the subnormal mantissa (0x400 when it rounds up to the smallest normal).
    const uint32_t subnormal = bits_of(float_of(magnitude) + 0.5f) - bits_of(0.5f);
    // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even; a carry out of
    // the mantissa moves to the next binade (and from 65504 up to Inf), as rounding should.
    const uint32_t normal = (magnitude - ((127u - 15u) << 23) + 0x0FFFu + ((magnitude >> 13) & 1u)) >> 13;
    uint32_t r = magnitude < 0x38800000u ? subnormal : normal;
    r = magnitude >= 0x47800000u ? 0x7C00u : r;  // |x| >= 65536 or Inf: Inf
    r = magnitude > 0x7F800000u ? (0x7E00u | ((magnitude >> 13) & 0x3FFu)) : r;  // NaN stays a (quiet) NaN
    return static_cast<uint16_t>(sign | r);
  }
};

// bfloat16: the upper half of a FLOAT. Narrowing rounds to nearest, ties to even, overflowing to Inf.
struct BF16 {
  using Storage = uint16_t;
  using Compute = float;
  static float load(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }
  static uint16_t store(float x) {
    const uint32_t u = bits_of(x);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x0040u;  // NaN stays a (quiet) NaN
    return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
  }
};

// --- the update ------------------------------------------------------------------------------------------

struct Attributes {
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};

// The contract's clauses are decided once per call (the attributes and the momentum are the same for
// every element), so each instantiation is one straight loop the compiler can vectorise without changing
// a single rounding (elementwise, no reassociation).
//
// No pointer is declared __restrict__: an output may be its own input (in place, bound with IOBinding), and
// restrict would let the compiler move the store of stat_out's zero before the load of stat that dampening
// reads. Element i reads only inputs at i and writes only outputs at i, so the loop has no dependence
// between iterations (GCC ivdep), and every load of an iteration comes before its stores. Any other overlap
// of outputs and inputs is resolved before the loops run (compute_with).
template <typename T, bool kWeightDecay, bool kDampening, bool kNesterov, bool kWriteState>
void update_portable(size_t n, const typename T::Storage* p, const typename T::Storage* g,
            const typename T::Storage* a, const typename T::Storage* s, typename T::Compute lr,
            typename T::Compute m, typename T::Compute d, typename T::Compute wd, typename T::Storage* p_out, typename T::Storage* a_out,
            typename T::Storage* s_out) {
#pragma GCC ivdep
  for (size_t i = 0; i < n; ++i) {
    using C = typename T::Compute;
    const C pf = T::load(p[i]);
    const C gf = T::load(g[i]);
    const C af = T::load(a[i]);
    C grad = gf;
    if (kWeightDecay) grad = gf + pf * wd;
    C accum_t = af * m + grad;
    if (kDampening) {
      const C one_minus_s = C(1) - T::load(s[i]);
      accum_t = accum_t - grad * one_minus_s * d;
    }
    C result;
    if (kNesterov) {
      result = pf - (grad + accum_t * m) * lr;
    } else {
      result = pf - accum_t * lr;
    }
    p_out[i] = T::store(result);
    if (kWriteState) {
      a_out[i] = T::store(accum_t);
      s_out[i] = typename T::Storage{};  // +0
    }
  }
}

#ifdef SGDFUSE_F16C
// FLOAT16 on x86 CPUs with F16C: eight elements at a time, converted by the hardware (exact widening;
// narrowing with round-to-nearest-even, as the portable F16::store), the arithmetic the same FLOAT
// operations in the same order as update_portable (AVX add/sub/mul round each result once; no FMA is
// enabled here). Returns how many elements it did; update_portable does the rest.
template <bool kWeightDecay, bool kDampening, bool kNesterov, bool kWriteState>
__attribute__((target("avx,f16c"))) size_t update_f16c(size_t n, const uint16_t* p,
                                                        const uint16_t* g,
                                                        const uint16_t* a,
                                                        const uint16_t* s, float lr, float m, float d,
                                                        float wd, uint16_t* p_out,
                                                        uint16_t* a_out, uint16_t* s_out) {
  const __m256 vlr = _mm256_set1_ps(lr), vm = _mm256_set1_ps(m), vd = _mm256_set1_ps(d);
  const __m256 vwd = _mm256_set1_ps(wd), one = _mm256_set1_ps(1.0f);
  const __m128i zero = _mm_setzero_si128();
// (Macros, not lambdas: a lambda would not inherit this function's target attribute.)
#define SGDFUSE_LOAD(x) _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)))
#define SGDFUSE_STORE(x, v) \
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_cvtps_ph((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 pf = SGDFUSE_LOAD(p + i);
    const __m256 gf = SGDFUSE_LOAD(g + i);
    const __m256 af = SGDFUSE_LOAD(a + i);
    __m256 grad = gf;
    if (kWeightDecay) grad = _mm256_add_ps(gf, _mm256_mul_ps(pf, vwd));
    __m256 accum_t = _mm256_add_ps(_mm256_mul_ps(af, vm), grad);
    if (kDampening) {
      const __m256 one_minus_s = _mm256_sub_ps(one, SGDFUSE_LOAD(s + i));
      accum_t = _mm256_sub_ps(accum_t, _mm256_mul_ps(_mm256_mul_ps(grad, one_minus_s), vd));
    }
    __m256 result;
    if (kNesterov) {
      result = _mm256_sub_ps(pf, _mm256_mul_ps(_mm256_add_ps(grad, _mm256_mul_ps(accum_t, vm)), vlr));
    } else {
      result = _mm256_sub_ps(pf, _mm256_mul_ps(accum_t, vlr));
    }
    SGDFUSE_STORE(p_out + i, result);
    if (kWriteState) {
      SGDFUSE_STORE(a_out + i, accum_t);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(s_out + i), zero);
    }
  }
#undef SGDFUSE_LOAD
#undef SGDFUSE_STORE
  return i;
}

bool has_f16c() {
  static const bool supported = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return supported;
}
#endif

#ifdef SGDFUSE_F16C
// FLOAT tensors larger than the caches, on x86 (SSE, part of every x86-64 CPU): the same operations four
// elements at a time, the results written with non-temporal stores. A plain store to memory that is not in
// the cache reads the line first; a streaming store does not, so the three results cost three passes over
// memory instead of six. Only when every output is 16-byte aligned (onnxruntime's allocations are); returns
// how many elements it did.
constexpr size_t kStreamMinElements = size_t{1} << 18;  // 1 MiB per FLOAT tensor

template <bool kWeightDecay, bool kDampening, bool kNesterov>
size_t update_f32_stream(size_t n, const float* p, const float* g,
                         const float* a, const float* s, float lr, float m, float d,
                         float wd, float* p_out, float* a_out, float* s_out) {
  const auto misaligned = (reinterpret_cast<uintptr_t>(p_out) | reinterpret_cast<uintptr_t>(a_out) |
                           reinterpret_cast<uintptr_t>(s_out)) & 15u;
  if (n < kStreamMinElements || misaligned != 0) return 0;
  const __m128 vlr = _mm_set1_ps(lr), vm = _mm_set1_ps(m), vd = _mm_set1_ps(d);
  const __m128 vwd = _mm_set1_ps(wd), one = _mm_set1_ps(1.0f), zero = _mm_setzero_ps();
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m128 pf = _mm_loadu_ps(p + i);
    const __m128 gf = _mm_loadu_ps(g + i);
    const __m128 af = _mm_loadu_ps(a + i);
    __m128 grad = gf;
    if (kWeightDecay) grad = _mm_add_ps(gf, _mm_mul_ps(pf, vwd));
    __m128 accum_t = _mm_add_ps(_mm_mul_ps(af, vm), grad);
    if (kDampening) {
      const __m128 one_minus_s = _mm_sub_ps(one, _mm_loadu_ps(s + i));
      accum_t = _mm_sub_ps(accum_t, _mm_mul_ps(_mm_mul_ps(grad, one_minus_s), vd));
    }
    __m128 result;
    if (kNesterov) {
      result = _mm_sub_ps(pf, _mm_mul_ps(_mm_add_ps(grad, _mm_mul_ps(accum_t, vm)), vlr));
    } else {
      result = _mm_sub_ps(pf, _mm_mul_ps(accum_t, vlr));
    }
    _mm_stream_ps(p_out + i, result);
    _mm_stream_ps(a_out + i, accum_t);
    _mm_stream_ps(s_out + i, zero);
  }
  _mm_sfence();  // the streamed results are visible before onnxruntime hands them on
  return i;
}
#endif

template <typename T, bool kWeightDecay, bool kDampening, bool kNesterov, bool kWriteState>
void update(size_t n, const typename T::Storage* p, const typename T::Storage* g, const typename T::Storage* a,
            const typename T::Storage* s, typename T::Compute lr, typename T::Compute m, typename T::Compute d,
            typename T::Compute wd, typename T::Storage* p_out,
            typename T::Storage* a_out, typename T::Storage* s_out) {
  size_t done = 0;
#ifdef SGDFUSE_F16C
  if constexpr (std::is_same_v<T, F16>) {
    if (has_f16c()) {
      done = update_f16c<kWeightDecay, kDampening, kNesterov, kWriteState>(n, p, g, a, s, lr, m, d, wd, p_out,
                                                                           a_out, s_out);
    }
  }
  if constexpr (std::is_same_v<T, F32> && kWriteState) {
    done = update_f32_stream<kWeightDecay, kDampening, kNesterov>(n, p, g, a, s, lr, m, d, wd, p_out, a_out, s_out);
  }
#endif
  update_portable<T, kWeightDecay, kDampening, kNesterov, kWriteState>(
      n - done, p + done, g + done, a + done, s + done, lr, m, d, wd, p_out + done, a_out + done, s_out + done);
}

template <typename T, bool kWeightDecay, bool kDampening, bool kNesterov>
void dispatch_state(bool write_state, size_t n, const typename T::Storage* p, const typename T::Storage* g,
                    const typename T::Storage* a, const typename T::Storage* s, typename T::Compute lr,
                    typename T::Compute m, typename T::Compute d, typename T::Compute wd, typename T::Storage* p_out, typename T::Storage* a_out,
                    typename T::Storage* s_out) {
  if (write_state) {
    update<T, kWeightDecay, kDampening, kNesterov, true>(n, p, g, a, s, lr, m, d, wd, p_out, a_out, s_out);
  } else {
    update<T, kWeightDecay, kDampening, kNesterov, false>(n, p, g, a, s, lr, m, d, wd, p_out, a_out, s_out);
    // Momentum zero: the contract keeps accum and stat as given, bit for bit (nothing to copy in place).
    if (a_out != a) std::memcpy(a_out, a, n * sizeof(typename T::Storage));
    if (s_out != s) std::memcpy(s_out, s, n * sizeof(typename T::Storage));
  }
}

template <typename T>
void run_update(const Attributes& attr, size_t n, const void* p, const void* g, const void* a, const void* s,
                double lr_in, double m_in, void* p_out, void* a_out, void* s_out) {
  using S = typename T::Storage;
  const auto* pp = static_cast<const S*>(p);
  const auto* gg = static_cast<const S*>(g);
  const auto* aa = static_cast<const S*>(a);
  const auto* ss = static_cast<const S*>(s);
  auto* po = static_cast<S*>(p_out);
  auto* ao = static_cast<S*>(a_out);
  auto* so = static_cast<S*>(s_out);
  // "!= 0" as the contract writes it: -0 is zero, NaN is not.
  const bool wd_on = attr.weight_decay != 0.0f;
  const bool d_on = attr.dampening != 0.0f;
  using C = typename T::Compute;
  const C lr = static_cast<C>(lr_in), m = static_cast<C>(m_in);  // exact: the input's own value
  const C d = attr.dampening, wd = attr.weight_decay;  // FLOAT attributes, exact in DOUBLE too
  const bool write_state = m != C(0);
#define SGDFUSE_CASE(WD, D, N) \
  dispatch_state<T, WD, D, N>(write_state, n, pp, gg, aa, ss, lr, m, d, wd, po, ao, so)
  if (attr.nesterov) {
    // nesterov with dampening is refused by the contract; computed as written all the same.
    if (wd_on) {
      if (d_on) SGDFUSE_CASE(true, true, true); else SGDFUSE_CASE(true, false, true);
    } else {
      if (d_on) SGDFUSE_CASE(false, true, true); else SGDFUSE_CASE(false, false, true);
    }
  } else {
    if (wd_on) {
      if (d_on) SGDFUSE_CASE(true, true, false); else SGDFUSE_CASE(true, false, false);
    } else {
      if (d_on) SGDFUSE_CASE(false, true, false); else SGDFUSE_CASE(false, false, false);
    }
  }
#undef SGDFUSE_CASE
}

// --- onnxruntime glue ------------------------------------------------------------------------------------

struct Kernel {
  Attributes attributes;
  ONNXTensorElementDataType type;
};

// One OrtCustomOp per element type: onnxruntime picks the kernel whose type constraints match the node.
struct SgdOp : OrtCustomOp {
  ONNXTensorElementDataType type;
};

OrtStatus* status(const std::string& message) {
  return g_api->CreateStatus(ORT_INVALID_ARGUMENT, ("ai.sgdfuse::SGD: " + message).c_str());
}

#define SGDFUSE_RETURN_IF_ERROR(expr) \
  do {                                \
    OrtStatus* _status = (expr);      \
    if (_status != nullptr) return _status; \
  } while (0)

// An attribute the node does not carry takes the contract's default (0 / false).
float float_attribute(const OrtKernelInfo* info, const char* name) {
  float value = 0.0f;
  OrtStatus* st = g_api->KernelInfoGetAttribute_float(info, name, &value);
  if (st != nullptr) {
    g_api->ReleaseStatus(st);
    return 0.0f;
  }
  return value;
}

int64_t int_attribute(const OrtKernelInfo* info, const char* name) {
  int64_t value = 0;
  OrtStatus* st = g_api->KernelInfoGetAttribute_int64(info, name, &value);
  if (st != nullptr) {
    g_api->ReleaseStatus(st);
    return 0;
  }
  return value;
}

OrtStatus* ORT_API_CALL create_kernel(const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info,
                                      void** kernel) {
  auto* k = new Kernel;
  k->type = static_cast<const SgdOp*>(op)->type;
  k->attributes.dampening = float_attribute(info, "dampening");
  k->attributes.weight_decay = float_attribute(info, "weight_decay");
  k->attributes.nesterov = int_attribute(info, "nesterov") != 0;
  *kernel = k;
  return nullptr;
}

struct TensorView {
  const void* data = nullptr;
  size_t count = 0;
  std::string shape_text;
  OrtTensorTypeAndShapeInfo* info = nullptr;
};

// Element count and data of input ``index``; ``info`` is kept for outputs of the same shape.
OrtStatus* read_input(OrtKernelContext* context, size_t index, TensorView* view) {
  const OrtValue* value = nullptr;
  SGDFUSE_RETURN_IF_ERROR(g_api->KernelContext_GetInput(context, index, &value));
  SGDFUSE_RETURN_IF_ERROR(g_api->GetTensorTypeAndShape(value, &view->info));
  SGDFUSE_RETURN_IF_ERROR(g_api->GetTensorShapeElementCount(view->info, &view->count));
  SGDFUSE_RETURN_IF_ERROR(g_api->GetTensorData(value, &view->data));
  return nullptr;
}

OrtStatus* shape_of(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t* rank) {
  SGDFUSE_RETURN_IF_ERROR(g_api->GetDimensionsCount(info, rank));
  if (*rank > 16) return status("rank above 16");
  return g_api->GetDimensions(info, dims, *rank);
}

// The one element of learning_rate or momentum, exactly (DOUBLE holds every value of the other types).
double scalar_value(ONNXTensorElementDataType type, const void* data) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
      return F16::load(*static_cast<const uint16_t*>(data));
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      return BF16::load(*static_cast<const uint16_t*>(data));
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
      return *static_cast<const double*>(data);
    default:
      return *static_cast<const float*>(data);
  }
}

// Bytes per element of the kernel's storage types.
size_t element_size(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      return 2;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
      return 8;
    default:
      return 4;
  }
}

// Whether two buffers of ``bytes`` bytes share any byte.
bool overlap(const void* x, const void* y, size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(x), b = reinterpret_cast<uintptr_t>(y);
  return bytes != 0 && a < b + bytes && b < a + bytes;
}

OrtStatus* compute_with(Kernel* kernel, OrtKernelContext* context, TensorView* views) {
  static const char* const names[kInputs] = {"parameters", "gradient", "learning_rate", "accum", "momentum", "stat"};
  for (size_t i = 0; i < kInputs; ++i) SGDFUSE_RETURN_IF_ERROR(read_input(context, i, &views[i]));
  int64_t dims[16];
  size_t rank = 0;
  SGDFUSE_RETURN_IF_ERROR(shape_of(views[0].info, dims, &rank));
  const size_t n = views[0].count;
  for (size_t i : {size_t{1}, size_t{3}, size_t{5}}) {
    int64_t other[16];
    size_t other_rank = 0;
    SGDFUSE_RETURN_IF_ERROR(shape_of(views[i].info, other, &other_rank));
    if (other_rank != rank || std::memcmp(other, dims, rank * sizeof(int64_t)) != 0) {
      return status(std::string(names[i]) + " must have the shape of parameters");
    }
  }
  for (size_t i : {size_t{2}, size_t{4}}) {
    if (views[i].count != 1) return status(std::string(names[i]) + " must hold exactly one element");
  }
  const double lr = scalar_value(kernel->type, views[2].data);
  const double m = scalar_value(kernel->type, views[4].data);
  void* outputs[kOutputs];
  for (size_t i = 0; i < kOutputs; ++i) {
    OrtValue* value = nullptr;
    SGDFUSE_RETURN_IF_ERROR(g_api->KernelContext_GetOutput(context, i, dims, rank, &value));
    SGDFUSE_RETURN_IF_ERROR(g_api->GetTensorMutableData(value, &outputs[i]));
  }
  const void* p = views[0].data;
  const void* g = views[1].data;
  const void* a = views[3].data;
  const void* s = views[5].data;
  // Buffers bound by the caller (IOBinding) may overlap. Each output may be its own input exactly (in place:
  // the loops read element i before writing it); any other overlap would let a write reach a value still to
  // be read, so the inputs are then read from copies. Outputs sharing memory cannot all hold their results.
  const size_t bytes = n * element_size(kernel->type);
  const void* inputs[4] = {p, g, a, s};
  const size_t own[kOutputs] = {0, 2, 3};  // parameters_out <- parameters, accum_out <- accum, stat_out <- stat
  bool copy_inputs = false;
  for (size_t i = 0; i < kOutputs; ++i) {
    for (size_t j = i + 1; j < kOutputs; ++j) {
      if (overlap(outputs[i], outputs[j], bytes)) return status("outputs bound to overlapping memory");
    }
    for (size_t k = 0; k < 4; ++k) {
      if (overlap(outputs[i], inputs[k], bytes) && !(k == own[i] && outputs[i] == inputs[k])) copy_inputs = true;
    }
  }
  std::vector<unsigned char> copies;
  if (copy_inputs) {
    copies.resize(4 * bytes);
    for (size_t k = 0; k < 4; ++k) {
      std::memcpy(copies.data() + k * bytes, inputs[k], bytes);
      inputs[k] = copies.data() + k * bytes;
    }
    p = inputs[0], g = inputs[1], a = inputs[2], s = inputs[3];
  }
  switch (kernel->type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      run_update<F32>(kernel->attributes, n, p, g, a, s, lr, m, outputs[0], outputs[1], outputs[2]);
      break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
      run_update<F16>(kernel->attributes, n, p, g, a, s, lr, m, outputs[0], outputs[1], outputs[2]);
      break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      run_update<BF16>(kernel->attributes, n, p, g, a, s, lr, m, outputs[0], outputs[1], outputs[2]);
      break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
      run_update<F64>(kernel->attributes, n, p, g, a, s, lr, m, outputs[0], outputs[1], outputs[2]);
      break;
    default:
      return status("element type is not FLOAT, FLOAT16, BFLOAT16 or DOUBLE");
  }
  return nullptr;
}

OrtStatus* ORT_API_CALL compute(void* op_kernel, OrtKernelContext* context) {
  TensorView views[kInputs];
  OrtStatus* result = compute_with(static_cast<Kernel*>(op_kernel), context, views);
  for (TensorView& view : views) {
    if (view.info != nullptr) g_api->ReleaseTensorTypeAndShapeInfo(view.info);
  }
  return result;
}

void ORT_API_CALL destroy_kernel(void* op_kernel) { delete static_cast<Kernel*>(op_kernel); }

const char* ORT_API_CALL op_name(const OrtCustomOp*) { return kOpType; }
const char* ORT_API_CALL op_provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
ONNXTensorElementDataType ORT_API_CALL op_type(const OrtCustomOp* op, size_t) {
  return static_cast<const SgdOp*>(op)->type;
}
size_t ORT_API_CALL input_count(const OrtCustomOp*) { return kInputs; }
size_t ORT_API_CALL output_count(const OrtCustomOp*) { return kOutputs; }
OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(const OrtCustomOp*, size_t) {
  return INPUT_OUTPUT_REQUIRED;
}
OrtMemType ORT_API_CALL memory_type(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }
int ORT_API_CALL min_arity(const OrtCustomOp*) { return 1; }
int ORT_API_CALL homogeneous(const OrtCustomOp*) { return 1; }

SgdOp make_op(ONNXTensorElementDataType type) {
  SgdOp op{};
  op.version = kApiVersion;
  op.GetName = op_name;
  op.GetExecutionProviderType = op_provider;
  op.GetInputType = op_type;
  op.GetInputTypeCount = input_count;
  op.GetOutputType = op_type;
  op.GetOutputTypeCount = output_count;
  op.KernelDestroy = destroy_kernel;
  op.GetInputCharacteristic = required;
  op.GetOutputCharacteristic = required;
  op.GetInputMemoryType = memory_type;
  op.GetVariadicInputMinArity = min_arity;
  op.GetVariadicInputHomogeneity = homogeneous;
  op.GetVariadicOutputMinArity = min_arity;
  op.GetVariadicOutputHomogeneity = homogeneous;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  op.type = type;
  return op;
}

SgdOp g_ops[] = {
    make_op(ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT),
    make_op(ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16),
    make_op(ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16),
    make_op(ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE),
};

}  // namespace

// The entry point SessionOptions.register_custom_ops_library looks up.
extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(kApiVersion);
  if (api == nullptr) return nullptr;  // cannot even create a status; onnxruntime older than 1.16
  g_api = api;
  // The domain must outlive every session built from these options: it is deliberately never released.
  OrtCustomOpDomain* domain = nullptr;
  SGDFUSE_RETURN_IF_ERROR(api->CreateCustomOpDomain(kDomain, &domain));
  for (SgdOp& op : g_ops) SGDFUSE_RETURN_IF_ERROR(api->CustomOpDomain_Add(domain, &op));
  return api->AddCustomOpDomain(options, domain);
}
