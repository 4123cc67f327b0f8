// A decoder layer's small operations on the CPU, each one call instead of the handful of torch
// operations it takes in Python (a decode token of the demo model ran about 5,800 of them, a few
// microseconds of dispatch each, where its linear layers took 121 calls):
//   rms_norm       out = w * round(x * rsqrt(mean(x^2) + eps)), the sums in float32
//   add_rms_norm   x += delta in place, then rms_norm of the new x (a residual and the next norm)
//   rope_cache     rotate the queries and keys of a fused qkv row, write keys and values into the
//                  paged cache at their slots, return the queries
//   decode_attention  one query per sequence against its cached context, read at its slots
//                  (no gather, no float32 copy of the cache): float32 sums, one rounding
//   silu_mul       silu(gate) * up of a fused gate_up row
// Tensors are float32 or bfloat16 (all of one call alike). In bfloat16 each step rounds where
// torch's own operations round (a product, a sum, a norm's scaled row), so a layer computes what
// the Python forward computes, up to the order of the float32 sums.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vectors.h"

namespace {

#if defined(__x86_64__) && defined(__GNUC__)
#define LAYER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LAYER_CLONES
#endif

using bf16 = uint16_t;  // a bfloat16 as its bits (vectors.h)

// exp(v) within about one float32 ulp, without branches so loops of it vectorize (the C
// library's expf does not): v = n ln2 + r, |r| <= ln2 / 2, exp(r) by its series to r^7, times 2^n.
[[gnu::always_inline]] inline float exp_approx(float v) {
    v = std::min(std::max(v, -87.0f), 88.0f);
    const float n = std::nearbyint(v * 1.44269504088896341f);
    const float r = (v - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

// A value as an operation in E leaves it: rounded to E and back.
template <typename E>
inline float round_to(float v) {
    return widen(narrow_to<E>(v));
}

bool is_bf16(const at::Tensor &t) { return t.scalar_type() == at::kBFloat16; }

template <typename E>
E *data(const at::Tensor &t) {
    if constexpr (std::is_same_v<E, float>) {
        return t.data_ptr<float>();
    } else {
        return reinterpret_cast<bf16 *>(t.data_ptr<at::BFloat16>());
    }
}

void check_floating(const at::Tensor &t, const char *name) {
    TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
                " must be float32 or bfloat16, not ", t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_same(const at::Tensor &a, const at::Tensor &b, const char *name) {
    check_floating(b, name);
    TORCH_CHECK(a.scalar_type() == b.scalar_type(), name, " must be ", a.scalar_type(), ", not ",
                b.scalar_type());
}

// Rows of `cost` work each: at least this much work a thread, else one thread does it all.
int64_t grain(int64_t cost) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cost, 1)); }

template <typename E>
LAYER_CLONES void norm_row(const E *x, const E *w, E *out, int64_t n, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
        const float v = widen(x[i]);
        sum += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i)
        out[i] = narrow_to<E>(widen(w[i]) * round_to<E>(widen(x[i]) * inv));
}

template <typename E>
void norm_rows(const at::Tensor &x, const at::Tensor &w, const at::Tensor &out, double eps) {
    const int64_t rows = x.size(0), n = x.size(1);
    const E *xs = data<E>(x), *ws = data<E>(w);
    E *os = data<E>(out);
    at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
            norm_row(xs + r * n, ws, os + r * n, n, static_cast<float>(eps));
    });
}

void check_norm(const at::Tensor &x, const at::Tensor &w) {
    check_floating(x, "x");
    check_same(x, w, "weight");
    TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1),
                "rms_norm: x [rows, n] and weight [n], got ", x.sizes(), " and ", w.sizes());
}

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &w, double eps) {
    check_norm(x, w);
    auto out = at::empty_like(x);
    is_bf16(x) ? norm_rows<bf16>(x, w, out, eps) : norm_rows<float>(x, w, out, eps);
    return out;
}

template <typename E>
void add_rows(const at::Tensor &x, const at::Tensor &delta) {
    const int64_t rows = x.size(0), n = x.size(1);
    E *xs = data<E>(x);
    const E *ds = data<E>(delta);
    at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0 * n; i < r1 * n; ++i) xs[i] = narrow_to<E>(widen(xs[i]) + widen(ds[i]));
    });
}

at::Tensor add_rms_norm(const at::Tensor &x, const at::Tensor &delta, const at::Tensor &w,
                        double eps) {
    check_norm(x, w);
    check_same(x, delta, "delta");
    TORCH_CHECK(delta.sizes() == x.sizes(), "add_rms_norm: delta ", delta.sizes(), " is not x's ",
                x.sizes());
    is_bf16(x) ? add_rows<bf16>(x, delta) : add_rows<float>(x, delta);
    return rms_norm(x, w, eps);
}

// out = x * cos + partner * signed_sin, each product and the sum rounded to E; the partner of
// an element is the one half a head away (its first half's sine negated, as in rotate()).
template <typename E>
LAYER_CLONES void rotate_head(const E *x, const E *cos, const E *ssin, E *out, int64_t d) {
    const int64_t half = d / 2;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) {
        const float partner = widen(x[j < half ? j + half : j - half]);
        const float a = round_to<E>(widen(x[j]) * widen(cos[j]));
        const float b = round_to<E>(partner * widen(ssin[j]));
        out[j] = narrow_to<E>(a + b);
    }
}

template <typename E>
void rope_rows(const at::Tensor &qkv, const at::Tensor &cos, const at::Tensor &ssin,
               const at::Tensor &k_cache, const at::Tensor &v_cache, const at::Tensor &slots,
               int64_t heads, int64_t kv_heads, const at::Tensor &q) {
    const int64_t tokens = qkv.size(0), width = qkv.size(1), d = k_cache.size(2);
    const E *src = data<E>(qkv), *cs = data<E>(cos), *ss = data<E>(ssin);
    E *kc = data<E>(k_cache), *vc = data<E>(v_cache), *qs = data<E>(q);
    const int64_t *slot = slots.data_ptr<int64_t>();
    const int64_t row = kv_heads * d;  // one slot of the cache
    at::parallel_for(0, tokens, grain(width * 4), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            const E *x = src + t * width, *c = cs + t * d, *s = ss + t * d;
            for (int64_t h = 0; h < heads; ++h) rotate_head(x + h * d, c, s, qs + (t * heads + h) * d, d);
            E *k = kc + slot[t] * row;
            for (int64_t h = 0; h < kv_heads; ++h) rotate_head(x + (heads + h) * d, c, s, k + h * d, d);
            std::copy(x + (heads + kv_heads) * d, x + width, vc + slot[t] * row);
        }
    });
}

at::Tensor rope_cache(const at::Tensor &qkv, const at::Tensor &cos, const at::Tensor &ssin,
                      const at::Tensor &k_cache, const at::Tensor &v_cache,
                      const at::Tensor &slots, int64_t heads, int64_t kv_heads) {
    check_floating(qkv, "qkv");
    for (const auto *t : {&cos, &ssin, &k_cache, &v_cache}) check_same(qkv, *t, "cos, sin and the cache");
    TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() &&
                    k_cache.size(1) == kv_heads,
                "rope_cache: caches [slots, kv_heads, head_dim], got ", k_cache.sizes());
    const int64_t d = k_cache.size(2), tokens = qkv.size(0);
    TORCH_CHECK(d % 2 == 0 && qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * d,
                "rope_cache: qkv [tokens, (heads + 2 kv_heads) head_dim], got ", qkv.sizes());
    TORCH_CHECK(cos.numel() == tokens * d && ssin.numel() == tokens * d,
                "rope_cache: cos and sin hold head_dim values a token");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == tokens &&
                    slots.is_contiguous(),
                "rope_cache: one int64 slot a token");
    const int64_t *slot = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t)
        TORCH_CHECK(slot[t] >= 0 && slot[t] < k_cache.size(0), "rope_cache: slot ", slot[t],
                    " is outside the cache");
    auto q = at::empty({tokens, heads, d}, qkv.options());
    is_bf16(qkv) ? rope_rows<bf16>(qkv, cos, ssin, k_cache, v_cache, slots, heads, kv_heads, q)
                 : rope_rows<float>(qkv, cos, ssin, k_cache, v_cache, slots, heads, kv_heads, q);
    return q;
}

// softmax of each of the group's rows of scores [group, ctx], in place, in float32.
LAYER_CLONES void softmax_rows(float *scores, int64_t group, int64_t ctx) {
    for (int64_t g = 0; g < group; ++g) {
        float *sg = scores + g * ctx;
        const float top = *std::max_element(sg, sg + ctx);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < ctx; ++c) sum += (sg[c] = exp_approx(sg[c] - top));
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t c = 0; c < ctx; ++c) sg[c] *= inv;
    }
}

// One sequence's query heads that share a KV head, against its context: scores, softmax and the
// weighted values in float32, read from the cache at the sequence's slots. Any group and head
// size; attend_lanes below is the same for the common ones.
template <typename E>
LAYER_CLONES void attend_group(const E *q, const E *kc, const E *vc, const int64_t *slot,
                               int64_t ctx, int64_t group, int64_t d, int64_t row, float scale,
                               float *scores, float *acc, E *out) {
    for (int64_t c = 0; c < ctx; ++c) {
        const E *k = kc + slot[c] * row;
        for (int64_t g = 0; g < group; ++g) {
            const E *qg = q + g * d;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t j = 0; j < d; ++j) s += widen(qg[j]) * widen(k[j]);
            scores[g * ctx + c] = s * scale;
        }
    }
    softmax_rows(scores, group, ctx);
    std::fill(acc, acc + group * d, 0.0f);
    for (int64_t c = 0; c < ctx; ++c) {
        const E *v = vc + slot[c] * row;
        for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * ctx + c];
            float *a = acc + g * d;
            for (int64_t j = 0; j < d; ++j) a[j] += p * widen(v[j]);
        }
    }
    for (int64_t i = 0; i < group * d; ++i) out[i] = narrow_to<E>(acc[i]);
}

// attend_group for G query heads of CHUNKS * 16 dimensions: the group's queries and sums stay
// in vector registers, each key and value row is widened once for all G heads.
template <typename E, int G, int CHUNKS>
LAYER_CLONES void attend_lanes(const E *q, const E *kc, const E *vc, const int64_t *slot,
                               int64_t ctx, int64_t row, float scale, float *scores, E *out) {
    constexpr int d = CHUNKS * kLanes;
    Lanes qv[G][CHUNKS];
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < CHUNKS; ++i) qv[g][i] = load(q + g * d + i * kLanes);
    for (int64_t c = 0; c < ctx; ++c) {
        const E *k = kc + slot[c] * row;
        Lanes kv[CHUNKS];
        for (int i = 0; i < CHUNKS; ++i) kv[i] = load(k + i * kLanes);
        for (int g = 0; g < G; ++g) {
            Lanes s = qv[g][0] * kv[0];
            for (int i = 1; i < CHUNKS; ++i) s += qv[g][i] * kv[i];
            scores[g * ctx + c] = total(s) * scale;
        }
    }
    softmax_rows(scores, G, ctx);
    Lanes acc[G][CHUNKS] = {};
    for (int64_t c = 0; c < ctx; ++c) {
        const E *v = vc + slot[c] * row;
        Lanes vv[CHUNKS];
        for (int i = 0; i < CHUNKS; ++i) vv[i] = load(v + i * kLanes);
        for (int g = 0; g < G; ++g) {
            const float p = scores[g * ctx + c];
            for (int i = 0; i < CHUNKS; ++i) acc[g][i] += p * vv[i];
        }
    }
    for (int g = 0; g < G; ++g)
        for (int i = 0; i < CHUNKS; ++i)
            for (int l = 0; l < kLanes; ++l)
                out[g * d + i * kLanes + l] = narrow_to<E>(acc[g][i][l]);
}

// The attend_lanes that fits a group and head size, or nullptr (then attend_group).
template <typename E>
using AttendLanes = void (*)(const E *, const E *, const E *, const int64_t *, int64_t, int64_t,
                             float, float *, E *);

template <typename E, int CHUNKS>
AttendLanes<E> lanes_for_group(int64_t group) {
    switch (group) {
        case 1: return &attend_lanes<E, 1, CHUNKS>;
        case 2: return &attend_lanes<E, 2, CHUNKS>;
        case 3: return &attend_lanes<E, 3, CHUNKS>;
        case 4: return &attend_lanes<E, 4, CHUNKS>;
        case 5: return &attend_lanes<E, 5, CHUNKS>;
        case 6: return &attend_lanes<E, 6, CHUNKS>;
        case 7: return &attend_lanes<E, 7, CHUNKS>;
        case 8: return &attend_lanes<E, 8, CHUNKS>;
        default: return nullptr;
    }
}

template <typename E>
AttendLanes<E> lanes_for(int64_t group, int64_t d) {
    if (d == 64) return lanes_for_group<E, 4>(group);
    if (d == 128) return lanes_for_group<E, 8>(group);
    return nullptr;
}

template <typename E>
void attend(const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache,
            const at::Tensor &slots, const at::Tensor &lengths, double scale,
            const at::Tensor &out) {
    const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
    const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads, width = slots.size(1);
    const int64_t row = kv_heads * d;
    const E *qs = data<E>(q), *kc = data<E>(k_cache), *vc = data<E>(v_cache);
    E *os = data<E>(out);
    const int64_t *sl = slots.data_ptr<int64_t>(), *len = lengths.data_ptr<int64_t>();
    const float scaled = static_cast<float>(scale);
    const AttendLanes<E> lanes = lanes_for<E>(group, d);
    at::parallel_for(0, batch * kv_heads, grain(4 * group * width * d), [&](int64_t i0, int64_t i1) {
        std::vector<float> scores(group * width), acc(group * d);
        for (int64_t i = i0; i < i1; ++i) {
            const int64_t b = i / kv_heads, h = i % kv_heads, at_q = (b * heads + h * group) * d;
            const E *qi = qs + at_q, *ki = kc + h * d, *vi = vc + h * d;
            if (lanes != nullptr) {
                lanes(qi, ki, vi, sl + b * width, len[b], row, scaled, scores.data(), os + at_q);
            } else {
                attend_group(qi, ki, vi, sl + b * width, len[b], group, d, row, scaled,
                             scores.data(), acc.data(), os + at_q);
            }
        }
    });
}

at::Tensor decode_attention(const at::Tensor &q, const at::Tensor &k_cache,
                            const at::Tensor &v_cache, const at::Tensor &slots,
                            const at::Tensor &lengths, double scale) {
    check_floating(q, "q");
    check_same(q, k_cache, "k_cache");
    check_same(q, v_cache, "v_cache");
    TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() &&
                    k_cache.size(2) == q.size(2) && q.size(1) % k_cache.size(1) == 0,
                "decode_attention: q [batch, heads, head_dim] and caches [slots, kv_heads, "
                "head_dim] with heads a multiple of kv_heads, got ",
                q.sizes(), " and ", k_cache.sizes());
    TORCH_CHECK(slots.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong &&
                    slots.is_contiguous() && lengths.is_contiguous() && slots.dim() == 2 &&
                    slots.size(0) == q.size(0) && lengths.numel() == q.size(0),
                "decode_attention: int64 slots [batch, context] and lengths [batch]");
    const int64_t *sl = slots.data_ptr<int64_t>(), *len = lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < q.size(0); ++b) {
        TORCH_CHECK(len[b] > 0 && len[b] <= slots.size(1), "decode_attention: length ", len[b],
                    " of sequence ", b, " is not within 1..", slots.size(1));
        for (int64_t c = 0; c < len[b]; ++c)
            TORCH_CHECK(sl[b * slots.size(1) + c] >= 0 && sl[b * slots.size(1) + c] < k_cache.size(0),
                        "decode_attention: a slot is outside the cache");
    }
    auto out = at::empty_like(q);
    is_bf16(q) ? attend<bf16>(q, k_cache, v_cache, slots, lengths, scale, out)
               : attend<float>(q, k_cache, v_cache, slots, lengths, scale, out);
    return out;
}

template <typename E>
LAYER_CLONES void silu_mul_row(const E *gate, const E *up, E *out, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const float g = widen(gate[i]);
        out[i] = narrow_to<E>(round_to<E>(g / (1.0f + exp_approx(-g))) * widen(up[i]));
    }
}

template <typename E>
void silu_rows(const at::Tensor &gate_up, const at::Tensor &out) {
    const int64_t rows = gate_up.size(0), n = out.size(1);
    const E *src = data<E>(gate_up);
    E *os = data<E>(out);
    at::parallel_for(0, rows, grain(4 * n), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) silu_mul_row(src + r * 2 * n, src + r * 2 * n + n, os + r * n, n);
    });
}

at::Tensor silu_mul(const at::Tensor &gate_up) {
    check_floating(gate_up, "gate_up");
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
                "silu_mul: gate_up [rows, 2 n], got ", gate_up.sizes());
    auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
    is_bf16(gate_up) ? silu_rows<bf16>(gate_up, out) : silu_rows<float>(gate_up, out);
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lora_guard, m) {
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
    m.def("rope_cache(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor(a!) k_cache, "
          "Tensor(b!) v_cache, Tensor slots, int heads, int kv_heads) -> Tensor");
    m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, "
          "Tensor lengths, float scale) -> Tensor");
    m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(lora_guard, CPU, m) {
    m.impl("rms_norm", &rms_norm);
    m.impl("add_rms_norm", &add_rms_norm);
    m.impl("rope_cache", &rope_cache);
    m.impl("decode_attention", &decode_attention);
    m.impl("silu_mul", &silu_mul);
}
