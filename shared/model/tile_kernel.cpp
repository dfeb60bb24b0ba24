// Products for the few rows of a decoding step: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), bf16 or fp32.
//
// W is laid out once, at load, in tiles of 32 outputs: bf16 as [N / 32][K / 2][32][2], fp32 as [N / 32][K][32]. A
// tile is one stream of 128-byte lines, read once per 12 rows. Each output is one fp32 accumulator summed over K in
// ascending order (bf16: by pairs), with the bias added last, so a row's result is the same bits whatever M is, where
// the row sits and which rows share the call; how the tiles are shared among threads moves no value either. bf16
// pairs go through vdpbf16ps where the CPU has AVX-512 BF16, fp32 through vfmadd with AVX-512; elsewhere (tests on
// other CPUs) a portable path sums in the same order: a bf16 pair as two multiply-adds in fp32, the odd element first
// as vdpbf16ps orders it, an fp32 step as a multiply then an add.
//
// At one to eight rows a step reads every weight from memory once: on an AMD EPYC (Zen 4, 2 threads) the target's
// 121 products took 0.61-0.70x oneDNN's time in bf16 and 0.64-0.69x in fp32 at 1-8 rows (docs/BENCHMARKS.md).
// Tiles of 32 outputs and 12 rows took 0.89-0.95x the time of the first version's 64 and 6 at 8-40 rows (one pass
// over a tile for 8 rows, not 6 + 2; 576 outputs are 18 tiles, which two threads share evenly, not 9).
//
// Built at run time by shared/model/tiles.py through shared/model/native.py (-march=native), like the cpu
// attention kernel, and run on torch's OpenMP threads.
#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"

namespace {

using specdec::to_bf16;
using specdec::to_float;

constexpr int64_t TILE = 32;  // outputs of a tile: 2 vectors of 16
constexpr int ROWS = 12;      // rows sharing a tile's weights: 24 accumulators, 2 weight vectors, 1 broadcast

#if defined(__AVX512F__)
typedef __m512 Acc;
inline Acc zero() { return _mm512_setzero_ps(); }
inline Acc fp32_step(Acc acc, float x, const float* weights) {
    return _mm512_fmadd_ps(_mm512_set1_ps(x), _mm512_loadu_ps(weights), acc);
}
inline void store(Acc acc, float* out) { _mm512_storeu_ps(out, acc); }
#else
typedef float Acc __attribute__((vector_size(64)));
inline Acc zero() { return Acc{}; }
inline Acc fp32_step(Acc acc, float x, const float* weights) {  // built with -ffp-contract=off: never fused
    Acc w;
    std::memcpy(&w, weights, sizeof w);
    return acc + w * x;
}
inline void store(Acc acc, float* out) { std::memcpy(out, &acc, sizeof acc); }
#endif

#if defined(__AVX512BF16__)
inline Acc bf16_step(Acc acc, uint32_t pair, const uint16_t* weights) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(weights);
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair)), w);
}
#else
typedef uint32_t Bits __attribute__((vector_size(64)));
typedef float Floats __attribute__((vector_size(64)));
inline Floats as_float(Bits bits) {
    Floats out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}
inline Acc bf16_step(Acc acc, uint32_t pair, const uint16_t* weights) {
    Bits w;
    std::memcpy(&w, weights, sizeof w);
    const Bits high = Bits{} + 0xffff0000u;
    const float odd = as_float(Bits{} + (pair & 0xffff0000u))[0], even = as_float(Bits{} + (pair << 16))[0];
    Floats sum;
    std::memcpy(&sum, &acc, sizeof sum);
    sum = sum + as_float(w & high) * odd;
    sum = sum + as_float(w << 16) * even;
    std::memcpy(&acc, &sum, sizeof acc);
    return acc;
}
#endif

// R rows of bf16 x against one tile: sums[r][32].
template <int R>
void bf16_tile(const uint16_t* x, int64_t K, const uint16_t* w, float* sums) {
    Acc acc[R][2];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 2; ++c) acc[r][c] = zero();
    for (int64_t kp = 0; kp < K / 2; ++kp) {
        const uint16_t* line = w + kp * TILE * 2;
        for (int r = 0; r < R; ++r) {
            uint32_t pair;
            std::memcpy(&pair, x + r * K + 2 * kp, sizeof pair);
            for (int c = 0; c < 2; ++c) acc[r][c] = bf16_step(acc[r][c], pair, line + c * 32);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 2; ++c) store(acc[r][c], sums + r * TILE + c * 16);
}

// R rows of fp32 x against one tile: sums[r][32].
template <int R>
void fp32_tile(const float* x, int64_t K, const float* w, float* sums) {
    Acc acc[R][2];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 2; ++c) acc[r][c] = zero();
    for (int64_t k = 0; k < K; ++k) {
        const float* line = w + k * TILE;
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < 2; ++c) acc[r][c] = fp32_step(acc[r][c], x[r * K + k], line + c * 16);
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 2; ++c) store(acc[r][c], sums + r * TILE + c * 16);
}

template <typename T, void (*const* TILES)(const T*, int64_t, const T*, float*), typename Out, typename Finish>
void product(const T* x, const T* packed, Out* out, int64_t M, int64_t N, int64_t K, int threads, Finish finish) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < N / TILE; ++t) {
        const T* w = packed + t * K * TILE;
        float sums[ROWS * TILE];
        // Passes of as even a size as ROWS allows (16 rows: 8 + 8, not 12 + 4): a row's sums do not depend on it
        const int64_t passes = (M + ROWS - 1) / ROWS;
        for (int64_t pass = 0, r0 = 0; pass < passes; ++pass) {
            const int64_t rows = M / passes + (pass < M % passes ? 1 : 0);
            TILES[rows - 1](x + r0 * K, K, w, sums);
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t j = 0; j < TILE; ++j)
                    out[(r0 + r) * N + t * TILE + j] = finish(sums[r * TILE + j], t * TILE + j);
            r0 += rows;
        }
    }
}

void (*const BF16_TILES[ROWS])(const uint16_t*, int64_t, const uint16_t*, float*) = {
    bf16_tile<1>, bf16_tile<2>, bf16_tile<3>, bf16_tile<4>,  bf16_tile<5>,  bf16_tile<6>,
    bf16_tile<7>, bf16_tile<8>, bf16_tile<9>, bf16_tile<10>, bf16_tile<11>, bf16_tile<12>};
void (*const FP32_TILES[ROWS])(const float*, int64_t, const float*, float*) = {
    fp32_tile<1>, fp32_tile<2>, fp32_tile<3>, fp32_tile<4>,  fp32_tile<5>,  fp32_tile<6>,
    fp32_tile<7>, fp32_tile<8>, fp32_tile<9>, fp32_tile<10>, fp32_tile<11>, fp32_tile<12>};

}  // namespace

extern "C" {

int specdec_bf16_native() {  // 1 where the bf16 products run on vdpbf16ps
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

int specdec_fp32_native() {  // 1 where the fp32 products run on AVX-512 multiply-adds
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

void specdec_bf16_product(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* out, int64_t M,
                          int64_t N, int64_t K, int threads) {
    product<uint16_t, BF16_TILES>(x, packed, out, M, N, K, threads, [bias](float sum, int64_t j) {
        return to_bf16(bias ? sum + to_float(bias[j]) : sum);
    });
}

void specdec_fp32_product(const float* x, const float* packed, const float* bias, float* out, int64_t M, int64_t N,
                          int64_t K, int threads) {
    product<float, FP32_TILES>(x, packed, out, M, N, K, threads,
                               [bias](float sum, int64_t j) { return bias ? sum + bias[j] : sum; });
}
}
