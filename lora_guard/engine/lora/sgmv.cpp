// The LoRA update of one fused projection for every adapter segment of a step, in one call:
// for each segment, shrink = x[start:end] @ A.T, then for each sub-module
// y[start:end, out0:out1] += shrink[:, row0:row1] @ Bt, without one Python dispatch per matrix
// (SGMV's grouping, on the CPU). A segment of a few tokens (a decode step's) streams each matrix
// once and uses every element it reads for all the segment's tokens: BLAS would copy the matrix
// into its packed layout first, reading the bytes twice. Longer segments (prefill) call the BLAS
// sgemm that torch.mm calls.
//
// ``plan`` is int64 [segments, 4 + 5 * parts]: start, end, a_offset, rows, then per part row0,
// row1, out0, out1, bt_offset (row1 == row0: no such part; rows == 0: the adapter has no weights
// for this projection). Offsets are elements into ``pool``, the cache pool's arena that holds
// every resident adapter's pages.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

extern "C" void sgemm_(const char *transa, const char *transb, const int *m, const int *n,
                       const int *k, const float *alpha, const float *a, const int *lda,
                       const float *b, const int *ldb, const float *beta, float *c,
                       const int *ldc);

namespace {

constexpr int64_t kHead = 4;
constexpr int64_t kPartFields = 5;
constexpr int kStreamedTokens = 16;  // segments up to this long take the streaming loops
constexpr int kLanes = 16;           // independent partial sums of a dot product (vectorized)
constexpr int kColumnBlock = 512;    // output columns an expand keeps in L1 at a time

// Built for AVX-512, AVX2 + FMA and plain x86-64; the loader picks what the CPU has.
#if defined(__x86_64__) && defined(__GNUC__)
#define LORA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LORA_CLONES
#endif

typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes load(const float *p) {
    Lanes v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

inline float total(Lanes v) {
    float sum = 0.0f;
    for (int l = 0; l < kLanes; ++l) sum += v[l];
    return sum;
}

// out[m, j] = dot(x[m], a[j]) for the n token rows of x and the rows of a (row-major [rows, k]);
// four token rows at a time, so each piece of a row read from memory serves all four.
LORA_CLONES
void shrink_streamed(int n, int rows, int k, const float *__restrict a,
                     const float *__restrict x, int64_t ldx, float *__restrict out) {
    const int whole = k - k % kLanes;
    for (int j = 0; j < rows; ++j) {
        const float *aj = a + static_cast<int64_t>(j) * k;
        int m = 0;
        for (; m + 4 <= n; m += 4) {
            const float *x0 = x + m * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
            Lanes s0 = {}, s1 = {}, s2 = {}, s3 = {};
            for (int i = 0; i < whole; i += kLanes) {
                const Lanes w = load(aj + i);
                s0 += load(x0 + i) * w;
                s1 += load(x1 + i) * w;
                s2 += load(x2 + i) * w;
                s3 += load(x3 + i) * w;
            }
            float t0 = total(s0), t1 = total(s1), t2 = total(s2), t3 = total(s3);
            for (int i = whole; i < k; ++i) {
                t0 += x0[i] * aj[i];
                t1 += x1[i] * aj[i];
                t2 += x2[i] * aj[i];
                t3 += x3[i] * aj[i];
            }
            out[m * rows + j] = t0;
            out[(m + 1) * rows + j] = t1;
            out[(m + 2) * rows + j] = t2;
            out[(m + 3) * rows + j] = t3;
        }
        for (; m < n; ++m) {
            const float *xm = x + m * ldx;
            Lanes s0 = {};
            for (int i = 0; i < whole; i += kLanes) s0 += load(xm + i) * load(aj + i);
            float t0 = total(s0);
            for (int i = whole; i < k; ++i) t0 += xm[i] * aj[i];
            out[m * rows + j] = t0;
        }
    }
}

// y[m, :width] += sum_j s[m, j] * bt[j, :width] for the n token rows, bt row-major [rank, width]:
// each row of bt is read once, in order, and added to every token row (kept in L1 by blocks).
LORA_CLONES
void expand_streamed(int n, int rank, int width, const float *__restrict bt,
                     const float *__restrict s, int lds, float *__restrict y, int64_t ldy) {
    for (int o0 = 0; o0 < width; o0 += kColumnBlock) {
        const int o1 = o0 + kColumnBlock < width ? o0 + kColumnBlock : width;
        for (int j = 0; j < rank; ++j) {
            const float *bj = bt + static_cast<int64_t>(j) * width;
            for (int m = 0; m < n; ++m) {
                const float c = s[m * lds + j];
                float *ym = y + m * ldy;
                for (int o = o0; o < o1; ++o) ym[o] += c * bj[o];
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

void lora_apply(const at::Tensor &x, const at::Tensor &y, const at::Tensor &pool,
                const at::Tensor &plan) {
    TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu() && pool.device().is_cpu(),
                "lora_apply runs on the CPU");
    TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat &&
                    pool.scalar_type() == at::kFloat,
                "lora_apply computes in float32");
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
    const float *xs = x.data_ptr<float>();
    float *ys = y.data_ptr<float>();
    const float *weights = pool.data_ptr<float>();
    const int64_t ldx = x.stride(0), ldy = y.stride(0);
    // Segments write disjoint rows of y, so they run in parallel.
    auto apply_segment = [&](int64_t s, std::vector<float> &shrunk) {
        const int64_t *p = rows_of + s * width;
        const int n = static_cast<int>(p[1] - p[0]);
        const int rank_rows = static_cast<int>(p[3]);
        if (n == 0 || rank_rows == 0) return;
        const bool streamed = n <= kStreamedTokens;
        shrunk.resize(static_cast<size_t>(n) * rank_rows);
        // shrunk (row-major [n, rows]) = x_seg @ A.T, A row-major [rows, in].
        if (streamed) {
            shrink_streamed(n, rank_rows, static_cast<int>(fan_in), weights + p[2],
                            xs + p[0] * ldx, ldx, shrunk.data());
        } else {
            gemm(true, rank_rows, n, static_cast<int>(fan_in), weights + p[2],
                 static_cast<int>(fan_in), xs + p[0] * ldx, static_cast<int>(ldx), 0.0f,
                 shrunk.data(), rank_rows);
        }
        for (int64_t j = 0; j < parts; ++j) {
            const int64_t *q = p + kHead + j * kPartFields;
            if (q[1] == q[0]) continue;
            const int rank = static_cast<int>(q[1] - q[0]);
            const int width_out = static_cast<int>(q[3] - q[2]);
            // y_seg[:, out0:out1] += shrunk[:, row0:row1] @ Bt, Bt row-major [rank, out].
            if (streamed) {
                expand_streamed(n, rank, width_out, weights + q[4], shrunk.data() + q[0],
                                rank_rows, ys + p[0] * ldy + q[2], ldy);
                continue;
            }
            gemm(false, width_out, n, rank, weights + q[4], width_out,
                 shrunk.data() + q[0], rank_rows, 1.0f, ys + p[0] * ldy + q[2],
                 static_cast<int>(ldy));
        }
    };
    // Whole segments to threads, the costliest first to the least loaded thread: adapters of
    // ranks 8 to 64, on four projections or seven, differ in bytes sixteenfold, and an even
    // split by count would leave one thread idle while the other finishes.
    const int64_t threads =
        std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), segments));
    std::vector<int64_t> cost(segments), order(segments);
    for (int64_t s = 0; s < segments; ++s) {
        const int64_t *p = rows_of + s * width;
        int64_t bytes = p[3] * fan_in;
        for (int64_t j = 0; j < parts; ++j) {
            const int64_t *q = p + kHead + j * kPartFields;
            bytes += (q[1] - q[0]) * (q[3] - q[2]);
        }
        cost[s] = bytes * (p[1] - p[0] + kStreamedTokens);  // reading, plus each token's work
        order[s] = s;
    }
    std::sort(order.begin(), order.end(), [&](int64_t l, int64_t r) { return cost[l] > cost[r]; });
    std::vector<std::vector<int64_t>> share(threads);
    std::vector<int64_t> load(threads, 0);
    for (const int64_t s : order) {
        const auto t = std::min_element(load.begin(), load.end()) - load.begin();
        share[t].push_back(s);
        load[t] += cost[s];
    }
    at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
        std::vector<float> shrunk;
        for (int64_t t = first; t < last; ++t) {
            for (const int64_t s : share[t]) apply_segment(s, shrunk);
        }
    });
}

}  // namespace

TORCH_LIBRARY(lora_guard, m) {
    m.def("lora_apply(Tensor x, Tensor(a!) y, Tensor pool, Tensor plan) -> ()");
}

TORCH_LIBRARY_IMPL(lora_guard, CPU, m) { m.impl("lora_apply", &lora_apply); }
