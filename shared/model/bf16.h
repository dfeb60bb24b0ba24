// bf16 <-> fp32 as torch converts, shared by the kernels (shared/model/native.py puts this folder on the include
// path and hashes this file into every build's name).
#pragma once
#include <cstdint>
#include <cstring>

namespace specdec {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bits) {  // the 16 bits are the float's high half
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float out;
    std::memcpy(&out, &wide, sizeof out);
    return out;
}

inline uint16_t to_bf16(float x) {  // round to nearest even, as torch's conversion does
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // a quiet NaN
    return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace specdec
