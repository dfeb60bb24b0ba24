// Cephes' expf polynomial, written out so that a loop around it vectorises (the C library's expf is a call per
// element), shared by the kernels (paged_kernel.cpp's softmax, small_ops_kernel.cpp's SiLU).
#pragma once
#include <cstdint>
#include <cstring>

namespace specdec {

// n = round(x / ln 2), as a float: adding and taking away 1.5 * 2^23 rounds to an integer (|x / ln 2| < 2^22).
inline float exp_steps(float x) { return (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; }

// exp(x - n ln 2), |x - n ln 2| <= ln 2 / 2, where n = exp_steps(x): the polynomial on the reduced argument.
inline float exp_reduced(float x, float n) {
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts: the first is exact in n
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return p * r * r + r + 1.0f;
}

inline float power_of_two(int32_t n) {  // 2^n for -126 <= n <= 127
    const int32_t bits = (n + 127) << 23;
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}

}  // namespace specdec
