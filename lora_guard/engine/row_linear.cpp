// row_linear: y = x @ w.T (+ bias) for the few rows of a decode step, the weight kept as its rows
// [out, in]. A decode step is bound by reading the weights from memory, once for all its rows:
// each thread streams its block of the weight's rows, asking for the bytes ahead of it
// (software prefetch; the hardware's streamer stops at every 4 KiB page and starts again, and
// each projection starts cold), and computes every row of x against each weight row it reads.
// In bfloat16, where the CPU has AVX512-BF16, one instruction sums pairs of products into
// float32 lanes (vdpbf16ps, as oneDNN's kernels do); elsewhere the weights are widened and summed
// in float32 vectors. Sums are float32, the output rounded once, as torch's linear rounds.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ROW_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define HAVE_DPBF16 1
#else
#define ROW_CLONES
#define HAVE_DPBF16 0
#endif

#include "vectors.h"

namespace {

using bf16 = uint16_t;  // a bfloat16 as its bits (vectors.h)

constexpr int64_t kMaxRows = 8;      // rows of x one call takes (a decode step's few sequences)
constexpr int64_t kAheadBytes = 2048;  // how far ahead of its rows a thread asks for the weight

inline void prefetch(const void *p) {
#if HAVE_DPBF16
    _mm_prefetch(static_cast<const char *>(p), _MM_HINT_T0);
#else
    __builtin_prefetch(p);
#endif
}

// Ask for `bytes` of the weight from `from` on (a block's rows, or a thread's first bytes).
inline void ask_ahead(const void *from, int64_t bytes) {
    const char *p = static_cast<const char *>(from);
    for (int64_t b = 0; b < bytes; b += 64) prefetch(p + b);
}

// Weight rows [j0, j1) against M rows of x widened to float32 (xf [M, k]); out[m * n + j].
// R weight rows at a time, M x R partial sums in vector registers.
template <int M, int R, typename W>
ROW_CLONES void rows_widened(int64_t j0, int64_t j1, int64_t k, int64_t n, const W *w,
                             const float *xf, const float *bias, W *out) {
    const int64_t whole = k - k % kLanes;
    const int64_t block_bytes = R * k * static_cast<int64_t>(sizeof(W));
    ask_ahead(w + j0 * k, std::min(kAheadBytes, (j1 - j0) * k * static_cast<int64_t>(sizeof(W))));
    int64_t j = j0;
    for (; j < j1; j += R) {
        const int rows = static_cast<int>(std::min<int64_t>(R, j1 - j));
        const W *wr = w + j * k;
        if (j + R < j1) ask_ahead(reinterpret_cast<const char *>(wr) + kAheadBytes, block_bytes);
        Lanes s[M][R] = {};
        float tail[M][R] = {};
        if (rows == R) {
            for (int64_t i = 0; i < whole; i += kLanes) {
                Lanes xv[M];
                for (int m = 0; m < M; ++m) xv[m] = load(xf + m * k + i);
                for (int r = 0; r < R; ++r) {
                    const Lanes wv = load(wr + r * k + i);
                    for (int m = 0; m < M; ++m) s[m][r] += xv[m] * wv;
                }
            }
        } else {
            for (int r = 0; r < rows; ++r)
                for (int64_t i = 0; i < whole; i += kLanes) {
                    const Lanes wv = load(wr + r * k + i);
                    for (int m = 0; m < M; ++m) s[m][r] += load(xf + m * k + i) * wv;
                }
        }
        for (int r = 0; r < rows; ++r)
            for (int64_t i = whole; i < k; ++i)
                for (int m = 0; m < M; ++m) tail[m][r] += xf[m * k + i] * widen(wr[r * k + i]);
        for (int r = 0; r < rows; ++r)
            for (int m = 0; m < M; ++m)
                out[m * n + j + r] =
                    narrow_to<W>(total(s[m][r]) + tail[m][r] + (bias ? bias[j + r] : 0.0f));
    }
}

#if HAVE_DPBF16
#define DPBF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

// Sums of weight rows [0, rows) of `wr` and M rows of x over k's 32 elements from i, those
// outside `mask` read as zeros.
template <int M, int R>
DPBF16 inline void dp_masked(__m512 (&s)[M][R], const bf16 *x, const bf16 *wr, int64_t k,
                             int64_t i, __mmask32 mask, int rows) {
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * k + i);
    for (int r = 0; r < rows; ++r) {
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr + r * k + i);
        for (int m = 0; m < M; ++m) s[m][r] = _mm512_dpbf16_ps(s[m][r], wv, xv[m]);
    }
}

// The same in bfloat16 with AVX512-BF16: 32 weights a load, pairs of products summed into 16
// float32 lanes by one instruction; a row's last k % 32 read under a mask.
template <int M, int R>
DPBF16 void rows_dpbf16(int64_t j0, int64_t j1, int64_t k, int64_t n, const bf16 *w,
                        const bf16 *x, const float *bias, bf16 *out) {
    const int64_t whole = k - k % 32;
    const __mmask32 rest = static_cast<__mmask32>((uint64_t{1} << (k % 32)) - 1);
    const int64_t block_bytes = R * k * 2;
    ask_ahead(w + j0 * k, std::min(kAheadBytes, (j1 - j0) * k * 2));
    for (int64_t j = j0; j < j1; j += R) {
        const int rows = static_cast<int>(std::min<int64_t>(R, j1 - j));
        const bf16 *wr = w + j * k;
        if (j + R < j1) ask_ahead(reinterpret_cast<const char *>(wr) + kAheadBytes, block_bytes);
        __m512 s[M][R];
        for (int m = 0; m < M; ++m)
            for (int r = 0; r < R; ++r) s[m][r] = _mm512_setzero_ps();
        if (rows == R) {
            for (int64_t i = 0; i < whole; i += 32) {
                __m512bh xv[M];
                for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * k + i);
                for (int r = 0; r < R; ++r) {
                    const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + r * k + i);
                    for (int m = 0; m < M; ++m) s[m][r] = _mm512_dpbf16_ps(s[m][r], wv, xv[m]);
                }
            }
        } else {
            for (int64_t i = 0; i < whole; i += 32) dp_masked<M, R>(s, x, wr, k, i, ~__mmask32{0}, rows);
        }
        if (rest) dp_masked<M, R>(s, x, wr, k, whole, rest, rows);
        for (int r = 0; r < rows; ++r)
            for (int m = 0; m < M; ++m)
                out[m * n + j + r] =
                    narrow(_mm512_reduce_add_ps(s[m][r]) + (bias ? bias[j + r] : 0.0f));
    }
}

bool has_dpbf16() {
    static const bool yes = __builtin_cpu_supports("avx512bf16");
    return yes;
}
#endif

// R weight rows at a time: as many as keep M x R sums in registers.
template <int M>
constexpr int rows_at_once() {
    return M <= 4 ? 4 : 2;
}

template <int M, typename W>
void run_rows(int64_t n, int64_t k, const W *w, const W *x, const float *bias, W *out) {
    constexpr int R = rows_at_once<M>();
#if HAVE_DPBF16
    if constexpr (std::is_same_v<W, bf16>) {
        if (has_dpbf16()) {
            at::parallel_for(0, n, 16, [&](int64_t j0, int64_t j1) {
                rows_dpbf16<M, R>(j0, j1, k, n, w, x, bias, out);
            });
            return;
        }
    }
#endif
    std::vector<float> xf(M * k);
    for (int64_t i = 0; i < M * k; ++i) xf[i] = widen(x[i]);
    at::parallel_for(0, n, 16, [&](int64_t j0, int64_t j1) {
        rows_widened<M, R, W>(j0, j1, k, n, w, xf.data(), bias, out);
    });
}

template <typename W>
void dispatch(int64_t m, int64_t n, int64_t k, const W *w, const W *x, const float *bias,
              W *out) {
    switch (m) {
        case 1: return run_rows<1>(n, k, w, x, bias, out);
        case 2: return run_rows<2>(n, k, w, x, bias, out);
        case 3: return run_rows<3>(n, k, w, x, bias, out);
        case 4: return run_rows<4>(n, k, w, x, bias, out);
        case 5: return run_rows<5>(n, k, w, x, bias, out);
        case 6: return run_rows<6>(n, k, w, x, bias, out);
        case 7: return run_rows<7>(n, k, w, x, bias, out);
        default: return run_rows<8>(n, k, w, x, bias, out);
    }
}

template <typename W>
void run(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
         at::Tensor &y) {
    const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
    std::vector<float> b;
    if (bias) {
        b.resize(n);
        const W *bs = reinterpret_cast<const W *>(bias->data_ptr());
        for (int64_t j = 0; j < n; ++j) b[j] = widen(bs[j]);
    }
    dispatch<W>(m, n, k, reinterpret_cast<const W *>(weight.data_ptr()),
                reinterpret_cast<const W *>(x.data_ptr()), bias ? b.data() : nullptr,
                reinterpret_cast<W *>(y.data_ptr()));
}

at::Tensor row_linear(const at::Tensor &x, const at::Tensor &weight,
                      const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "row_linear: tensors must be on the CPU");
    TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
                "row_linear: the weight must be float32 or bfloat16, not ", weight.scalar_type());
    TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "row_linear: x must be ",
                weight.scalar_type(), ", not ", x.scalar_type());
    TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "row_linear: x and the weight must be contiguous");
    TORCH_CHECK(weight.dim() == 2 && x.dim() == 2 && x.size(1) == weight.size(1),
                "row_linear: x ", x.sizes(), " does not match the weight ", weight.sizes());
    TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "row_linear: x has ", x.size(0),
                " rows; it takes 1 to ", kMaxRows);
    if (bias) {
        TORCH_CHECK(bias->scalar_type() == weight.scalar_type() && bias->is_contiguous() &&
                        bias->dim() == 1 && bias->size(0) == weight.size(0),
                    "row_linear: the bias must be a contiguous [", weight.size(0), "] of ",
                    weight.scalar_type());
    }
    at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
    if (weight.scalar_type() == at::kFloat) {
        run<float>(x, weight, bias, y);
    } else {
        run<bf16>(x, weight, bias, y);
    }
    return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lora_guard, m) {
    m.def("row_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(lora_guard, CPU, m) { m.impl("row_linear", &row_linear); }
