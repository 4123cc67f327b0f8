// The LoRA update of one fused projection for every adapter segment of a step, in one call:
// for each segment, shrink = x[start:end] @ A.T, then for each sub-module
// y[start:end, out0:out1] += shrink[:, row0:row1] @ Bt, without one Python dispatch per matrix
// (SGMV's grouping, on the CPU). A segment of a few tokens (a decode step's) streams each matrix
// once and uses every element it reads for all the segment's tokens: BLAS would copy the matrix
// into its packed layout first, reading the bytes twice. Longer segments (prefill) call the BLAS
// sgemm that torch.mm calls. Every shrink runs first, then every expand, with each A cut into a
// piece of rows per thread and each B into a piece of columns per thread, so all threads read
// even when a step holds one adapter.
//
// ``plan`` is int64 [segments, 4 + 5 * parts]: start, end, a_offset, rows, then per part row0,
// row1, out0, out1, bt_offset (row1 == row0: no such part; rows == 0: the adapter has no weights
// for this projection). Offsets are elements into ``pool``, the cache pool's arena that holds
// every resident adapter's pages. The pool holds float32 or bfloat16 weights: bfloat16 halves the
// bytes a step reads, each element widened exactly to float32 as it is read (in the vector loops;
// for sgemm, a piece's weights first into a float32 scratch), and the sums run in float32, so
// both compute the same up to the order of the sums. x and y are float32, or both bfloat16 (a
// bfloat16 model): then the segments' rows of x are widened once into a float32 copy, the update
// is summed in float32 and added to y with one rounding to bfloat16 per element.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../vectors.h"

extern "C" void sgemm_(const char *transa, const char *transb, const int *m, const int *n,
                       const int *k, const float *alpha, const float *a, const int *lda,
                       const float *b, const int *ldb, const float *beta, float *c,
                       const int *ldc);

namespace {

constexpr int64_t kHead = 4;
constexpr int64_t kPartFields = 5;
constexpr int kStreamedTokens = 16;  // segments up to this long take the streaming loops
constexpr int kColumnBlock = 512;    // output columns an expand keeps in L1 at a time
// Below this cost (48 Ki floats, 192 KB, read for one token) one thread does a call's work.
constexpr int64_t kTeamWork = 48 * 1024 * (1 + kStreamedTokens);

// Built for AVX-512, AVX2 + FMA and plain x86-64; the loader picks what the CPU has.
#if defined(__x86_64__) && defined(__GNUC__)
#define LORA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LORA_CLONES
#endif

// out[m * ldo + j] = dot(x[m], a[j]) for N token rows of x and rows j0..j1 of a (row-major,
// k wide), R rows of a at a time: every element of a read from memory serves all N tokens, and
// the N * R sums run as independent chains of sixteen lanes each.
template <typename W, int N, int R>
LORA_CLONES void shrink_rows(int j0, int j1, int k, const W *__restrict a,
                             const float *__restrict x, int64_t ldx, float *__restrict out,
                             int ldo) {
    const int whole = k - k % kLanes;
    int j = j0;
    for (; j + R <= j1; j += R) {
        const W *r0 = a + static_cast<int64_t>(j) * k;
        Lanes s[N][R] = {};
        for (int i = 0; i < whole; i += kLanes) {
            Lanes w[R];
            for (int r = 0; r < R; ++r) w[r] = load(r0 + r * k + i);
            for (int m = 0; m < N; ++m) {
                const Lanes v = load(x + m * ldx + i);
                for (int r = 0; r < R; ++r) s[m][r] += v * w[r];
            }
        }
        for (int m = 0; m < N; ++m) {
            const float *xm = x + m * ldx;
            for (int r = 0; r < R; ++r) {
                float t = total(s[m][r]);
                for (int i = whole; i < k; ++i) t += xm[i] * widen(r0[r * k + i]);
                out[m * ldo + j + r] = t;
            }
        }
    }
    if constexpr (R > 1) shrink_rows<W, N, 1>(j, j1, k, a, x, ldx, out, ldo);
}

// shrink_rows for n tokens: four rows of a at a time for one or two tokens (four chains or
// eight), one row for more (four tokens over two rows at a time measured 1.4x slower).
template <typename W>
void shrink_streamed(int n, int j0, int j1, int k, const W *a, const float *x, int64_t ldx,
                     float *out, int ldo) {
    int m = 0;
    for (; m + 4 <= n; m += 4)
        shrink_rows<W, 4, 1>(j0, j1, k, a, x + m * ldx, ldx, out + m * ldo, ldo);
    switch (n - m) {
        case 3: shrink_rows<W, 3, 1>(j0, j1, k, a, x + m * ldx, ldx, out + m * ldo, ldo); break;
        case 2: shrink_rows<W, 2, 4>(j0, j1, k, a, x + m * ldx, ldx, out + m * ldo, ldo); break;
        case 1: shrink_rows<W, 1, 4>(j0, j1, k, a, x + m * ldx, ldx, out + m * ldo, ldo); break;
        default: break;
    }
}

// y[m, o0:o1] += sum_j s[m, j] * bt[j, o0:o1] for the n token rows, bt row-major [rank, ldb]:
// four rows of bt at a time are added to each token row (kept in L1 by blocks of columns).
template <typename W>
LORA_CLONES void expand_streamed(int n, int rank, int o0, int o1, const W *__restrict bt,
                                 int64_t ldb, const float *__restrict s, int lds,
                                 float *__restrict y, int64_t ldy) {
    for (int c0 = o0; c0 < o1; c0 += kColumnBlock) {
        const int c1 = c0 + kColumnBlock < o1 ? c0 + kColumnBlock : o1;
        int j = 0;
        for (; j + 4 <= rank; j += 4) {
            const W *b0 = bt + j * ldb, *b1 = b0 + ldb, *b2 = b1 + ldb, *b3 = b2 + ldb;
            for (int m = 0; m < n; ++m) {
                const float *sm = s + m * lds + j;
                const float e0 = sm[0], e1 = sm[1], e2 = sm[2], e3 = sm[3];
                float *ym = y + m * ldy;
                for (int o = c0; o < c1; ++o)
                    ym[o] += e0 * widen(b0[o]) + e1 * widen(b1[o]) + e2 * widen(b2[o]) +
                             e3 * widen(b3[o]);
            }
        }
        for (; j < rank; ++j) {
            const W *bj = bt + j * ldb;
            for (int m = 0; m < n; ++m) {
                const float e = s[m * lds + j];
                float *ym = y + m * ldy;
                for (int o = c0; o < c1; ++o) ym[o] += e * widen(bj[o]);
            }
        }
    }
}

// Column-major C[m, n] = beta * C + A'[m, k] @ B[k, n], A' = A.T when transpose_a.
void gemm(bool transpose_a, int m, int n, int k, const float *a, int lda, const float *b,
          int ldb, float beta, float *c, int ldc) {
    const char ta = transpose_a ? 'T' : 'N', tb = 'N';
    const float alpha = 1.0f;
    sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// dst[r, c] = w[r * ldw + c] widened, for rows x cols (dst row-major, cols wide).
LORA_CLONES void widen_block(int rows, int cols, const uint16_t *__restrict w, int64_t ldw,
                             float *__restrict dst) {
    for (int r = 0; r < rows; ++r) {
        const uint16_t *src = w + r * ldw;
        float *out = dst + static_cast<int64_t>(r) * cols;
        for (int c = 0; c < cols; ++c) out[c] = widen(src[c]);
    }
}

// y[c] = y[c] + sums[c] rounded to bfloat16, for cols columns.
LORA_CLONES void add_narrow(int64_t cols, const float *__restrict sums, uint16_t *__restrict y) {
    for (int64_t c = 0; c < cols; ++c) y[c] = narrow(widen(y[c]) + sums[c]);
}

// The calling thread's float32 copy of a piece's bfloat16 weights for sgemm, kept between calls.
float *scratch(int64_t elems) {
    thread_local std::vector<float> buffer;
    if (buffer.size() < static_cast<size_t>(elems)) buffer.resize(static_cast<size_t>(elems));
    return buffer.data();
}

// A piece of one phase's work: rows begin:end of a segment's A (part -1), or columns begin:end
// of one part's B.
struct Piece {
    int64_t segment, part;
    int begin, end;
    int64_t cost;
};

// Cuts 0:size into up to ``threads`` pieces that start at multiples of ``step``, each costing
// ``unit_cost`` per row or column.
void split(std::vector<Piece> &pieces, int64_t segment, int64_t part, int64_t size, int64_t step,
           int64_t unit_cost, int threads) {
    const int64_t steps = (size + step - 1) / step;
    const int64_t count = std::max<int64_t>(1, std::min<int64_t>(threads, steps));
    for (int64_t i = 0; i < count; ++i) {
        const int64_t begin = std::min(size, steps * i / count * step);
        const int64_t end = std::min(size, steps * (i + 1) / count * step);
        if (end > begin)
            pieces.push_back({segment, part, static_cast<int>(begin), static_cast<int>(end),
                              (end - begin) * unit_cost});
    }
}

// The pieces dealt to threads, the costliest first to the least loaded; no empty shares.
std::vector<std::vector<const Piece *>> deal(const std::vector<Piece> &pieces, int threads) {
    std::vector<const Piece *> order;
    for (const auto &piece : pieces) order.push_back(&piece);
    std::sort(order.begin(), order.end(),
              [](const Piece *l, const Piece *r) { return l->cost > r->cost; });
    const size_t team = std::min<size_t>(static_cast<size_t>(threads), order.size());
    std::vector<std::vector<const Piece *>> share(team);
    std::vector<int64_t> load(team, 0);
    for (const Piece *piece : order) {
        const auto t = std::min_element(load.begin(), load.end()) - load.begin();
        share[t].push_back(piece);
        load[t] += piece->cost;
    }
    return share;
}

void lora_apply(const at::Tensor &x, const at::Tensor &y, const at::Tensor &pool,
                const at::Tensor &plan) {
    TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu() && pool.device().is_cpu(),
                "lora_apply runs on the CPU");
    TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                    y.scalar_type() == x.scalar_type() &&
                    (pool.scalar_type() == at::kFloat || pool.scalar_type() == at::kBFloat16),
                "lora_apply: x and y both float32 or both bfloat16; float32 or bfloat16 weights");
    TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x and y: [tokens, _]");
    TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && x.stride(0) >= x.size(1) &&
                    y.stride(0) >= y.size(1),
                "x and y need contiguous rows");
    TORCH_CHECK(pool.is_contiguous() && pool.storage_offset() == 0,
                "the pool must be a whole contiguous tensor");
    TORCH_CHECK(plan.scalar_type() == at::kLong && plan.dim() == 2 && plan.is_contiguous() &&
                    (plan.size(1) - kHead) % kPartFields == 0,
                "plan: int64 [segments, 4 + 5 * parts]");
    const int64_t segments = plan.size(0), width = plan.size(1);
    const int64_t parts = (width - kHead) / kPartFields;
    const int64_t tokens = x.size(0), fan_in = x.size(1), fan_out = y.size(1);
    const int64_t pool_elems = pool.numel();
    const int64_t *rows_of = plan.data_ptr<int64_t>();
    // Check every index before any write: a bad plan is an error, never a stray write.
    for (int64_t s = 0; s < segments; ++s) {
        const int64_t *p = rows_of + s * width;
        const int64_t start = p[0], end = p[1], a_off = p[2], rank_rows = p[3];
        TORCH_CHECK(0 <= start && start <= end && end <= tokens, "segment outside the batch");
        if (rank_rows == 0) continue;
        TORCH_CHECK(rank_rows > 0 && a_off >= 0 && a_off + rank_rows * fan_in <= pool_elems,
                    "A outside the pool");
        for (int64_t j = 0; j < parts; ++j) {
            const int64_t *q = p + kHead + j * kPartFields;
            const int64_t row0 = q[0], row1 = q[1], out0 = q[2], out1 = q[3], bt_off = q[4];
            if (row1 == row0) continue;
            TORCH_CHECK(0 <= row0 && row0 < row1 && row1 <= rank_rows, "part rows outside A");
            TORCH_CHECK(0 <= out0 && out0 < out1 && out1 <= fan_out, "part columns outside y");
            TORCH_CHECK(bt_off >= 0 && bt_off + (row1 - row0) * (out1 - out0) <= pool_elems,
                        "B outside the pool");
        }
    }
    const bool bf16 = pool.scalar_type() == at::kBFloat16;
    const float *weights32 = bf16 ? nullptr : pool.data_ptr<float>();
    const uint16_t *weights16 =
        bf16 ? reinterpret_cast<const uint16_t *>(pool.data_ptr<at::BFloat16>()) : nullptr;
    const bool narrow_io = x.scalar_type() == at::kBFloat16;
    const float *xs;
    float *ys;
    int64_t ldx, ldy;
    thread_local std::vector<float> x_wide, y_sums;  // bfloat16 x and y: float32 working rows
    if (narrow_io) {
        x_wide.resize(static_cast<size_t>(tokens * fan_in));
        y_sums.resize(static_cast<size_t>(tokens * fan_out));
        const auto *x16 = reinterpret_cast<const uint16_t *>(x.data_ptr<at::BFloat16>());
        for (int64_t s = 0; s < segments; ++s) {
            const int64_t *p = rows_of + s * width;
            if (p[3] == 0) continue;
            for (int64_t t = p[0]; t < p[1]; ++t) {
                widen_block(1, static_cast<int>(fan_in), x16 + t * x.stride(0), 0,
                            x_wide.data() + t * fan_in);
                std::fill_n(y_sums.data() + t * fan_out, fan_out, 0.0f);
            }
        }
        xs = x_wide.data(), ys = y_sums.data(), ldx = fan_in, ldy = fan_out;
    } else {
        xs = x.data_ptr<float>(), ys = y.data_ptr<float>(), ldx = x.stride(0), ldy = y.stride(0);
    }
    const int threads = std::max(1, at::get_num_threads());

    // Every segment's shrunk rows ([n, rows], row-major) in one buffer.
    std::vector<int64_t> shrunk_at(segments + 1, 0);
    for (int64_t s = 0; s < segments; ++s) {
        const int64_t *p = rows_of + s * width;
        shrunk_at[s + 1] = shrunk_at[s] + (p[1] - p[0]) * p[3];
    }
    thread_local std::vector<float> buffer;  // the calling thread's, kept between calls
    buffer.resize(static_cast<size_t>(shrunk_at[segments]));
    float *shrunk = buffer.data();  // the team's threads write it through this pointer

    // Two phases, each matrix cut into one piece per thread (rows of A, then columns of each B),
    // so both threads stream even when one adapter is in the batch; the pieces go to threads by
    // cost, the costliest first to the least loaded (adapters of ranks 8 to 64, on four
    // projections or seven, differ in bytes sixteenfold).
    std::vector<Piece> shrinks, expands;
    for (int64_t s = 0; s < segments; ++s) {
        const int64_t *p = rows_of + s * width;
        const int64_t n = p[1] - p[0], rank_rows = p[3];
        if (n == 0 || rank_rows == 0) continue;
        split(shrinks, s, -1, rank_rows, 4, fan_in * (n + kStreamedTokens), threads);
        for (int64_t j = 0; j < parts; ++j) {
            const int64_t *q = p + kHead + j * kPartFields;
            if (q[1] == q[0]) continue;
            split(expands, s, j, q[3] - q[2], kLanes, (q[1] - q[0]) * (n + kStreamedTokens),
                  threads);
        }
    }
    // Each piece's work from weights of type W (float, or bfloat16 bits).
    auto shrink_from = [&](const Piece &piece, const auto *weights) {
        const int64_t *p = rows_of + piece.segment * width;
        const int n = static_cast<int>(p[1] - p[0]), rank_rows = static_cast<int>(p[3]);
        const int rows = piece.end - piece.begin, k = static_cast<int>(fan_in);
        const auto *a = weights + p[2];
        const float *xs_seg = xs + p[0] * ldx;
        float *out = shrunk + shrunk_at[piece.segment];
        if (n <= kStreamedTokens) {
            shrink_streamed(n, piece.begin, piece.end, k, a, xs_seg, ldx, out, rank_rows);
            return;
        }
        // out[:, begin:end] (column-major [rows, n], leading dimension rows) = A[begin:end] @ x.T
        const auto *a_piece = a + static_cast<int64_t>(piece.begin) * fan_in;
        const float *a32;
        if constexpr (std::is_same_v<std::decay_t<decltype(*weights)>, float>) {
            a32 = a_piece;
        } else {
            float *wide = scratch(static_cast<int64_t>(rows) * fan_in);
            widen_block(rows, k, a_piece, fan_in, wide);
            a32 = wide;
        }
        gemm(true, rows, n, k, a32, k, xs_seg, static_cast<int>(ldx), 0.0f, out + piece.begin,
             rank_rows);
    };
    auto expand_from = [&](const Piece &piece, const auto *weights) {
        const int64_t *p = rows_of + piece.segment * width;
        const int64_t *q = p + kHead + piece.part * kPartFields;
        const int n = static_cast<int>(p[1] - p[0]), rank_rows = static_cast<int>(p[3]);
        const int rank = static_cast<int>(q[1] - q[0]), ldb = static_cast<int>(q[3] - q[2]);
        const int cols = piece.end - piece.begin;
        const auto *bt = weights + q[4];
        const float *s = shrunk + shrunk_at[piece.segment] + q[0];
        float *y_seg = ys + p[0] * ldy + q[2];
        if (n <= kStreamedTokens) {
            expand_streamed(n, rank, piece.begin, piece.end, bt, ldb, s, rank_rows, y_seg, ldy);
            return;
        }
        // y[:, begin:end] += shrunk[:, row0:row1] @ Bt[:, begin:end], all column-major here.
        const float *b32;
        int ldb32;
        if constexpr (std::is_same_v<std::decay_t<decltype(*weights)>, float>) {
            b32 = bt + piece.begin, ldb32 = ldb;
        } else {  // the piece's columns of Bt, widened: [rank, cols], leading dimension cols
            float *wide = scratch(static_cast<int64_t>(rank) * cols);
            widen_block(rank, cols, bt + piece.begin, ldb, wide);
            b32 = wide, ldb32 = cols;
        }
        gemm(false, cols, n, rank, b32, ldb32, s, rank_rows, 1.0f, y_seg + piece.begin,
             static_cast<int>(ldy));
    };
    auto shrink = [&](const Piece &piece) {
        bf16 ? shrink_from(piece, weights16) : shrink_from(piece, weights32);
    };
    auto expand = [&](const Piece &piece) {
        bf16 ? expand_from(piece, weights16) : expand_from(piece, weights32);
    };
    // Below kTeamWork, a team's start and barrier cost more than a second thread saves.
    int64_t cost = 0;
    for (const auto &piece : shrinks) cost += piece.cost;
    for (const auto &piece : expands) cost += piece.cost;
    const int dealt = cost < kTeamWork ? 1 : threads;
    const auto shrink_share = deal(shrinks, dealt), expand_share = deal(expands, dealt);
    const int team = static_cast<int>(std::max(shrink_share.size(), expand_share.size()));
    if (team <= 1) {
        for (const auto &piece : shrinks) shrink(piece);
        for (const auto &piece : expands) expand(piece);
    } else {
        // A team may come smaller than asked (a nested region runs on one thread): each thread
        // takes every share its number strides to, so no share is left undone.
#pragma omp parallel num_threads(team)
        {
            const size_t first = static_cast<size_t>(omp_get_thread_num());
            const size_t stride = static_cast<size_t>(omp_get_num_threads());
            for (size_t t = first; t < shrink_share.size(); t += stride)
                for (const Piece *piece : shrink_share[t]) shrink(*piece);
#pragma omp barrier
            for (size_t t = first; t < expand_share.size(); t += stride)
                for (const Piece *piece : expand_share[t]) expand(*piece);
        }
    }
    if (!narrow_io) return;
    auto *y16 = reinterpret_cast<uint16_t *>(y.data_ptr<at::BFloat16>());
    for (int64_t s = 0; s < segments; ++s) {
        const int64_t *p = rows_of + s * width;
        if (p[3] == 0) continue;
        for (int64_t t = p[0]; t < p[1]; ++t) add_narrow(fan_out, y_sums.data() + t * fan_out,
                                                          y16 + t * y.stride(0));
    }
}

}  // namespace

TORCH_LIBRARY(lora_guard, m) {
    m.def("lora_apply(Tensor x, Tensor(a!) y, Tensor pool, Tensor plan) -> ()");
}

TORCH_LIBRARY_IMPL(lora_guard, CPU, m) { m.impl("lora_apply", &lora_apply); }
