// What the engine's compiled operations (lora/sgmv.cpp, layer_ops.cpp, row_linear.cpp) share:
// bfloat16 as its bits (uint16_t), the top half of a float's bits, so it widens exactly by a
// shift and narrows to the nearest, ties to even, as torch rounds (branch-free, so loops of them vectorize); and
// sixteen floats as one vector (GCC's vector extension), loaded from floats or bfloat16.
#pragma once

#include <cstdint>
#include <type_traits>

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

// To the element type: a float stays, a bfloat16 (its bits) is the nearest.
template <typename E>
inline E narrow_to(float v) {
    if constexpr (std::is_same_v<E, float>) {
        return v;
    } else {
        return narrow(v);
    }
}

constexpr int kLanes = 16;  // independent partial sums of a dot product (vectorized)

typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));

[[gnu::always_inline]] inline Lanes load(const float *p) {
    Lanes v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

[[gnu::always_inline]] inline Lanes load(const uint16_t *p) {
    Halves h;
    __builtin_memcpy(&h, p, sizeof h);
    const Words bits = __builtin_convertvector(h, Words) << 16;
    Lanes v;
    __builtin_memcpy(&v, &bits, sizeof v);
    return v;
}

// The sum of a vector's sixteen lanes, pairwise (halves added, four times): a few shuffles, where
// a lane-by-lane sum is a chain of sixteen dependent adds.
[[gnu::always_inline]] inline float total(Lanes v) {
    typedef float Eight __attribute__((vector_size(8 * sizeof(float))));
    typedef float Four __attribute__((vector_size(4 * sizeof(float))));
    const Eight e = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const Four f = __builtin_shufflevector(e, e, 0, 1, 2, 3) + __builtin_shufflevector(e, e, 4, 5, 6, 7);
    return (f[0] + f[2]) + (f[1] + f[3]);
}
