// The eager forward's small ops in one call each, fp32 or bf16, where torch runs a few microseconds of dispatch
// per op over a decoding step's few rows (AMD EPYC, Zen 4, 2 threads; torch profiler, fp32 forward at batch 8):
//
// RMSNorm: out[r, :] = weight * (x[r, :] * rsqrt(mean(x[r, :]^2) + eps)), six ops (eight in bf16) 61 times a
// forward, 1.3-2 ms of a 31 ms step (measured by dropping the norms). Each row is one thread's, its sum of squares
// 16 fp32 partial sums over the row in order (lane j takes the elements j, j + 16, ...), folded in one fixed order:
// a row's result is the same bits whatever the row count, where the row sits and how many threads share the call.
// It rounds where torch's ops do: x * rsqrt(...) once, in fp32, and stored in x's dtype (bf16: to nearest even),
// then weight * that, in fp32, stored in x's dtype.
//
// Rotary and the K/V cache writes: from each row of the q/k/v product, the queries rotated into `q_out`, the keys
// rotated and the values as they are into their cache slots, where torch runs seven ops a layer
// (rope.apply_rotation's multiplies, roll and add; write_kv's two index_copy_), 0.8 ms of a 30 ms step. The
// arithmetic is apply_rotation's, element by element: x * cos and rolled(x) * signed_sin each rounded to x's dtype,
// then their sum (built with -ffp-contract=off: never fused), so the bits are those of the ops; copies are exact.
//
// The residual add and the norm after it: the sum rounded to x's dtype as torch's add rounds it, stored (the next
// add reads it), then normalised as above: the bits of the add followed by this norm, in one call where the model
// ran an add and a norm (60 adds a forward, 0.6 ms of a 30 ms fp32 step at batch 8).
//
// SiLU(gate) * up: the MLP's activation from the rows of its gate/up product, where torch runs a split, a SiLU and a
// multiply (0.7 + 0.45 ms of the same step). SiLU is gate / (1 + exp(-gate)) as torch's kernel computes it, with
// Cephes' exp (exp.h) where torch runs SLEEF's: within a few fp32 units of torch's values, not its bits. In bf16 the
// SiLU is rounded to bf16 before the multiply, as the two ops round. Each element is computed alone, the same way
// wherever it sits: a row's bits do not depend on the rows beside it or the threads.
//
// Rows are independent; a prefill chunk's are shared among threads. Built at run time by shared/model/small_ops.py
// through shared/model/native.py (-march=native).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "exp.h"

namespace {

using specdec::to_bf16;
using specdec::to_float;

inline float round_to(float x, const float*) { return x; }  // x as stored in the dtype of the pointer
inline float round_to(float x, const uint16_t*) { return to_float(to_bf16(x)); }
inline void put(float* out, float x) { *out = x; }
inline void put(uint16_t* out, float x) { *out = to_bf16(x); }

// ---- RMSNorm ----

constexpr int LANES = 16;

template <typename T>
void norm_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
    float lanes[LANES] = {};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; ++j) {
            const float v = to_float(x[i + j]);
            lanes[j] += v * v;
        }
    for (int j = 0; i + j < n; ++j) {
        const float v = to_float(x[i + j]);
        lanes[j] += v * v;
    }
    for (int width = LANES / 2; width > 0; width /= 2)  // pairwise, always the same pairs
        for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
    const float inverse = 1.0f / std::sqrt(lanes[0] / static_cast<float>(n) + eps);
    for (int64_t k = 0; k < n; ++k) {
        const float normed = round_to(to_float(x[k]) * inverse, x);  // x * rsqrt(...), in x's dtype
        put(out + k, to_float(weight[k]) * normed);
    }
}

// A decoding step's few rows cost less than waking a second thread; a prefill chunk's are shared.
constexpr int64_t SHARED_ROWS = 32;

template <typename T>
void norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t n, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= SHARED_ROWS)
    for (int64_t r = 0; r < rows; ++r) norm_row(x + r * n, weight, out + r * n, n, eps);
}

template <typename T>
void add_norm_rows(const T* x, const T* delta, const T* weight, T* sum, T* out, int64_t rows, int64_t n, float eps,
                   int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= SHARED_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        T* row = sum + r * n;
        for (int64_t k = 0; k < n; ++k) put(row + k, to_float(x[r * n + k]) + to_float(delta[r * n + k]));
        norm_row(row, weight, out + r * n, n, eps);
    }
}

// ---- SiLU(gate) * up ----

// exp(x) over the whole float range: 2^n applied in two halves, so that n may run from -150 (results among the
// subnormals, or 0) to 128 (+inf past the largest float); NaN stays NaN.
inline float exp_any(float x) {
    const float clamped = x < -104.0f ? -104.0f : (x > 88.8f ? 88.8f : x);
    const float n = specdec::exp_steps(clamped);
    const int32_t steps = static_cast<int32_t>(n), half = steps / 2;
    const float value = specdec::exp_reduced(clamped, n) * specdec::power_of_two(half);
    return x != x ? x : value * specdec::power_of_two(steps - half);
}

template <typename T>
void silu_mul_rows(const T* gate_up, int64_t row_stride, T* out, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= SHARED_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        const T* gate = gate_up + r * row_stride;
        const T* up = gate + n;
        T* row = out + r * n;
        for (int64_t k = 0; k < n; ++k) {
            const float g = to_float(gate[k]);
            const float silu = round_to(g / (1.0f + exp_any(-g)), gate);
            put(row + k, silu * to_float(up[k]));
        }
    }
}

// ---- rotary and the K/V cache writes ----

// One head's vector: its first `rot` values rotated (the halves rolled against each other), the rest copied.
template <typename T>
void rotate(const T* x, const T* cos, const T* signed_sin, T* out, int64_t dim, int64_t rot) {
    const int64_t half = rot / 2;
    for (int64_t d = 0; d < rot; ++d) {
        const float a = round_to(to_float(x[d]) * to_float(cos[d]), x);
        const float b = round_to(to_float(x[d < half ? d + half : d - half]) * to_float(signed_sin[d]), x);
        put(out + d, a + b);
    }
    std::memcpy(out + rot, x + rot, (dim - rot) * sizeof(T));
}

// Returns 0, or -1 without writing anything where a slot is outside the cache (as index_copy_ refuses one).
template <typename T>
int rotate_and_store(const T* qkv, int64_t row_stride, const T* cos, const T* signed_sin, int64_t rot, T* q_out,
                     T* k_cache, T* v_cache, const int64_t* slots, int64_t num_slots, int64_t tokens, int64_t heads,
                     int64_t kv_heads, int64_t dim, int threads) {
    for (int64_t t = 0; t < tokens; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens >= 32)
    for (int64_t t = 0; t < tokens; ++t) {
        const T* row = qkv + t * row_stride;
        const T* c = cos + t * rot;
        const T* s = signed_sin + t * rot;
        for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, c, s, q_out + (t * heads + h) * dim, dim, rot);
        T* k_slot = k_cache + slots[t] * kv_heads * dim;
        for (int64_t h = 0; h < kv_heads; ++h) rotate(row + (heads + h) * dim, c, s, k_slot + h * dim, dim, rot);
        std::memcpy(v_cache + slots[t] * kv_heads * dim, row + (heads + kv_heads) * dim, kv_heads * dim * sizeof(T));
    }
    return 0;
}

}  // namespace

extern "C" {

void specdec_fp32_rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t n, float eps,
                           int threads) {
    norm_rows(x, weight, out, rows, n, eps, threads);
}

void specdec_bf16_rms_norm(const uint16_t* x, const uint16_t* weight, uint16_t* out, int64_t rows, int64_t n,
                           float eps, int threads) {
    norm_rows(x, weight, out, rows, n, eps, threads);
}

void specdec_fp32_add_rms_norm(const float* x, const float* delta, const float* weight, float* sum, float* out,
                               int64_t rows, int64_t n, float eps, int threads) {
    add_norm_rows(x, delta, weight, sum, out, rows, n, eps, threads);
}

void specdec_bf16_add_rms_norm(const uint16_t* x, const uint16_t* delta, const uint16_t* weight, uint16_t* sum,
                               uint16_t* out, int64_t rows, int64_t n, float eps, int threads) {
    add_norm_rows(x, delta, weight, sum, out, rows, n, eps, threads);
}

void specdec_fp32_silu_mul(const float* gate_up, int64_t row_stride, float* out, int64_t rows, int64_t n,
                           int threads) {
    silu_mul_rows(gate_up, row_stride, out, rows, n, threads);
}

void specdec_bf16_silu_mul(const uint16_t* gate_up, int64_t row_stride, uint16_t* out, int64_t rows, int64_t n,
                           int threads) {
    silu_mul_rows(gate_up, row_stride, out, rows, n, threads);
}

int specdec_fp32_rotate_and_store(const float* qkv, int64_t row_stride, const float* cos, const float* signed_sin,
                                  int64_t rot, float* q_out, float* k_cache, float* v_cache, const int64_t* slots,
                                  int64_t num_slots, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                                  int threads) {
    return rotate_and_store(qkv, row_stride, cos, signed_sin, rot, q_out, k_cache, v_cache, slots, num_slots, tokens,
                            heads, kv_heads, dim, threads);
}

int specdec_bf16_rotate_and_store(const uint16_t* qkv, int64_t row_stride, const uint16_t* cos,
                                  const uint16_t* signed_sin, int64_t rot, uint16_t* q_out, uint16_t* k_cache,
                                  uint16_t* v_cache, const int64_t* slots, int64_t num_slots, int64_t tokens,
                                  int64_t heads, int64_t kv_heads, int64_t dim, int threads) {
    return rotate_and_store(qkv, row_stride, cos, signed_sin, rot, q_out, k_cache, v_cache, slots, num_slots, tokens,
                            heads, kv_heads, dim, threads);
}

}  // extern "C"
