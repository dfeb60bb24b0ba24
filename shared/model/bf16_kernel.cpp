// bf16 products for the few rows of a decoding step: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), rounded to bf16.
//
// W is packed once, at load, as [N / 64][K / 2][64][2]: a tile of 64 outputs is one stream of 256-byte lines, read
// once per 6 rows. Each output is one fp32 accumulator summed over K's pairs in ascending order, with the bias added
// last, so a row's result is the same bits whatever M is, where the row sits and which rows share the call; how the
// tiles are shared among threads moves no value either. With AVX-512 BF16 the pairs go through vdpbf16ps; elsewhere
// (tests on other CPUs) a pair is two multiply-adds in fp32, the odd element first as vdpbf16ps orders it.
//
// At one to eight rows a step reads every weight from memory once: on an AMD EPYC (Zen 4, 2 threads) the target's
// 121 products took 0.41-0.66x oneDNN's time at 1-8 rows and 0.93-0.96x at 128-512 (docs/BENCHMARKS.md).
//
// Built at run time by shared/model/bf16_tiles.py through shared/model/native.py (-march=native), like the cpu
// attention kernel, and run on torch's OpenMP threads.
#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE = 64;  // outputs of a tile: 4 vectors of 16
constexpr int ROWS = 6;       // rows sharing a tile's weights: 24 accumulators, 4 weight vectors, 1 broadcast

#if defined(__AVX512BF16__)
typedef __m512 Acc;
inline Acc zero() { return _mm512_setzero_ps(); }
inline Acc step(Acc acc, uint32_t pair, const uint16_t* weights) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(weights);
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair)), w);
}
inline void store(Acc acc, float* out) { _mm512_storeu_ps(out, acc); }
#else
typedef float Acc __attribute__((vector_size(64)));
typedef uint32_t Bits __attribute__((vector_size(64)));
inline Acc zero() { return Acc{}; }
inline Acc as_float(Bits bits) {
    Acc out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}
inline Acc step(Acc acc, uint32_t pair, const uint16_t* weights) {  // built with -ffp-contract=off
    Bits w;
    std::memcpy(&w, weights, sizeof w);
    const Bits high = Bits{} + 0xffff0000u;
    const float odd = as_float(Bits{} + (pair & 0xffff0000u))[0], even = as_float(Bits{} + (pair << 16))[0];
    acc = acc + as_float(w & high) * odd;
    return acc + as_float(w << 16) * even;
}
inline void store(Acc acc, float* out) { std::memcpy(out, &acc, sizeof acc); }
#endif

inline float to_float(uint16_t x) {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}

inline uint16_t to_bf16(float x) {  // round to nearest even, as torch's conversion does
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

// R rows of x against one tile: sums[r][64].
template <int R>
void tile(const uint16_t* x, int64_t K, const uint16_t* w, float* sums) {
    Acc acc[R][4];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = zero();
    for (int64_t kp = 0; kp < K / 2; ++kp) {
        const uint16_t* line = w + kp * TILE * 2;
        for (int r = 0; r < R; ++r) {
            uint32_t pair;
            std::memcpy(&pair, x + r * K + 2 * kp, sizeof pair);
            for (int c = 0; c < 4; ++c) acc[r][c] = step(acc[r][c], pair, line + c * 32);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) store(acc[r][c], sums + r * TILE + c * 16);
}

}  // namespace

extern "C" {

int specdec_bf16_native() {  // 1 where the products run on vdpbf16ps
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

void specdec_bf16_product(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* out, int64_t M,
                          int64_t N, int64_t K, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < N / TILE; ++t) {
        const uint16_t* w = packed + t * (K / 2) * TILE * 2;
        float sums[ROWS * TILE];
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int64_t rows = std::min<int64_t>(ROWS, M - r0);
            const uint16_t* xr = x + r0 * K;
            switch (rows) {
                case 1: tile<1>(xr, K, w, sums); break;
                case 2: tile<2>(xr, K, w, sums); break;
                case 3: tile<3>(xr, K, w, sums); break;
                case 4: tile<4>(xr, K, w, sums); break;
                case 5: tile<5>(xr, K, w, sums); break;
                default: tile<ROWS>(xr, K, w, sums); break;
            }
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t j = 0; j < TILE; ++j) {
                    const float sum = sums[r * TILE + j];
                    out[(r0 + r) * N + t * TILE + j] = to_bf16(bias ? sum + to_float(bias[t * TILE + j]) : sum);
                }
        }
    }
}
}
