// bfloat16 as its bits (uint16_t): the top half of a float's bits, so it widens exactly by a
// shift, and narrows to the nearest, ties to even, as torch rounds. Shared by the engine's
// compiled operations (lora/sgmv.cpp, layer_ops.cpp); branch-free, so loops of them vectorize.
#pragma once

#include <cstdint>

inline float widen(float v) { return v; }

[[gnu::always_inline]] inline float widen(uint16_t w) {
    const uint32_t bits = static_cast<uint32_t>(w) << 16;
    float v;
    __builtin_memcpy(&v, &bits, sizeof v);
    return v;
}

// A float rounded to the nearest bfloat16, ties to even; NaN stays NaN.
[[gnu::always_inline]] inline uint16_t narrow(float v) {
    uint32_t bits;
    __builtin_memcpy(&bits, &v, sizeof bits);
    const uint32_t nearest = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    return static_cast<uint16_t>(nan ? (bits >> 16) | 0x40u : nearest);
}
