/* The sampler's arithmetic in a fixed order (kernels/fixed_order.py calls
 * these; models/sampling.py and models/scoring.py use them): the same bits
 * at every instruction-set level (AVX-512, AVX2, NEON, plain C) and in
 * their numpy twins, which fixed_order.py runs where no compiler is.
 *
 *   trioserve_exp_shifted   out = exp(x - shift) of each row, for a row's sampling weights
 *   trioserve_block_sums    the sums of each row's blocks of `block` entries, in float64
 *   trioserve_exp_sums      each row's largest entry and the sum of exp(x - largest), for log_softmax
 *   trioserve_log_softmax   out = (x - largest) - log(sum), rounded once to float32
 *
 * Why: torch vectorizes its reductions (sum, log_softmax) by the width of
 * the CPU's vectors, so their summation order, and the last bits of the
 * result, change between an AVX2 and an AVX-512 machine. Here each order is
 * spelled out: a block's entries go to 16 lanes (entry i to lane i mod 16,
 * each lane summed in order), the lanes are summed by a fixed tree, the
 * block's last entries (fewer than 16) follow in order, and blocks are
 * summed in order. Every vector path performs exactly those float64
 * additions. The exp is fixed_exp.h's, and the log is computed from basic
 * operations (`log_fixed`), never the C library's.
 *
 * Every operation is unfused (built with -ffp-contract=off); rows are
 * independent, so the threads change no bits. */

#include <math.h>
#include <stdint.h>

#include "fixed_exp.h"

#define SUM_LANES 16

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

/* The 16 lanes summed by the fixed tree: lane i + 8, then + 4, + 2, + 1. */
static inline double lane_tree(const double *acc) {
    double s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = acc[i] + acc[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}

/* The sum of w[0 .. n) in the order the header describes (one block). */
static double block_sum(const float *w, int64_t n) {
    double acc[SUM_LANES] = {0};
    int64_t t = 0;
#if defined(__AVX512F__)
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (; t + SUM_LANES <= n; t += SUM_LANES) {
        lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm256_loadu_ps(w + t)));
        hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_loadu_ps(w + t + 8)));
    }
    _mm512_storeu_pd(acc, lo);
    _mm512_storeu_pd(acc + 8, hi);
#elif defined(__AVX2__)
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd(), a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
    for (; t + SUM_LANES <= n; t += SUM_LANES) {
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm_loadu_ps(w + t)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm_loadu_ps(w + t + 4)));
        a2 = _mm256_add_pd(a2, _mm256_cvtps_pd(_mm_loadu_ps(w + t + 8)));
        a3 = _mm256_add_pd(a3, _mm256_cvtps_pd(_mm_loadu_ps(w + t + 12)));
    }
    _mm256_storeu_pd(acc, a0);
    _mm256_storeu_pd(acc + 4, a1);
    _mm256_storeu_pd(acc + 8, a2);
    _mm256_storeu_pd(acc + 12, a3);
#elif defined(__aarch64__) && defined(__ARM_NEON)
    float64x2_t v[8];
    for (int i = 0; i < 8; i++) v[i] = vdupq_n_f64(0.0);
    for (; t + SUM_LANES <= n; t += SUM_LANES) {
        for (int i = 0; i < 4; i++) {
            const float32x4_t x = vld1q_f32(w + t + 4 * i);
            v[2 * i] = vaddq_f64(v[2 * i], vcvt_f64_f32(vget_low_f32(x)));
            v[2 * i + 1] = vaddq_f64(v[2 * i + 1], vcvt_high_f64_f32(x));
        }
    }
    for (int i = 0; i < 8; i++) vst1q_f64(acc + 2 * i, v[i]);
#else
    for (; t + SUM_LANES <= n; t += SUM_LANES)
        for (int l = 0; l < SUM_LANES; l++) acc[l] += (double)w[t + l];
#endif
    double sum = lane_tree(acc);
    for (; t < n; t++) sum += (double)w[t];
    return sum;
}

/* `block_sum` of exp_nonpositive(x[i] - m) for i in [0, n), the exps made
 * as they are summed (the same numbers, the same order). */
static double block_exp_sum(const float *x, float m, int64_t n) {
    double acc[SUM_LANES] = {0};
    int64_t t = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(m);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (; t + SUM_LANES <= n; t += SUM_LANES) {
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(x + t), mv));
        lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    _mm512_storeu_pd(acc, lo);
    _mm512_storeu_pd(acc + 8, hi);
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 mv = _mm256_set1_ps(m);
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd(), a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
    for (; t + SUM_LANES <= n; t += SUM_LANES) {
        const __m256 e0 = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(x + t), mv));
        const __m256 e1 = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(x + t + 8), mv));
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(e0)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(e0, 1)));
        a2 = _mm256_add_pd(a2, _mm256_cvtps_pd(_mm256_castps256_ps128(e1)));
        a3 = _mm256_add_pd(a3, _mm256_cvtps_pd(_mm256_extractf128_ps(e1, 1)));
    }
    _mm256_storeu_pd(acc, a0);
    _mm256_storeu_pd(acc + 4, a1);
    _mm256_storeu_pd(acc + 8, a2);
    _mm256_storeu_pd(acc + 12, a3);
#else
    for (; t + SUM_LANES <= n; t += SUM_LANES)
        for (int l = 0; l < SUM_LANES; l++) acc[l] += (double)exp_nonpositive(x[t + l] - m);
#endif
    double sum = lane_tree(acc);
    for (; t < n; t++) sum += (double)exp_nonpositive(x[t] - m);
    return sum;
}

/* exp_nonpositive(x[i] - shift) for i in [0, n). */
static void exp_row(const float *x, float shift, float *out, int64_t n) {
    int64_t t = 0;
#if defined(__AVX512F__)
    const __m512 s = _mm512_set1_ps(shift);
    for (; t + 16 <= n; t += 16) _mm512_storeu_ps(out + t, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(x + t), s)));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 s = _mm256_set1_ps(shift);
    for (; t + 8 <= n; t += 8) _mm256_storeu_ps(out + t, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(x + t), s)));
#endif
    for (; t < n; t++) out[t] = exp_nonpositive(x[t] - shift);
}

/* The largest entry, NaNs passed over (-inf if all are NaN): exact in any
 * order, so in 16 lanes the compiler can keep in vectors. */
static float row_max(const float *x, int64_t n) {
    float lanes[SUM_LANES];
    for (int l = 0; l < SUM_LANES; l++) lanes[l] = -INFINITY;
    int64_t t = 0;
    for (; t + SUM_LANES <= n; t += SUM_LANES)
        for (int l = 0; l < SUM_LANES; l++) lanes[l] = x[t + l] > lanes[l] ? x[t + l] : lanes[l];
    float m = -INFINITY;
    for (int l = 0; l < SUM_LANES; l++) m = lanes[l] > m ? lanes[l] : m;
    for (; t < n; t++) m = x[t] > m ? x[t] : m;
    return m;
}

void trioserve_exp_shifted(const float *x, const float *shift, float *out, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 8)
    for (int64_t r = 0; r < rows; r++) exp_row(x + r * n, shift[r], out + r * n, n);
}

void trioserve_block_sums(const float *w, double *sums, int64_t rows, int64_t n, int64_t block, int threads) {
    const int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 8)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t start = b * block, len = start + block <= n ? block : n - start;
            sums[r * blocks + b] = block_sum(w + r * n + start, len);
        }
}

/* For each row: its largest entry, and the sum of exp(x - largest) taken
 * as `trioserve_block_sums` of blocks of `block` entries, summed in order. */
void trioserve_exp_sums(const float *x, float *maxes, double *sums, int64_t rows, int64_t n, int64_t block, int threads) {
    const int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 8)
    for (int64_t r = 0; r < rows; r++) {
        const float m = row_max(x + r * n, n);
        double total = 0.0;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t start = b * block, len = start + block <= n ? block : n - start;
            total += block_exp_sum(x + r * n + start, m, len);
        }
        maxes[r] = m;
        sums[r] = total;
    }
}

/* out = (float)(((double)x - (double)largest) - lse) per row, lse being the
 * row's log of its sum (fixed_order.log_fixed). */
void trioserve_log_softmax(const float *x, const float *maxes, const double *lse, float *out, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 8)
    for (int64_t r = 0; r < rows; r++) {
        const double m = (double)maxes[r], l = lse[r];
        const float *xr = x + r * n;
        float *o = out + r * n;
        for (int64_t t = 0; t < n; t++) o[t] = (float)(((double)xr[t] - m) - l);
    }
}
