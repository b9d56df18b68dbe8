/* CPU kernels for the forward pass, each a twin of a torch reference in
 * kernels/reference.py (tests/kernels/test_native.py). Built by
 * trioserve/kernels/native_build.py with the system C compiler.
 *
 *   trioserve_decode_attention  paged attention of query rows over the block pool (decode rows and
 *                               prompt rows; its comment below has the layouts); trioserve_window_attention
 *                               the same within a sliding window
 *   trioserve_rms_norm          RMSNorm of fp32 rows, cast to the weights' dtype
 *   trioserve_add_rms_norm      the residual add, in place, then that RMSNorm
 *   trioserve_silu_mul          the MLP's silu(gate) * up (trioserve_gelu_tanh_mul: GeGLU's gelu(gate) * up)
 *   trioserve_rope_write_kv     RoPE on q and k of packed qkv rows, k and v stored in the pool
 *   trioserve_int4_matmul       decode rows times GGUF 4-bit weights (AVX-512 BF16 CPUs; at the end)
 *   trioserve_int8_matmul       rows times an 8-bit weight with a scale per output (the output head; AVX-512
 *                               BF16, AVX2, NEON or plain C, the same bits on each)
 *   trioserve_int4_q8_matmul    rows rounded to 8 bits per block times GGUF 4-bit weights with integer
 *                               dot products (AVX-512 VNNI, AVX2 with or without AVX-VNNI, NEON with sdot,
 *                               or plain C; the same bits on each; `--activations int8`), and the 6- and
 *                               8-bit codes' kernels after it, alike
 *
 * Every kernel computes a row from that row alone, so its result is the
 * same bits in any company (batch invariance). */

#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_GROUP 16

/* 64-bit ARM with the dot-product extension (armv8.2-a+dotprod: Apple M1 and
 * later, Graviton 2 and later, Ampere Altra): the integer kernels' NEON
 * builds, below each AVX2 one, with the same arithmetic and bits. */
#if defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#define NEON_DOT 1
#include <arm_neon.h>
#else
#define NEON_DOT 0
#endif

/* What this build's fast paths use, in a word (kernels/native.py `isa`). */
const char *trioserve_isa(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return "avx512-vnni";
#elif defined(__AVX512BF16__) && defined(__AVX512BW__)
    return "avx512-bf16";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__)
    return "avx2-vnni";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return "avx2";
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
    return "neon-dotprod";
#elif defined(__ARM_NEON)
    return "neon";
#else
    return "generic";
#endif
}
#define MAX_THREADS 64

/* The next panel's (or group of tiles') weights, fetched into cache a few
 * lines per block while this one's rows are computed from it: after the
 * first pass a panel is in cache and the memory would idle, and the AVX2
 * passes read each tile at a stride of three tiles, which the hardware
 * prefetchers follow less well than one stream. Changes no result. */
typedef struct {
    const char *at, *end;
    int64_t step;
} Prefetch;

static inline Prefetch prefetch_plan(const void *next, int64_t bytes, int64_t iterations) {
    Prefetch plan = {next, next ? (const char *)next + bytes : NULL, 0};
    if (next && iterations > 0) plan.step = ((bytes + iterations - 1) / iterations + 63) / 64 * 64;
    return plan;
}

static inline __attribute__((always_inline)) void prefetch_some(Prefetch *ahead) {
    for (int64_t i = 0; i < ahead->step && ahead->at < ahead->end; i += 64, ahead->at += 64) __builtin_prefetch(ahead->at, 0, 3);
}

static inline float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#include "fixed_exp.h"

static inline float lane_sum(const float *acc) {
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = acc[i] + acc[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}

typedef struct {
    const void *q, *k, *v;
    const int64_t *tables, *lens, *row_seq;
    float *out;
    int64_t heads, kv_heads, num_blocks, block_size, dim, max_blocks;
    int64_t window; /* a row of length len reads keys max(0, len - window) .. len - 1; 0: all of them */
    float scale;
    int bf16;    /* the queries: bf16, else fp32 */
    int kv_bf16; /* the pool: bf16, else fp32 (a float32 model may keep a bf16 pool) */
} Job;

/* The first key a row of `len` keys reads: 0, or the start of its window
 * (a sliding-window layer: the row at position len - 1 attends to its last
 * `window` positions). A row's scores are kept from that key on, so its
 * softmax and value sums run over the window alone. */
static inline int64_t row_first(const Job *job, int64_t len) {
    return job->window > 0 && len > job->window ? len - job->window : 0;
}

static inline float load(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* The block table of query row r: its own row of `tables`, or row
 * row_seq[r] when rows share a sequence (a prompt chunk's tokens). */
static inline const int64_t *row_table(const Job *job, int64_t r) {
    return job->tables + (job->row_seq ? job->row_seq[r] : r) * job->max_blocks;
}

/* Each of `group` score rows of `len` (scores[j * len + t]) turned into
 * probabilities in place: minus its maximum, exp, divided by its sum (in
 * 16 lanes, the fixed tree, then the tail). Not inlined, and built without
 * contraction, so every attention path rounds it alike; with AVX-512 the
 * same operations run 16 lanes at a time (the same bits: the maximum is
 * exact in any order, and exp and the sum keep their scalar operations and
 * order). */
#if defined(__AVX512F__)
#include <immintrin.h>

static __attribute__((noinline)) void softmax_rows(float *scores, int64_t len, int64_t group) {
    for (int64_t j = 0; j < group; j++) {
        float *sc = scores + j * len;
        __m512 top = _mm512_set1_ps(sc[0]);
        int64_t t = 0;
        for (; t + LANES <= len; t += LANES) top = _mm512_max_ps(top, _mm512_loadu_ps(sc + t));
        float m = _mm512_reduce_max_ps(top);
        for (; t < len; t++) m = sc[t] > m ? sc[t] : m;
        const __m512 mv = _mm512_set1_ps(m);
        __m512 lanes = _mm512_setzero_ps();
        for (t = 0; t + LANES <= len; t += LANES) {
            const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sc + t), mv));
            _mm512_storeu_ps(sc + t, e);
            lanes = _mm512_add_ps(lanes, e);
        }
        for (int64_t u = t; u < len; u++) sc[u] = exp_nonpositive(sc[u] - m);
        float spill[LANES];
        _mm512_storeu_ps(spill, lanes);
        float sum = lane_sum(spill);
        for (; t < len; t++) sum += sc[t];
        const float inv = 1.0f / sum;
        const __m512 iv = _mm512_set1_ps(inv);
        for (t = 0; t + LANES <= len; t += LANES) _mm512_storeu_ps(sc + t, _mm512_mul_ps(_mm512_loadu_ps(sc + t), iv));
        for (; t < len; t++) sc[t] *= inv;
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The scalar version's steps 8 lanes at a time (the sum in the same 16 lanes). */
static __attribute__((noinline)) void softmax_rows(float *scores, int64_t len, int64_t group) {
    for (int64_t j = 0; j < group; j++) {
        float *sc = scores + j * len;
        __m256 top = _mm256_set1_ps(sc[0]);
        int64_t t = 0;
        for (; t + 8 <= len; t += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(sc + t));
        float spill[LANES];
        _mm256_storeu_ps(spill, top);
        float m = spill[0];
        for (int i = 1; i < 8; i++) m = spill[i] > m ? spill[i] : m;
        for (; t < len; t++) m = sc[t] > m ? sc[t] : m;
        const __m256 mv = _mm256_set1_ps(m);
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        for (t = 0; t + LANES <= len; t += LANES) {
            const __m256 e0 = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), mv));
            const __m256 e1 = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sc + t + 8), mv));
            _mm256_storeu_ps(sc + t, e0);
            _mm256_storeu_ps(sc + t + 8, e1);
            lo = _mm256_add_ps(lo, e0);
            hi = _mm256_add_ps(hi, e1);
        }
        for (int64_t u = t; u < len; u++) sc[u] = exp_nonpositive(sc[u] - m);
        _mm256_storeu_ps(spill, lo);
        _mm256_storeu_ps(spill + 8, hi);
        float sum = lane_sum(spill);
        for (; t < len; t++) sum += sc[t];
        const float inv = 1.0f / sum;
        const __m256 iv = _mm256_set1_ps(inv);
        for (t = 0; t + 8 <= len; t += 8) _mm256_storeu_ps(sc + t, _mm256_mul_ps(_mm256_loadu_ps(sc + t), iv));
        for (; t < len; t++) sc[t] *= inv;
    }
}
#else
static __attribute__((noinline)) void softmax_rows(float *scores, int64_t len, int64_t group) {
    for (int64_t j = 0; j < group; j++) {
        float *sc = scores + j * len;
        float top = sc[0];
        for (int64_t t = 1; t < len; t++) top = sc[t] > top ? sc[t] : top;
        for (int64_t t = 0; t < len; t++) sc[t] = exp_nonpositive(sc[t] - top);
        float lanes[LANES] = {0};
        int64_t t = 0;
        for (; t + LANES <= len; t += LANES)
            for (int l = 0; l < LANES; l++) lanes[l] += sc[t + l];
        float sum = lane_sum(lanes);
        for (; t < len; t++) sum += sc[t];
        const float inv = 1.0f / sum;
        for (t = 0; t < len; t++) sc[t] *= inv;
    }
}
#endif

/* The attention loops may fuse multiplies and adds (the library is built
 * without contraction, for the elementwise kernels' sake); the result is
 * still fixed for a given build and CPU. */
#define ATTENTION_MATH __attribute__((optimize("fp-contract=fast")))

/* bf16 queries with head dim 64 take `tile_bf16_d64` where the CPU has
 * vdpbf16ps; the other builds compute its scores with the same arithmetic
 * (`dp_score`, `dp_scores8`), so every build gives the AVX-512 BF16 bits
 * (issue 47). vdpbf16ps adds to lane l's fp32 sum the exact product of the
 * pair's odd elements (2l + 1), then the even ones' (2l), each a fused
 * multiply-add rounded to nearest even, reading denormal inputs as zeros and
 * flushing tiny results to zeros (DAZ and FTZ, whatever MXCSR says), tiny
 * meaning below 2^-126 after rounding to 24 bits (x86's rule). Checked
 * against the instruction on an AMD Zen 4 with 3 x 10^7 random lanes (tiny
 * and denormal operands included) and crafted cases at 2^-126. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_DOT_HW 1
#else
#define BF16_DOT_HW 0
#endif
/* |x| of a bf16 from 2^-56 (biased exponent 71) to below 2^63 (190), as bits. */
#define DP_TINY (71 << 7)
#define DP_HUGE (190 << 7)

/* A bf16 input as vdpbf16ps reads it (a denormal is a zero of its sign). */
static inline ATTENTION_MATH float dp_in(uint16_t b) { return bf16_to_float((b & 0x7F80) ? b : (uint16_t)(b & 0x8000)); }

/* One of its multiply-adds: c + a b rounded once, a tiny result flushed.
 * fmaf rounds a result below 2^-126 to the denormals' grid instead, which
 * decides tininess alike except where it lands on 2^-126 itself; then the
 * sum is redone scaled by 2^64 (exact: such a sum's terms are both below
 * 2^-100, and b, when not zero, at least 2^-126). c is never denormal. */
static inline ATTENTION_MATH float dp_fma(float a, float b, float c) {
    const float r = fmaf(a, b, c);
    if (!(fabsf(r) <= 0x1p-126f)) return r;
    if (fabsf(r) < 0x1p-126f) return copysignf(0.0f, r);
    return fabsf(fmaf(a * 0x1p64f, b, c * 0x1p64f)) < 0x1p-62f ? copysignf(0.0f, r) : r;
}

/* Whether bf16 values hold a nonzero one outside [2^-56, 2^63) (denormals,
 * infinities and NaNs included). Where neither the queries nor a key do,
 * every product of two of them is exact in fp32 and a multiple of 2^-126,
 * so each sum of them is zero or at least 2^-126: DAZ and FTZ change
 * nothing, and a fused multiply-add is that product then a sum. */
static inline ATTENTION_MATH int dp_outside(const uint16_t *x, int64_t n) {
    int outside = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t m = x[i] & 0x7FFF;
        outside |= m && (uint16_t)(m - DP_TINY) >= DP_HUGE - DP_TINY;
    }
    return outside;
}

/* q . k of bf16 vectors of 64 as `tile_bf16_d64` computes it: lane l of 16
 * sums pairs (2l, 2l + 1) then (32 + 2l, 33 + 2l) by vdpbf16ps's fused
 * multiply-adds, odd element first (with DAZ and FTZ where `exact`; else,
 * `dp_outside` having found no value that needs them, each a product and a
 * sum, which the plain C build computes fast), the lanes by `lane_sum`'s
 * tree (which is `sum16`'s for each key), then times the scale. */
static inline ATTENTION_MATH float dp_score(const uint16_t *q, const uint16_t *k, float scale, const int exact) {
    float lanes[LANES];
    for (int l = 0; l < LANES; l++) {
        float acc = 0.0f;
        for (int h = 0; h < 64; h += 32) {
            const int o = h + 2 * l + 1, e = h + 2 * l;
            if (exact) {
                acc = dp_fma(dp_in(k[o]), dp_in(q[o]), acc);
                acc = dp_fma(dp_in(k[e]), dp_in(q[e]), acc);
            } else {
                acc += bf16_to_float(k[o]) * bf16_to_float(q[o]);
                acc += bf16_to_float(k[e]) * bf16_to_float(q[e]);
            }
        }
        lanes[l] = acc;
    }
    return lane_sum(lanes) * scale;
}

/* One (row s, KV head g) item's scores by `dp_score` of keys first .. len - 1,
 * scores[j * (len - first) + t - first]. */
static inline ATTENTION_MATH void dp_scores(const Job *job, int64_t s, int64_t g, const int64_t *table, int64_t first, int64_t len,
                                            int64_t group, float *scores) {
    const int64_t bs = job->block_size, n = len - first;
    const uint16_t *q = (const uint16_t *)job->q + (s * job->heads + g * group) * 64;
    const int odd_q = dp_outside(q, group * 64);
    for (int64_t t = first; t < len; t++) {
        const uint16_t *key = (const uint16_t *)job->k + ((g * job->num_blocks + table[t / bs]) * bs + t % bs) * 64;
        const int exact = odd_q || dp_outside(key, 64);
        for (int64_t j = 0; j < group; j++) scores[j * n + t - first] = dp_score(q + j * 64, key, job->scale, exact);
    }
}

static inline float g_fma(float a, float b, float c); /* fmaf's bits, inline in every build (with the integer kernels) */

/* One (query row, KV head) item. Always inlined into `run_item`'s cases, so
 * for the common shapes dim and group are constants and the compiler keeps
 * the accumulators in vector registers. The builds without AVX2 (plain C,
 * ARM): `item_body8`'s operations one lane at a time, every product fused
 * (`g_fma`), so they give its bits; bf16 queries of head dim 64 score by
 * `dp_scores`, as the AVX-512 BF16 tiles do. */
static inline __attribute__((always_inline)) ATTENTION_MATH void item_body(const Job *job, int64_t item, float *scores, const int64_t dim,
                                                           const int64_t group, const int bf16, const int kv_bf16) {
    const int64_t bs = job->block_size;
    const int64_t s = item / job->kv_heads, g = item % job->kv_heads;
    const int64_t len = job->lens[s], first = row_first(job, len), n = len - first;
    const int64_t *table = row_table(job, s);
    float qf[MAX_GROUP][LANES * 16], kf[LANES * 16], acc[MAX_GROUP][LANES * 16];
    if (!BF16_DOT_HW && bf16 && dim == 64) {
        dp_scores(job, s, g, table, first, len, group, scores);
    } else {
        for (int64_t j = 0; j < group; j++)
            for (int64_t d = 0; d < dim; d++) qf[j][d] = load(job->q, (s * job->heads + g * group + j) * dim + d, bf16) * job->scale;
        for (int64_t t = first; t < len; t++) {
            const int64_t at = ((g * job->num_blocks + table[t / bs]) * bs + t % bs) * dim;
            for (int64_t d = 0; d < dim; d++) kf[d] = load(job->k, at + d, kv_bf16);
            for (int64_t j = 0; j < group; j++) {
                float lanes[LANES] = {0};
                for (int64_t d0 = 0; d0 < dim; d0 += LANES)
                    for (int l = 0; l < LANES; l++) lanes[l] = g_fma(qf[j][d0 + l], kf[d0 + l], lanes[l]);
                scores[j * n + t - first] = lane_sum(lanes);
            }
        }
    }
    softmax_rows(scores, n, group);
    for (int64_t j = 0; j < group; j++)
        for (int64_t d = 0; d < dim; d++) acc[j][d] = 0.0f;
    for (int64_t t = first; t < len; t++) {
        const int64_t at = ((g * job->num_blocks + table[t / bs]) * bs + t % bs) * dim;
        for (int64_t d = 0; d < dim; d++) kf[d] = load(job->v, at + d, kv_bf16);
        for (int64_t j = 0; j < group; j++) {
            const float p = scores[j * n + t - first];
            for (int64_t d = 0; d < dim; d++) acc[j][d] = g_fma(p, kf[d], acc[j][d]);
        }
    }
    for (int64_t j = 0; j < group; j++)
        memcpy(job->out + (s * job->heads + g * group + j) * dim, acc[j], (size_t)dim * sizeof(float));
}

#if defined(__AVX2__) && defined(__FMA__)
/* `item_body` with 256-bit registers, for every x86 build with AVX2 and FMA
 * (so the AVX2 and AVX-512 builds give the same bits): each score is 16
 * lanes of fused products over the head dim (lanes 0-7 and 8-15 in two
 * registers) and the fixed tree `lane_sum` uses; each value sum is one fused
 * chain per output lane, keys in order. A row's result depends on that row
 * alone. bf16 queries of head dim 64 (in builds without vdpbf16ps) score by
 * `dp_key8`, as the AVX-512 BF16 tiles do; their values are summed as
 * here, which is also the tiles' order. */
#define VECTOR_ITEMS 1
static inline __m256 kv8(const void *base, int64_t at, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)base + at);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* `dp_score` of one key for a KV head's `group` query heads (q, split by
 * `item_body8` into odd and even elements qo, qe), out[j * stride]: the
 * key's 64 values as four vectors of 16 bf16, each split likewise into fp32
 * (exact), lanes 0-7 summed in one register (dims 0-15, then 32-47) and
 * 8-15 in another (16-31, 48-63), each pair's odd product first; then
 * `lane_sum`'s tree and the scale. A key with a nonzero value below 2^-56
 * (tested on 16-bit lanes; large ones need nothing here, the products being
 * fused), or queries with one outside `dp_outside`'s range, take
 * `dp_score`'s exact path. */
static inline __attribute__((always_inline)) ATTENTION_MATH void dp_key8(const uint16_t *q, __m256 (*qo)[4], __m256 (*qe)[4],
                                                                         const int tiny_q, const uint16_t *key, const int64_t group,
                                                                         const float scale, float *out, const int64_t stride) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u), one = _mm256_set1_epi16(1), limit = _mm256_set1_epi16(2 * DP_TINY - 1);
    __m256 ko[4], ke[4];
    __m256i low = limit; /* 2 |x| - 1 as 16 bits, least: zero wraps to the top */
    for (int c = 0; c < 4; c++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(key + 16 * c));
        ko[c] = _mm256_castsi256_ps(_mm256_and_si256(x, high));
        ke[c] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        low = _mm256_min_epu16(low, _mm256_sub_epi16(_mm256_add_epi16(x, x), one));
    }
    const __m256i under = _mm256_subs_epu16(limit, low);
    if (tiny_q || !_mm256_testz_si256(under, under)) {
        for (int64_t j = 0; j < group; j++) out[j * stride] = dp_score(q + j * 64, key, scale, 1);
        return;
    }
    for (int64_t j = 0; j < group; j++) {
        __m256 a = _mm256_fmadd_ps(ko[0], qo[j][0], _mm256_setzero_ps()), b = _mm256_fmadd_ps(ko[1], qo[j][1], _mm256_setzero_ps());
        a = _mm256_fmadd_ps(ke[0], qe[j][0], a);
        b = _mm256_fmadd_ps(ke[1], qe[j][1], b);
        a = _mm256_fmadd_ps(ko[2], qo[j][2], a);
        b = _mm256_fmadd_ps(ko[3], qo[j][3], b);
        a = _mm256_fmadd_ps(ke[2], qe[j][2], a);
        b = _mm256_fmadd_ps(ke[3], qe[j][3], b);
        const __m256 s8 = _mm256_add_ps(a, b);
        const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
        const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        out[j * stride] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1))) * scale;
    }
}

static inline __attribute__((always_inline)) ATTENTION_MATH void item_body8(const Job *job, int64_t item, float *scores,
                                                                            const int64_t dim, const int64_t group,
                                                                            const int bf16, const int kv_bf16) {
    const int64_t bs = job->block_size;
    const int64_t s = item / job->kv_heads, g = item % job->kv_heads;
    const int64_t len = job->lens[s], first = row_first(job, len), n = len - first;
    const int64_t *table = row_table(job, s);
    float qf[MAX_GROUP][LANES * 16] __attribute__((aligned(32)));
    /* bf16 queries of head dim 64: the AVX-512 BF16 tiles' scores (`dp_key8`) */
    const int dp = !BF16_DOT_HW && bf16 && dim == 64;
    const uint16_t *qh = (const uint16_t *)job->q + (s * job->heads + g * group) * dim;
    __m256 qo[MAX_GROUP][4], qe[MAX_GROUP][4];
    int tiny_q = 0;
    if (dp) {
        tiny_q = dp_outside(qh, group * 64);
        for (int64_t j = 0; j < group; j++)
            for (int c = 0; c < 4; c++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(qh + j * 64 + 16 * c));
                qo[j][c] = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
                qe[j][c] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
            }
    } else {
        for (int64_t j = 0; j < group; j++)
            for (int64_t d = 0; d < dim; d++) qf[j][d] = load(job->q, (s * job->heads + g * group + j) * dim + d, bf16) * job->scale;
    }
    const int64_t es = kv_bf16 ? 2 : 4, lines = (bs * dim * es + 63) / 64;
    /* Keys first .. len - 1, block by block; a key's scores at t - first. */
    for (int64_t t0 = first - first % bs; t0 < len; t0 += bs) {
        const int64_t base = (g * job->num_blocks + table[t0 / bs]) * bs * dim;
        const int64_t end = len - t0 < bs ? len - t0 : bs, from = first > t0 ? first - t0 : 0;
        /* The blocks lie apart in the pool, so the hardware's prefetchers
         * stop at each: the next block's keys and this block's values are
         * fetched a few lines a key (the values for the loop below). */
        const char *k_next = t0 + bs < len ? (const char *)job->k + (g * job->num_blocks + table[t0 / bs + 1]) * bs * dim * es : NULL;
        const char *v_here = (const char *)job->v + base * es;
        const int64_t per_key = (lines + end - from - 1) / (end - from);
        for (int64_t u = from; u < end; u++) {
            const int64_t at = base + u * dim;
            for (int64_t i = (u - from) * per_key; i < (u - from + 1) * per_key && i < lines; i++) {
                if (k_next) __builtin_prefetch(k_next + i * 64, 0, 3);
                __builtin_prefetch(v_here + i * 64, 0, 2);
            }
            if (dp) {
                dp_key8(qh, qo, qe, tiny_q, (const uint16_t *)job->k + at, group, job->scale, scores + t0 + u - first, n);
                continue;
            }
            for (int64_t j = 0; j < group; j++) {
                __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
                for (int64_t d0 = 0; d0 < dim; d0 += LANES) {
                    lo = _mm256_fmadd_ps(_mm256_load_ps(qf[j] + d0), kv8(job->k, at + d0, kv_bf16), lo);
                    hi = _mm256_fmadd_ps(_mm256_load_ps(qf[j] + d0 + 8), kv8(job->k, at + d0 + 8, kv_bf16), hi);
                }
                const __m256 s8 = _mm256_add_ps(lo, hi);
                const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
                const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
                scores[j * n + t0 + u - first] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
            }
        }
    }
    softmax_rows(scores, n, group);
    /* Values, 16 output lanes at a time (8 where many heads share the KV head). */
    const int64_t width = group <= 6 ? 16 : 8;
    for (int64_t d0 = 0; d0 < dim; d0 += width) {
        __m256 acc[MAX_GROUP][2];
        for (int64_t j = 0; j < group; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (int64_t t0 = first - first % bs; t0 < len; t0 += bs) {
            const int64_t base = (g * job->num_blocks + table[t0 / bs]) * bs * dim + d0;
            const int64_t end = len - t0 < bs ? len - t0 : bs;
            for (int64_t u = first > t0 ? first - t0 : 0; u < end; u++) {
                const __m256 v0 = kv8(job->v, base + u * dim, kv_bf16);
                const __m256 v1 = width == 16 ? kv8(job->v, base + u * dim + 8, kv_bf16) : v0;
                for (int64_t j = 0; j < group; j++) {
                    const __m256 p = _mm256_set1_ps(scores[j * n + t0 + u - first]);
                    acc[j][0] = _mm256_fmadd_ps(p, v0, acc[j][0]);
                    if (width == 16) acc[j][1] = _mm256_fmadd_ps(p, v1, acc[j][1]);
                }
            }
        }
        for (int64_t j = 0; j < group; j++) {
            float *o = job->out + (s * job->heads + g * group + j) * dim + d0;
            _mm256_storeu_ps(o, acc[j][0]);
            if (width == 16) _mm256_storeu_ps(o + 8, acc[j][1]);
        }
    }
}
#else
#define VECTOR_ITEMS 0
#endif

/* Rows of one sequence taken together by the bf16 path (they share the
 * loads of its keys and values; each row's arithmetic is its own). */
#define TILE_ROWS 8
/* Query heads whose value sums share one widened value row. */
#define VALUE_SET 6
/* How many keys ahead the bf16 path fetches keys and values into cache. */
#define KV_AHEAD 32

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FAST_TILES 1

static inline __m512 bf16x16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Sixteen vectors to one: lane u of the result is the sum of all lanes of
 * v[(u % 4) * 4 + u / 4] (callers store key u's vector there), by a fixed
 * tree: 128-bit quarters, then halves, then pairs of lanes, then lanes. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 *v) {
    __m512 x[8], y[4], z[2];
    for (int p = 0; p < 8; p++)
        x[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44), _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; p++)
        y[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0x88), _mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; p++)
        z[p] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * p], y[2 * p + 1], 0x44), _mm512_shuffle_ps(y[2 * p], y[2 * p + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
}

/* Walks one sequence's rows of a KV head in the pool, key by key, with no
 * division per key (the block size is not a constant here, and a 64-bit
 * division per key and query head had cost more than the arithmetic). */
typedef struct {
    const uint16_t *cache, *base;
    const int64_t *table;
    int64_t stride, bs, block, off;
} KvCursor;

static inline KvCursor kv_cursor(const uint16_t *cache, const Job *job, const int64_t *table, int64_t g, int64_t t) {
    KvCursor c = {cache + g * job->num_blocks * job->block_size * 64, NULL, table, job->block_size * 64,
                  job->block_size, t / job->block_size, t % job->block_size};
    c.base = c.cache + table[c.block] * c.stride;
    return c;
}

static inline const uint16_t *kv_at(const KvCursor *c) { return c->base + c->off * 64; }

/* To the next key; `more` says whether it exists (a table entry past the
 * sequence's last block is never read). */
static inline void kv_next(KvCursor *c, int more) {
    if (++c->off == c->bs) {
        c->off = 0;
        c->block++;
        if (more) c->base = c->cache + c->table[c->block] * c->stride;
    }
}

/* bf16, head dim 64: rows r0 .. r0 + n - 1 (one sequence) and KV head g.
 * Scores: per query head, q . k by vdpbf16ps (exact products of the bf16
 * values, lanes summing pairs (2l, 2l + 1) of the first 32 dims then of the
 * last 32), the 16 lanes summed by `sum16` sixteen keys at a time, then
 * times the scale. Then `softmax_rows`, then the values weighted key by key
 * in fp32 fused multiply-adds. A row's keys, order and operations depend on
 * its own length alone, never on n or its tile-mates. With a window, a row
 * scores keys from its `row_first` on (scores[x * most + t - first]); the
 * tile walks the keys from its rows' earliest first, which the callers keep
 * a run of keys with no gap (`trioserve_window_attention`'s tiles). */
static ATTENTION_MATH void tile_bf16_d64(const Job *job, int64_t r0, int64_t n, int64_t g, float *scores, int64_t most) {
    const int64_t group = job->heads / job->kv_heads, vectors = n * group;
    const int64_t *table = row_table(job, r0);
    const uint16_t *q = (const uint16_t *)job->q, *kc = (const uint16_t *)job->k, *vc = (const uint16_t *)job->v;
    const __m512 scale = _mm512_set1_ps(job->scale);
    int64_t longest = 0, start = INT64_MAX;
    for (int64_t i = 0; i < n; i++) {
        const int64_t len = job->lens[r0 + i], first = row_first(job, len);
        longest = len > longest ? len : longest;
        start = first < start ? first : start;
    }
    for (int64_t t0 = start; t0 < longest; t0 += 16) {
        /* Keys two blocks of 16 ahead, into cache while these are scored
         * (blocks lie scattered, so the hardware's stride prefetch stops at
         * each block's end). */
        if (t0 + KV_AHEAD < longest) {
            KvCursor ahead = kv_cursor(kc, job, table, g, t0 + KV_AHEAD);
            for (int64_t t = t0 + KV_AHEAD; t < t0 + KV_AHEAD + 16 && t < longest; t++) {
                const char *key = (const char *)kv_at(&ahead);
                _mm_prefetch(key, _MM_HINT_T0);
                _mm_prefetch(key + 64, _MM_HINT_T0);
                kv_next(&ahead, t + 1 < longest);
            }
        }
        const uint16_t *keys[16];
        {
            KvCursor at = kv_cursor(kc, job, table, g, t0);
            for (int u = 0; u < 16; u++) {
                keys[u] = t0 + u < longest ? kv_at(&at) : NULL;
                kv_next(&at, t0 + u + 1 < longest);
            }
        }
        for (int64_t x = 0; x < vectors; x++) {
            const int64_t i = x / group, j = x % group, len = job->lens[r0 + i], first = row_first(job, len);
            if (t0 >= len || t0 + 16 <= first) continue;
            const uint16_t *qrow = q + ((r0 + i) * job->heads + g * group + j) * 64;
            const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qrow), q1 = (__m512bh)_mm512_loadu_si512(qrow + 32);
            __m512 part[16];
            for (int u = 0; u < 16; u++) {
                const int at = (u % 4) * 4 + u / 4;
                if (t0 + u >= first && t0 + u < len) {
                    const uint16_t *key = keys[u];
                    part[at] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(key), q0),
                                                (__m512bh)_mm512_loadu_si512(key + 32), q1);
                } else {
                    part[at] = _mm512_setzero_ps();
                }
            }
            const __m512 sc = _mm512_mul_ps(sum16(part), scale);
            const int64_t left = len - t0;
            if (t0 >= first) {
                _mm512_mask_storeu_ps(scores + x * most + t0 - first, left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1), sc);
            } else { /* the window starts inside these 16 keys */
                float lanes[16];
                _mm512_storeu_ps(lanes, sc);
                memcpy(scores + x * most, lanes + (first - t0), (size_t)((left < 16 ? left : 16) - (first - t0)) * sizeof(float));
            }
        }
    }
    for (int64_t x = 0; x < vectors; x++) {
        const int64_t len = job->lens[r0 + x / group];
        softmax_rows(scores + x * most, len - row_first(job, len), 1);
    }
    for (int64_t x0 = 0; x0 < vectors; x0 += VALUE_SET) {
        const int64_t m = vectors - x0 < VALUE_SET ? vectors - x0 : VALUE_SET;
        __m512 acc[VALUE_SET][4];
        int64_t len[VALUE_SET], lo[VALUE_SET], upto = 0, from = INT64_MAX;
        for (int64_t y = 0; y < m; y++) {
            for (int c = 0; c < 4; c++) acc[y][c] = _mm512_setzero_ps();
            len[y] = job->lens[r0 + (x0 + y) / group];
            lo[y] = row_first(job, len[y]);
            upto = len[y] > upto ? len[y] : upto;
            from = lo[y] < from ? lo[y] : from;
        }
        KvCursor at = kv_cursor(vc, job, table, g, from), ahead = at;
        if (from + KV_AHEAD < upto) ahead = kv_cursor(vc, job, table, g, from + KV_AHEAD);
        for (int64_t t = from; t < upto; t++) {
            if (t + KV_AHEAD < upto) {
                const char *far = (const char *)kv_at(&ahead);
                _mm_prefetch(far, _MM_HINT_T0);
                _mm_prefetch(far + 64, _MM_HINT_T0);
                kv_next(&ahead, t + KV_AHEAD + 1 < upto);
            }
            const uint16_t *val = kv_at(&at);
            kv_next(&at, t + 1 < upto);
            const __m512 v0 = bf16x16(val), v1 = bf16x16(val + 16), v2 = bf16x16(val + 32), v3 = bf16x16(val + 48);
            for (int64_t y = 0; y < m; y++) {
                if (t < lo[y] || t >= len[y]) continue;
                const __m512 p = _mm512_set1_ps(scores[(x0 + y) * most + t - lo[y]]);
                acc[y][0] = _mm512_fmadd_ps(p, v0, acc[y][0]);
                acc[y][1] = _mm512_fmadd_ps(p, v1, acc[y][1]);
                acc[y][2] = _mm512_fmadd_ps(p, v2, acc[y][2]);
                acc[y][3] = _mm512_fmadd_ps(p, v3, acc[y][3]);
            }
        }
        for (int64_t y = 0; y < m; y++) {
            const int64_t x = x0 + y, i = x / group, j = x % group;
            float *o = job->out + ((r0 + i) * job->heads + g * group + j) * 64;
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + 16 * c, acc[y][c]);
        }
    }
}
#else
#define FAST_TILES 0
#endif

/* The same arithmetic for every shape; the cases only let the compiler
 * specialize the loops (a row's bits do not depend on which case runs,
 * since every shape takes exactly one). */
#if VECTOR_ITEMS
#define ITEM_BODY item_body8
#else
#define ITEM_BODY item_body
#endif
#define CASE(D, G)                                                                  \
    if (dim == D && group == G) {                                                   \
        if (job->bf16) ITEM_BODY(job, item, scores, D, G, 1, 1);                     \
        else if (job->kv_bf16) ITEM_BODY(job, item, scores, D, G, 0, 1);             \
        else ITEM_BODY(job, item, scores, D, G, 0, 0);                               \
        return;                                                                     \
    }

static ATTENTION_MATH void run_item(const Job *job, int64_t item, float *scores) {
    const int64_t dim = job->dim, group = job->heads / job->kv_heads;
    CASE(64, 1) CASE(64, 2) CASE(64, 3) CASE(64, 4) CASE(64, 8)
    CASE(128, 1) CASE(128, 2) CASE(128, 4) CASE(128, 8)
    if (job->bf16) ITEM_BODY(job, item, scores, dim, group, 1, 1);
    else if (job->kv_bf16) ITEM_BODY(job, item, scores, dim, group, 0, 1);
    else ITEM_BODY(job, item, scores, dim, group, 0, 0);
}

/* Attention of query rows to cached keys and values, read where they lie
 * in the block pool. Row r attends to the first lens[r] keys of block
 * table row_seq[r] (row r itself when row_seq is NULL: one decode token per
 * sequence); a prompt chunk's rows share their sequence's table, each with
 * its own length (its position + 1).
 *
 * Layouts (all contiguous, row-major):
 *   q        [R, H, D]            the rows' queries (after RoPE)
 *   k, v     [KVH, NB, BS, D]     one layer of the block pool (bf16 when kv_bf16: a
 *                                 float32 model's pool may be bf16; bf16 queries need one)
 *   tables   [S, MB] int64        block ids per sequence (padded entries unread)
 *   row_seq  [R] int64 or NULL    each row's table
 *   lens     [R] int64            keys each row attends to
 *   out      [R, H, D] float32
 * Query head h reads KV head h / (H / KVH).
 *
 * Arithmetic: each (row, KV head) is computed from that row's query, keys
 * and values alone, in an order fixed by its own length: bf16 with head
 * dim 64 by `tile_bf16_d64` (rows of one sequence in tiles that share
 * loads; where the CPU lacks vdpbf16ps, its arithmetic by `dp_score`),
 * every other shape by `item_body` (fp32 dot products, fused in every
 * build, summed in 16 lanes then a fixed tree): the same bits at every
 * level and on ARM. Nothing depends
 * on the other rows, how many there are, which tile a row falls in, how
 * the work is split between threads, or the padding of the tables, so a
 * row's result is the same bits in any company (batch invariance).
 *
 * Returns 0 on success, 1 on a shape this kernel does not take (head dim
 * not a multiple of 16 or above 256, more than 16 query heads per KV head),
 * 2 when memory could not be had, 3 when a length, table row or block id
 * would read outside the pool. threads: at most this many, from the OpenMP
 * runtime torch itself runs on (the library links the libgomp torch has
 * loaded, so no second pool competes for the cores); small calls run on
 * the caller's thread alone. Which thread computes an item changes
 * nothing.
 *
 * `trioserve_window_attention` is the same with a sliding window (window > 0,
 * Gemma 3's local layers, Mistral, Phi-3): row r reads only its last
 * `window` keys, max(0, lens[r] - window) .. lens[r] - 1 (the row at
 * position p attends to positions p - window + 1 .. p), and its softmax and
 * value sums run over those alone, in the order above; blocks before a
 * row's window are neither read nor checked. window 0: every key, the bits
 * of `trioserve_decode_attention`. */
int trioserve_window_attention(const void *q, const void *k, const void *v, const int64_t *tables, const int64_t *row_seq,
                               const int64_t *lens, float *out, int64_t rows, int64_t num_tables, int64_t heads,
                               int64_t kv_heads, int64_t num_blocks, int64_t block_size, int64_t dim, int64_t max_blocks,
                               int64_t window, float scale, int bf16, int kv_bf16, int threads) {
    if (dim % LANES || dim > LANES * 16 || kv_heads <= 0 || heads % kv_heads || heads / kv_heads > MAX_GROUP || window < 0)
        return 1;
    if (bf16 && !kv_bf16) return 1; /* bf16 queries read a bf16 pool */
    const Job job = {q, k, v, tables, lens, row_seq, out, heads, kv_heads, num_blocks, block_size, dim, max_blocks, window, scale, bf16, kv_bf16};
    int64_t most = 1, work = 0;
    for (int64_t r = 0; r < rows; r++) { /* nothing is read outside the pool */
        if (row_seq && (row_seq[r] < 0 || row_seq[r] >= num_tables)) return 3;
        if (!row_seq && r >= num_tables) return 3;
        if (lens[r] < 1 || lens[r] > max_blocks * block_size) return 3;
        const int64_t *table = row_table(&job, r), first = row_first(&job, lens[r]);
        for (int64_t b = first / block_size; b * block_size < lens[r]; b++)
            if (table[b] < 0 || table[b] >= num_blocks) return 3;
        most = lens[r] - first > most ? lens[r] - first : most;
        work += lens[r] - first;
    }
    const int64_t group = heads / kv_heads;
    const int fast = FAST_TILES && bf16 && dim == 64;
    /* Work items: (tile, KV head). A tile is up to TILE_ROWS consecutive
     * rows of one sequence on the fast path, one row otherwise; with a
     * window, only rows whose keys leave no gap in the tile's (whose table
     * entries between are then all checked above). */
    int64_t *starts = (int64_t *)malloc(sizeof(int64_t) * (size_t)(rows + 1));
    if (starts == NULL) return 2;
    int64_t tiles = 0, tile_first = 0, tile_end = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t first = row_first(&job, lens[r]);
        const int joins = fast && tiles > 0 && r - starts[tiles - 1] < TILE_ROWS && row_seq && row_seq[r] == row_seq[r - 1] &&
                          first <= tile_end && lens[r] >= tile_first;
        if (!joins) {
            starts[tiles++] = r;
            tile_first = first, tile_end = lens[r];
        } else {
            tile_first = first < tile_first ? first : tile_first;
            tile_end = lens[r] > tile_end ? lens[r] : tile_end;
        }
    }
    starts[tiles] = rows;
    const int64_t items = tiles * kv_heads, per_item = (fast ? TILE_ROWS : 1) * group * most;
    int n = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
    if (work * group * kv_heads * dim < ((int64_t)1 << 16)) n = 1; /* waking threads would cost more than it saves */
    if (n > items) n = (int)items;
    float *scores = (float *)malloc(sizeof(float) * (size_t)(n * per_item));
    if (scores == NULL) {
        free(starts);
        return 2;
    }
    /* dynamic: a prompt's later tiles attend to more keys than its first */
#pragma omp parallel for num_threads(n) schedule(dynamic, 1) if (n > 1)
    for (int64_t item = 0; item < items; item++) {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        float *mine = scores + (size_t)me * per_item;
        const int64_t tile = item / kv_heads, g = item % kv_heads;
#if FAST_TILES
        if (fast) {
            tile_bf16_d64(&job, starts[tile], starts[tile + 1] - starts[tile], g, mine, most);
            continue;
        }
#endif
        run_item(&job, starts[tile] * kv_heads + g, mine);
    }
    free(starts);
    free(scores);
    return 0;
}

int trioserve_decode_attention(const void *q, const void *k, const void *v, const int64_t *tables, const int64_t *row_seq,
                               const int64_t *lens, float *out, int64_t rows, int64_t num_tables, int64_t heads,
                               int64_t kv_heads, int64_t num_blocks, int64_t block_size, int64_t dim, int64_t max_blocks,
                               float scale, int bf16, int kv_bf16, int threads) {
    return trioserve_window_attention(q, k, v, tables, row_seq, lens, out, rows, num_tables, heads, kv_heads, num_blocks,
                                      block_size, dim, max_blocks, 0, scale, bf16, kv_bf16, threads);
}

/* fp32 -> bf16, round to nearest even, as torch casts (NaN stays NaN).
 * Branch-free, so loops that call it vectorize. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet = (bits >> 16) | 0x40u;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

static inline void store(void *base, int64_t i, float f, int bf16) {
    if (bf16) ((uint16_t *)base)[i] = float_to_bf16(f);
    else ((float *)base)[i] = f;
}

/* A bf16 copy of n inputs (rounded as torch casts when they are fp32), or
 * NULL when memory cannot be had. */
static __attribute__((unused)) uint16_t *bf16_rows(const void *x, int64_t n, int x_bf16) {
    uint16_t *xh = malloc((size_t)n * sizeof *xh + 1);
    if (!xh) return NULL;
    if (x_bf16) memcpy(xh, x, (size_t)n * sizeof *xh);
    else
        for (int64_t i = 0; i < n; i++) xh[i] = float_to_bf16(((const float *)x)[i]);
    return xh;
}

/* Scratch for a kernel with int8 activations: x rounded to bf16, its bytes
 * xq, and per block of 32 its step xd and `sums` exact input sums xs. */
typedef struct {
    uint16_t *xh;
    int8_t *xq;
    float *xd, *xs;
} Q8Scratch;

static void q8_scratch_free(Q8Scratch *s) { free(s->xh), free(s->xq), free(s->xd), free(s->xs); }

/* 0, or 2 when memory cannot be had (nothing left allocated). */
static __attribute__((unused)) int q8_scratch(Q8Scratch *s, const void *x, int64_t rows, int64_t k, int x_bf16, int sums) {
    const int64_t nb = k / 32;
    s->xh = bf16_rows(x, rows * k, x_bf16);
    s->xq = malloc((size_t)(rows * k) + 1);
    s->xd = malloc((size_t)(rows * nb) * sizeof(float) + 1);
    s->xs = malloc((size_t)(rows * nb * sums) * sizeof(float) + 1);
    if (!s->xh || !s->xq || !s->xd || !s->xs) {
        q8_scratch_free(s);
        return 2;
    }
    return 0;
}

/* Rows at or above this many go to the OpenMP threads (a row's result never
 * depends on which thread computes it). */
#define PARALLEL_ROWS 64

static inline __attribute__((always_inline)) void rms_norm_row(const float *row, const float *weight, void *out, int64_t r,
                                                              int64_t n, float eps, const int bf16) {
    float lanes[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] += row[i + l] * row[i + l];
    float sum = lane_sum(lanes);
    for (; i < n; i++) sum += row[i] * row[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (i = 0; i < n; i++) store(out, r * n + i, row[i] * inv * weight[i], bf16);
}

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, in fp32, stored as
 * bf16 (bf16 = 1) or fp32. x [rows, n] and weight [n] fp32; out [rows, n].
 * The sum of squares runs in 16 lanes, then the fixed tree, then the tail. */
void trioserve_rms_norm(const float *x, const float *weight, void *out, int64_t rows, int64_t n, float eps, int bf16) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) rms_norm_row(x + r * n, weight, out, r, n, eps, 1);
        else rms_norm_row(x + r * n, weight, out, r, n, eps, 0);
    }
}

/* h[t] += delta[t] (delta bf16 or fp32, widened: what torch's fp32 + bf16
 * gives), then out[t] = the RMSNorm of the new h[t] as trioserve_rms_norm
 * computes it: the same bits as the add followed by that kernel. */
void trioserve_add_rms_norm(float *h, const void *delta, const float *weight, void *out, int64_t rows, int64_t n,
                            float eps, int delta_bf16, int bf16) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float *row = h + r * n;
        for (int64_t i = 0; i < n; i++) row[i] += load(delta, r * n + i, delta_bf16);
        if (bf16) rms_norm_row(row, weight, out, r, n, eps, 1);
        else rms_norm_row(row, weight, out, r, n, eps, 0);
    }
}

/* x / (1 + e^-x) in fp32, with exp taken of a non-positive argument only. */
static inline float silu(float x) {
    if (x >= 0.0f) return x / (1.0f + exp_nonpositive(-x));
    const float e = exp_nonpositive(x);
    return x * e / (1.0f + e);
}

#if defined(__AVX512F__)
static inline __m512 load16(const void *base, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)base + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* `float_to_bf16` of 16 lanes: the same integer steps. */
static inline __m256i bf16_of16(__m512 f) {
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

/* `silu` of 16 lanes, the same operations. */
static inline __m512 silu16(__m512 x) {
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 e = exp_nonpositive16(_mm512_mask_sub_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), neg, x, _mm512_setzero_ps()));
    const __m512 num = _mm512_mask_mul_ps(x, neg, x, e);
    return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
#endif

/* out[t, i] = silu(gu[t, i]) * gu[t, f + i] for i < f, gu [rows, 2f]: the
 * product in fp32, rounded once to out's dtype (bf16 or fp32, as gu); with
 * AVX-512, 16 at a time by the same operations. */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* `silu16`'s operations on 8 lanes (float32 rows: what an AVX2 CPU serves). */
static inline __m256 silu8(__m256 x) {
    const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 e = exp_nonpositive8(_mm256_blendv_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), x, neg));
    const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), neg);
    return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
#endif

void trioserve_silu_mul(const void *gu, void *out, int64_t rows, int64_t f, int bf16) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= f; i += 16) {
            const __m512 y = _mm512_mul_ps(silu16(load16(gu, r * 2 * f + i, bf16)), load16(gu, r * 2 * f + f + i, bf16));
            if (bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)out + r * f + i), bf16_of16(y));
            else _mm512_storeu_ps((float *)out + r * f + i, y);
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if (!bf16)
            for (; i + 8 <= f; i += 8) {
                const float *g = (const float *)gu + r * 2 * f;
                _mm256_storeu_ps((float *)out + r * f + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(g + f + i)));
            }
#endif
        for (; i < f; i++) {
            const float g = load(gu, r * 2 * f + i, bf16), u = load(gu, r * 2 * f + f + i, bf16);
            store(out, r * f + i, silu(g) * u, bf16);
        }
    }
}

/* GeGLU's gelu, tanh approximation: 0.5 x (1 + tanh(u)), u = sqrt(2 / pi)
 * (x + 0.044715 x^3), computed as x sigmoid(2 u) = x / (1 + e^-2u) (the same
 * function), with `exp_nonpositive` of a non-positive argument only, as
 * `silu`: z = 2u = GELU_Z (x + GELU_A x^3), x^3 as (x x) x. Unfused, and
 * the same operations in every width below, so every build gives its bits. */
#define GELU_A 0.044715f
#define GELU_Z 1.5957691216057308f /* 2 sqrt(2 / pi) */
static inline float gelu_tanh(float x) {
    const float z = GELU_Z * (x + GELU_A * (x * x * x));
    if (z >= 0.0f) return x / (1.0f + exp_nonpositive(-z));
    const float e = exp_nonpositive(z);
    return x * e / (1.0f + e);
}

#if defined(__AVX512F__)
/* `gelu_tanh` of 16 lanes, the same operations (a lane with z < 0 takes e^z). */
static inline __m512 gelu_tanh16(__m512 x) {
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 z = _mm512_mul_ps(_mm512_set1_ps(GELU_Z), _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(GELU_A), x3)));
    const __mmask16 neg = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 e = exp_nonpositive16(_mm512_mask_sub_ps(_mm512_sub_ps(_mm512_setzero_ps(), z), neg, z, _mm512_setzero_ps()));
    const __m512 num = _mm512_mask_mul_ps(x, neg, x, e);
    return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
#elif defined(__AVX2__) && defined(__FMA__)
/* `gelu_tanh16`'s operations on 8 lanes (float32 rows). */
static inline __m256 gelu_tanh8(__m256 x) {
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 z = _mm256_mul_ps(_mm256_set1_ps(GELU_Z), _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(GELU_A), x3)));
    const __m256 neg = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 e = exp_nonpositive8(_mm256_blendv_ps(_mm256_sub_ps(_mm256_setzero_ps(), z), z, neg));
    const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), neg);
    return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}
#endif

/* out[t, i] = gelu_tanh(gu[t, i]) * gu[t, f + i] for i < f, gu [rows, 2f]
 * (GeGLU: Gemma's MLP): as `trioserve_silu_mul`, the product in fp32 rounded
 * once to out's dtype (bf16 or fp32, as gu); the same bits in every build. */
void trioserve_gelu_tanh_mul(const void *gu, void *out, int64_t rows, int64_t f, int bf16) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= f; i += 16) {
            const __m512 y = _mm512_mul_ps(gelu_tanh16(load16(gu, r * 2 * f + i, bf16)), load16(gu, r * 2 * f + f + i, bf16));
            if (bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)out + r * f + i), bf16_of16(y));
            else _mm512_storeu_ps((float *)out + r * f + i, y);
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if (!bf16)
            for (; i + 8 <= f; i += 8) {
                const float *g = (const float *)gu + r * 2 * f;
                _mm256_storeu_ps((float *)out + r * f + i, _mm256_mul_ps(gelu_tanh8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(g + f + i)));
            }
#endif
        for (; i < f; i++) {
            const float g = load(gu, r * 2 * f + i, bf16), u = load(gu, r * 2 * f + f + i, bf16);
            store(out, r * f + i, gelu_tanh(g) * u, bf16);
        }
    }
}

/* One head of one row: x1 c - x2 s and x2 c + x1 s in fp32, rounded once. */
static inline __attribute__((always_inline)) void rotate(const void *src, int64_t in, void *dst, int64_t at, const float *c,
                                                        const float *sn, int64_t half, const int bf16, const int out_bf16) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = load(src, in + i, bf16), x2 = load(src, in + half + i, bf16);
        const float a = x1 * c[i], b = x2 * sn[i], e = x2 * c[i], f = x1 * sn[i];
        store(dst, at + i, a - b, out_bf16);
        store(dst, at + half + i, e + f, out_bf16);
    }
}

static inline __attribute__((always_inline)) void rope_row(const void *qkv, const int64_t *positions, const float *cos,
                                                          const float *sin, void *q_out, void *k_cache, void *v_cache,
                                                          const int64_t *slots, int64_t t, int64_t real, int64_t heads,
                                                          int64_t kv_heads, int64_t dim, int64_t num_slots, const int bf16,
                                                          const int kv_bf16) {
    const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
    const float *c = cos + positions[t] * half, *sn = sin + positions[t] * half;
    for (int64_t h = 0; h < heads; h++) rotate(qkv, t * width + h * dim, q_out, (t * heads + h) * dim, c, sn, half, bf16, bf16);
    if (t >= real) return; /* a pad row: its k and v are never stored */
    for (int64_t h = 0; h < kv_heads; h++) {
        const int64_t at = (h * num_slots + slots[t]) * dim;
        rotate(qkv, t * width + (heads + h) * dim, k_cache, at, c, sn, half, bf16, kv_bf16);
        const int64_t in = t * width + (heads + kv_heads + h) * dim;
        if (bf16) memcpy((uint16_t *)v_cache + at, (const uint16_t *)qkv + in, (size_t)dim * 2);
        else if (!kv_bf16) memcpy((float *)v_cache + at, (const float *)qkv + in, (size_t)dim * 4);
        else
            for (int64_t i = 0; i < dim; i++) ((uint16_t *)v_cache)[at + i] = float_to_bf16(((const float *)qkv)[in + i]);
    }
}

/* qkv [rows, (H + 2 KVH) * D] in the model dtype: each row's q, k, v heads.
 * Rotate-half RoPE (pair i is (x[i], x[i + D/2])) with cos, sin [*, D/2]
 * fp32 at the row's position, computed as the torch twin does (with no
 * fused multiply-adds: the same bits). Writes the rotated q to
 * q_out [rows, H, D]; for the first `real` rows, the rotated k and the v to
 * the pool k_cache, v_cache [KVH, NB * BS, D] at slots[t], in bf16 when
 * kv_bf16 (fp32 rows rounded to nearest even, as torch casts; a bf16 qkv
 * needs a bf16 pool). Returns 3 when a position or slot is out of range,
 * 1 for a bf16 qkv with an fp32 pool, else 0. */
int trioserve_rope_write_kv(const void *qkv, const int64_t *positions, const float *cos, const float *sin, void *q_out,
                            void *k_cache, void *v_cache, const int64_t *slots, int64_t rows, int64_t real, int64_t heads,
                            int64_t kv_heads, int64_t dim, int64_t max_position, int64_t num_slots, int bf16, int kv_bf16) {
    if (bf16 && !kv_bf16) return 1;
    for (int64_t t = 0; t < rows; t++) {
        if (positions[t] < 0 || positions[t] >= max_position) return 3;
        if (t < real && (slots[t] < 0 || slots[t] >= num_slots)) return 3;
    }
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; t++) {
        if (bf16) rope_row(qkv, positions, cos, sin, q_out, k_cache, v_cache, slots, t, real, heads, kv_heads, dim, num_slots, 1, 1);
        else if (kv_bf16) rope_row(qkv, positions, cos, sin, q_out, k_cache, v_cache, slots, t, real, heads, kv_heads, dim, num_slots, 0, 1);
        else rope_row(qkv, positions, cos, sin, q_out, k_cache, v_cache, slots, t, real, heads, kv_heads, dim, num_slots, 0, 0);
    }
    return 0;
}

/* fma(a, b, c) for the integer kernels' plain C builds: a b + c rounded
 * once to fp32, an FMA instruction's bits. Where the compiler has the
 * instruction (ARM64, x86 with FMA), C99 `fmaf` is that instruction. Else
 * (the generic x86-64 build) `fmaf` is a library call, and in glibc, on a
 * CPU without FMA (the CPUs that build is for), a slow one: the 4-bit
 * kernel took ~7x as long with it. So there it is computed in double:
 * p = a b is exact (24 + 24 bits), and s = p + c rounded to double rounds
 * to float as the exact sum does unless s is a float midpoint (the 29
 * bits below a float's last are 1000...0) or lies among the float
 * subnormals: then t, the exact error of s (Knuth's two-sum), is found,
 * and s rounded to odd (where t != 0, the one of s and its neighbour
 * towards t whose last bit is 1), which keeps the exact sum's rounding to
 * any precision of 51 bits or fewer, so the cast rounds as the exact sum
 * would (Boldo and Melquiond, "Emulation of a FMA and correctly-rounded
 * sums: proved algorithms using rounding to odd", IEEE Trans. Computers,
 * 2008). Infinite and NaN sums are cast as they are. Checked against the
 * FMA instruction on 3 x 10^8 random and 3 x 10^7 crafted near-midpoint
 * operands (10^7 of them through the rounding to odd; casting the double
 * sum alone is wrong in ~10^5), and by the kernels' tests. */
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
static inline __attribute__((unused)) float g_fma(float a, float b, float c) { return fmaf(a, b, c); }
#else
static inline __attribute__((unused)) float g_fma(float a, float b, float c) {
    const double p = (double)a * (double)b, s = p + (double)c;
    uint64_t bits;
    memcpy(&bits, &s, sizeof bits);
    if (__builtin_expect((bits & 0x1fffffffu) != 0x10000000u && !(fabs(s) < 0x1p-126 && s != 0.0), 1)) return (float)s;
    const double z = s - p, t = (p - (s - z)) + ((double)c - z);
    uint64_t tb;
    memcpy(&tb, &t, sizeof tb);
    const uint64_t inexact = (t != 0.0) & (s - s == 0.0);
    bits = (bits - (inexact & ((bits ^ tb) >> 63))) | inexact; /* towards zero where t points there, then odd */
    double odd;
    memcpy(&odd, &bits, sizeof odd);
    return (float)odd;
}
#endif

/* 4-bit projections of decode rows: y = x W^T with W held as GGUF's 4-bit
 * blocks, w = q d + m (q in 0..15; d and m per 32 inputs, stored as f16,
 * which holds GGUF's own f16 values exactly).
 *
 * Layout (kernels/native_pack.py `pack_int4` writes it): the N outputs go in
 * panels of 32 (two tiles of 16), and for panel p, block b, tile u:
 *   packed  [N/32][K/32][2][8][16][2] bytes: chunk c, column i, t in {0, 1}
 *           hold q(k = 2c + t) in the low nibble and q(k = 16 + 2c + t) in
 *           the high one, k counted within the block; one chunk widens to
 *           two bf16 vectors that pair with inputs (2c, 2c + 1) and
 *           (16 + 2c, 17 + 2c);
 *   scales  [N/32][K/32][2][2][16] f16: the tile's 16 d, then its 16 m.
 * x [R, K] is bf16 (fp32 rows are rounded to bf16 first, as torch's cast
 * does); out [R, N] fp32 or bf16.
 *
 * Arithmetic, the same for every row whatever the others: per block, the
 * codes (small integers, exact in bf16) are multiplied by the bf16 inputs
 * in pairs (vdpbf16ps: exact products, summed in fp32), the pairs (2c, 2c+1)
 * of c = 0..7 into one sum and (16 + 2c, 17 + 2c) into another, in order of
 * c; then acc += (s0 + s1) d, acc += m xs, where xs is the block's inputs
 * summed in fp32 in order. Blocks run in order. Rows are taken up to four at
 * a time so that one widened code vector serves them all; which rows share
 * a pass, and which thread computes a panel, changes no bit of a row. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define Q4_BLOCK 32
#define Q4_TILE_BYTES 256
#define Q4_PASS_ROWS 4

/* acc += w . (x[0], x[1]) in every lane. (Inline assembly with the pair
 * broadcast inside vdpbf16ps measured slower here than this.) */
static inline __attribute__((always_inline)) __m512 dot_pair(__m512 acc, __m512bh w, const uint16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm512_dpbf16_ps(acc, w, (__m512bh)_mm512_set1_epi32(pair));
}

static inline __attribute__((always_inline)) void q4_panel_rows(const uint8_t *w, const uint16_t *sc, const uint16_t *x,
                                                              const float *xsum, void *out, int64_t nb, int64_t k,
                                                              int64_t n, const int rows, const int bf16_out,
                                                              Prefetch *ahead) {
    /* bf16 bit patterns of 0..15 */
    const __m512i values = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150,
                                            0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080,
                                            0x4040, 0x4000, 0x3f80, 0);
    const __m512i nibble = _mm512_set1_epi16(0x0F);
    __m512 acc[Q4_PASS_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_some(ahead);
        const uint8_t *wb = w + b * 2 * Q4_TILE_BYTES;
        __m512 s0[Q4_PASS_ROWS][2], s1[Q4_PASS_ROWS][2];
        for (int r = 0; r < rows; r++)
            for (int u = 0; u < 2; u++) s0[r][u] = s1[r][u] = _mm512_setzero_ps();
        for (int c = 0; c < 8; c++) {
            __m512bh lo[2], hi[2];
            for (int u = 0; u < 2; u++) {
                const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wb + u * Q4_TILE_BYTES + c * 32)));
                lo[u] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(v, nibble), values);
                hi[u] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), values);
            }
            for (int r = 0; r < rows; r++) {
                const uint16_t *xr = x + r * k + b * Q4_BLOCK;
                for (int u = 0; u < 2; u++) {
                    s0[r][u] = dot_pair(s0[r][u], lo[u], xr + 2 * c);
                    s1[r][u] = dot_pair(s1[r][u], hi[u], xr + 16 + 2 * c);
                }
            }
        }
        for (int u = 0; u < 2; u++) {
            const uint16_t *s = sc + (b * 2 + u) * 32;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 16)));
            for (int r = 0; r < rows; r++) {
                acc[r][u] = _mm512_fmadd_ps(_mm512_add_ps(s0[r][u], s1[r][u]), d, acc[r][u]);
                acc[r][u] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * nb + b]), acc[r][u]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int u = 0; u < 2; u++) {
            if (bf16_out) {
                float lanes[16];
                _mm512_storeu_ps(lanes, acc[r][u]);
                for (int i = 0; i < 16; i++) ((uint16_t *)out)[r * n + u * 16 + i] = float_to_bf16(lanes[i]);
            } else {
                _mm512_storeu_ps((float *)out + r * n + u * 16, acc[r][u]);
            }
        }
}

#define Q4_PASS(R)                                                                  \
    case R:                                                                         \
        if (bf16_out) q4_panel_rows(w, sc, xr, xs, o, nb, k, n, R, 1, &ahead);      \
        else q4_panel_rows(w, sc, xr, xs, o, nb, k, n, R, 0, &ahead);               \
        break;

int trioserve_int4_available(void) { return 1; }
int trioserve_int8_available(void) { return 1; }



/* Returns 1 when n or k is not a multiple of 32, 2 when scratch memory
 * cannot be had, else 0. x_bf16: 1 when x is bf16, 0 when fp32. */
int trioserve_int4_matmul(const uint8_t *packed, const uint16_t *scales, const void *x, void *out, int64_t rows, int64_t n,
                          int64_t k, int x_bf16, int bf16_out, int threads) {
    if (n % 32 || k % Q4_BLOCK) return 1;
    const int64_t nb = k / Q4_BLOCK, panels = n / 32;
    uint16_t *xh = bf16_rows(x, rows * k, x_bf16);
    float *xsum = malloc((size_t)(rows * nb) * sizeof *xsum + 1);
    if (!xh || !xsum) {
        free(xh);
        free(xsum);
        return 2;
    }
    const int nt = threads > 0 ? (threads < MAX_THREADS ? threads : MAX_THREADS) : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        /* Each block's inputs summed in order, eight blocks side by side and
         * split between the threads (a serial chain of 32 dependent adds a
         * block before: 3-6% of the call at 32-64 rows). */
#pragma omp for schedule(static)
        for (int64_t i0 = 0; i0 < rows * nb; i0 += 8) {
            const int64_t m = rows * nb - i0 < 8 ? rows * nb - i0 : 8;
            float s[8] = {0};
            for (int j = 0; j < Q4_BLOCK; j++)
                for (int64_t l = 0; l < m; l++) s[l] += bf16_to_float(xh[(i0 + l) * Q4_BLOCK + j]);
            for (int64_t l = 0; l < m; l++) xsum[i0 + l] = s[l];
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t panel_bytes = nb * 2 * Q4_TILE_BYTES;
            const uint8_t *w = packed + p * panel_bytes;
            const uint16_t *sc = scales + p * nb * 2 * 32;
            Prefetch ahead = prefetch_plan(p + 1 < panels ? w + panel_bytes : NULL, panel_bytes,
                                           ((rows + Q4_PASS_ROWS - 1) / Q4_PASS_ROWS) * nb);
            for (int64_t r0 = 0; r0 < rows; r0 += Q4_PASS_ROWS) {
                const uint16_t *xr = xh + r0 * k;
                const float *xs = xsum + r0 * nb;
                void *o = bf16_out ? (void *)((uint16_t *)out + r0 * n + p * 32) : (void *)((float *)out + r0 * n + p * 32);
                switch (rows - r0 >= Q4_PASS_ROWS ? Q4_PASS_ROWS : rows - r0) {
                    Q4_PASS(4)
                    Q4_PASS(3)
                    Q4_PASS(2)
                    Q4_PASS(1)
                }
            }
        }
    }
    free(xh);
    free(xsum);
    return 0;
}

/* The output head: y = (x W^T) scale, W int8 [N, K] with one fp32 scale per
 * output (kernels/projection.py `Int8Rows`; the bf16 scale, widened).
 *
 * Layout (native_pack.py `pack_int8` writes it): packed [N/32][K/2][2][16][2]
 * int8, panel p, input pair j, tile u, column i, t: W[32p + 16u + i][2j + t].
 * Arithmetic, the same for every row whatever the others: the codes are
 * widened to bf16 (exact: |q| <= 127), multiplied by the bf16 inputs in
 * pairs (exact products summed in fp32) over the pairs in order, and the
 * sum is multiplied by the scale. Rows go up to eight at a time; which rows
 * share a pass, and which thread computes a panel, changes no bit. */
#define Q8_PASS_ROWS 8

static inline __attribute__((always_inline)) void q8_panel_rows(const int8_t *w, const float *scale, const uint16_t *x,
                                                              float *out, int64_t k, int64_t n, const int rows,
                                                              Prefetch *ahead) {
    __m512 acc[Q8_PASS_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k / 2; j++) {
        if (j % 8 == 0) prefetch_some(ahead);
        __m512bh codes[2];
        for (int u = 0; u < 2; u++) {
            const int8_t *p = w + (j * 2 + u) * 32;
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
            codes[u] = _mm512_cvtne2ps_pbh(hi, lo);
        }
        for (int r = 0; r < rows; r++) {
            acc[r][0] = dot_pair(acc[r][0], codes[0], x + r * k + 2 * j);
            acc[r][1] = dot_pair(acc[r][1], codes[1], x + r * k + 2 * j);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int u = 0; u < 2; u++)
            _mm512_storeu_ps(out + r * n + u * 16, _mm512_mul_ps(acc[r][u], _mm512_loadu_ps(scale + u * 16)));
}

#define Q8_PASS(R)                                                                  \
    case R:                                                                         \
        q8_panel_rows(w, s, xr, o, k, n, R, &ahead);                                        \
        break;

/* Returns 1 when n is not a multiple of 32 or k is odd, 2 when scratch
 * memory cannot be had, else 0. out [R, N] fp32. */
int trioserve_int8_matmul(const int8_t *packed, const float *scale, const void *x, float *out, int64_t rows, int64_t n,
                          int64_t k, int x_bf16, int threads) {
    if (n % 32 || k % 2) return 1;
    uint16_t *xh = bf16_rows(x, rows * k, x_bf16);
    if (!xh) return 2;
    const int nt = threads > 0 ? (threads < MAX_THREADS ? threads : MAX_THREADS) : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t p = 0; p < n / 32; p++) {
        const int8_t *w = packed + p * 32 * k;
        const float *s = scale + p * 32;
        Prefetch ahead = prefetch_plan(p + 1 < n / 32 ? w + 32 * k : NULL, 32 * k,
                                       ((rows + Q8_PASS_ROWS - 1) / Q8_PASS_ROWS) * ((k / 2 + 7) / 8));
        for (int64_t r0 = 0; r0 < rows; r0 += Q8_PASS_ROWS) {
            const uint16_t *xr = xh + r0 * k;
            float *o = out + r0 * n + p * 32;
            switch (rows - r0 >= Q8_PASS_ROWS ? Q8_PASS_ROWS : rows - r0) {
                Q8_PASS(8)
                Q8_PASS(7)
                Q8_PASS(6)
                Q8_PASS(5)
                Q8_PASS(4)
                Q8_PASS(3)
                Q8_PASS(2)
                Q8_PASS(1)
            }
        }
    }
    free(xh);
    return 0;
}

/* 4-bit projections with 8-bit activations (`--activations int8`: every
 * row, prompt and generated): the arithmetic llama.cpp uses for these GGUF
 * blocks. Each row's inputs are rounded to 8 bits per block of 32
 * (xq = round(x 127 / amax), half to even, with xd = amax / 127), the
 * block's codes times those bytes are summed exactly in int32 by VNNI
 * (`vpdpbusd`; no more multiply-adds a cycle than `vdpbf16ps` on the CPUs
 * measured, but the codes widen to bytes with two masks where widening them
 * to bf16 takes permutes), and per block
 *   acc = fma(float(isum), d xd, acc);  acc = fma(m, xs, acc)
 * with xs the block's bf16 inputs summed in fp32 in order (the exact sum,
 * where llama.cpp uses the rounded one). Blocks run in order, so a row's
 * result depends on that row alone, in any company and on any thread.
 *
 * Layout (kernels/native_pack.py `pack_int4_q8` writes it): the N outputs go in
 * tiles of 16 (one vector of int32 sums), the tiles in groups of three (the
 * last group may hold fewer), and for group g of T tiles, block b, tile t,
 * quad j:
 *   packed  [g][K/32][T][4][16][4] bytes: column i, byte e holds
 *           q(k = 4j + e) in the low nibble and q(k = 16 + 4j + e) in the
 *           high one, k counted within the block, so one 64-byte load
 *           gives two quads of four inputs for 16 columns;
 *   scales  [g][K/32][T][2][16] f16: the tile's 16 d, then its 16 m.
 * A group is read front to back, one stream (which memory fetches best).
 * x [R, K] bf16 or fp32 (fp32 rounded to bf16 first); out [R, N] fp32 or
 * bf16. Rows go four at a time over three tiles, so that a widened code
 * vector serves four rows and the sums fit the 32 vector registers. */
#if defined(__AVX512VNNI__)
#define Q8A_ROWS 4
#define Q8A_TILES 3
#define Q8A_TILE_BLOCK 256

static inline __attribute__((always_inline)) void q8a_pass(const uint8_t *w, const uint16_t *sc, const int8_t *xq,
                                                         const float *xd, const float *xs, void *out, int64_t nb,
                                                         int64_t k, int64_t n, const int rows, const int tiles,
                                                         const int bf16_out, Prefetch *ahead) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 acc[Q8A_ROWS][Q8A_TILES];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < tiles; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_some(ahead);
        __m512i isum[Q8A_ROWS][Q8A_TILES];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < tiles; c++) isum[r][c] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            __m512i lo[Q8A_TILES], hi[Q8A_TILES];
            for (int c = 0; c < tiles; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(w + (b * tiles + c) * Q8A_TILE_BLOCK + j * 64));
                lo[c] = _mm512_and_si512(v, nibble);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            }
            for (int r = 0; r < rows; r++) {
                const int8_t *xr = xq + r * k + b * Q4_BLOCK + 4 * j;
                int32_t first, second;
                memcpy(&first, xr, sizeof first);
                memcpy(&second, xr + 16, sizeof second);
                const __m512i x0 = _mm512_set1_epi32(first), x1 = _mm512_set1_epi32(second);
                for (int c = 0; c < tiles; c++) {
                    isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], lo[c], x0);
                    isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], hi[c], x1);
                }
            }
        }
        for (int c = 0; c < tiles; c++) {
            const uint16_t *s = sc + (b * tiles + c) * 32;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 16)));
            for (int r = 0; r < rows; r++) {
                const __m512 dx = _mm512_mul_ps(d, _mm512_set1_ps(xd[r * nb + b]));
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][c]), dx, acc[r][c]);
                acc[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * nb + b]), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < tiles; c++) {
            if (bf16_out) _mm256_storeu_si256((__m256i *)((uint16_t *)out + r * n + c * 16), bf16_of16(acc[r][c]));
            else _mm512_storeu_ps((float *)out + r * n + c * 16, acc[r][c]);
        }
}

/* One block of 32 bf16 inputs to 8 bits: xq, xd, and xs, the exact
 * inputs summed in fp32 as (lane i) + (lane 16 + i), then halves folded:
 * 8 + 8, 4 + 4, 2 + 2, 1 + 1 (kernels/reference.py `q8_blocks` the same). */
static inline void q8a_block(const uint16_t *src, int8_t *xq, float *xd, float *xs) {
    const __m512 v0 = load16(src, 0, 1), v1 = load16(src, 16, 1);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    _mm_storeu_si128((__m128i *)xq, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
    _mm_storeu_si128((__m128i *)(xq + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
    *xd = amax / 127.0f;
    const __m512 s16 = _mm512_add_ps(v0, v1);
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(s16), _mm512_extractf32x8_ps(s16, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    *xs = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

#define Q8A_PASS(R)                                                                                        \
    case R:                                                                                                \
        if (tiles == 3) q8a_pass(w, sc, xr, xdr, xsr, o, nb, k, n, R, 3, bf16_out, ahead);                     \
        else if (tiles == 2) q8a_pass(w, sc, xr, xdr, xsr, o, nb, k, n, R, 2, bf16_out, ahead);                \
        else q8a_pass(w, sc, xr, xdr, xsr, o, nb, k, n, R, 1, bf16_out, ahead);                            \
        break;

/* This build's pieces of `trioserve_int4_q8_matmul` (one driver for every
 * build, below): a block's inputs to 8 bits, and up to 4 rows of up to 3
 * tiles, the counts made constants for the compiler. */
#define Q8ACT_KERNEL 1
#define q8act_block q8a_block
static void q8act_rows(const uint8_t *w, const uint16_t *sc, const int8_t *xr, const float *xdr, const float *xsr,
                       void *o, int64_t nb, int64_t k, int64_t n, int rows, int tiles, int bf16_out, Prefetch *ahead) {
    switch (rows) {
        Q8A_PASS(4)
        Q8A_PASS(3)
        Q8A_PASS(2)
        Q8A_PASS(1)
    }
}
#endif
#else
int trioserve_int4_available(void) { return 0; }
int trioserve_int4_matmul(const uint8_t *packed, const uint16_t *scales, const void *x, void *out, int64_t rows, int64_t n,
                          int64_t k, int x_bf16, int bf16_out, int threads) {
    (void)packed, (void)scales, (void)x, (void)out, (void)rows, (void)n, (void)k, (void)x_bf16, (void)bf16_out, (void)threads;
    return 4;
}
#if (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) || NEON_DOT
#if NEON_DOT
/* `trioserve_int8_matmul` on NEON: the AVX2 build's operations on 4 lanes
 * (vdpbf16ps's order: the odd input's product first, each fused). */
#define H2_ROWS 4

static inline __attribute__((always_inline)) void h2_pass(const int8_t *w, const float *scale, const float *x,
                                                         float *out, int64_t k, int64_t n, const int rows, const int u) {
    float32x4_t acc[H2_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = vdupq_n_f32(0.0f);
    for (int64_t j = 0; j < k / 2; j++) {
        float32x4_t even[4], odd[4];
        for (int v = 0; v < 4; v++) {
            /* 4 columns' (even, odd) code pairs */
            const int16x8_t pairs = vmovl_s8(vld1_s8(w + (j * 2 + u) * 32 + v * 8));
            const int16x4x2_t split = vuzp_s16(vget_low_s16(pairs), vget_high_s16(pairs));
            even[v] = vcvtq_f32_s32(vmovl_s16(split.val[0]));
            odd[v] = vcvtq_f32_s32(vmovl_s16(split.val[1]));
        }
        for (int r = 0; r < rows; r++) {
            const float32x4_t x0 = vdupq_n_f32(x[r * k + 2 * j]), x1 = vdupq_n_f32(x[r * k + 2 * j + 1]);
            for (int v = 0; v < 4; v++) acc[r][v] = vfmaq_f32(vfmaq_f32(acc[r][v], odd[v], x1), even[v], x0);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < 4; v++)
            vst1q_f32(out + r * n + u * 16 + v * 4, vmulq_f32(acc[r][v], vld1q_f32(scale + u * 16 + v * 4)));
}
#else
#include <immintrin.h>
/* `trioserve_int8_matmul` (the output head) on 256-bit registers, with the
 * same layout and the same bits. `vdpbf16ps` adds a lane's two exact
 * products to its sum one at a time, the odd input's first, each addition
 * rounded: here two fused multiply-adds in that order (a product of an
 * int8 code and a bf16 input is exact in fp32, so fusing changes nothing).
 * A pass computes 16 outputs (half a panel) for up to four rows. */
#define H2_ROWS 4

static inline __attribute__((always_inline)) void h2_pass(const int8_t *w, const float *scale, const float *x,
                                                         float *out, int64_t k, int64_t n, const int rows, const int u) {
    __m256 acc[H2_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k / 2; j++) {
        __m256 even[2], odd[2];
        for (int v = 0; v < 2; v++) {
            /* 8 columns' (even, odd) code pairs as 8 int32 lanes */
            const __m256i pairs = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(w + (j * 2 + u) * 32 + v * 16)));
            even[v] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(pairs, 24), 24));
            odd[v] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 24));
        }
        for (int r = 0; r < rows; r++) {
            const __m256 x0 = _mm256_broadcast_ss(x + r * k + 2 * j);
            const __m256 x1 = _mm256_broadcast_ss(x + r * k + 2 * j + 1);
            for (int v = 0; v < 2; v++) acc[r][v] = _mm256_fmadd_ps(even[v], x0, _mm256_fmadd_ps(odd[v], x1, acc[r][v]));
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < 2; v++)
            _mm256_storeu_ps(out + r * n + u * 16 + v * 8, _mm256_mul_ps(acc[r][v], _mm256_loadu_ps(scale + u * 16 + v * 8)));
}

#endif
#define H2_PASS(R)                                                        \
    case R:                                                               \
        for (int u = 0; u < 2; u++) h2_pass(w, s, xr, o, k, n, R, u);     \
        break;

int trioserve_int8_available(void) { return 1; }

int trioserve_int8_matmul(const int8_t *packed, const float *scale, const void *x, float *out, int64_t rows, int64_t n,
                          int64_t k, int x_bf16, int threads) {
    if (n % 32 || k % 2) return 1;
    /* the inputs rounded to bf16 (as the AVX-512 kernel takes them), widened back to fp32 once */
    uint16_t *xh = bf16_rows(x, rows * k, x_bf16);
    float *xf = malloc((size_t)(rows * k) * sizeof *xf + 1);
    if (!xh || !xf) {
        free(xh), free(xf);
        return 2;
    }
    for (int64_t i = 0; i < rows * k; i++) xf[i] = bf16_to_float(xh[i]);
    const int nt = threads > 0 ? (threads < MAX_THREADS ? threads : MAX_THREADS) : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t p = 0; p < n / 32; p++) {
        const int8_t *w = packed + p * 32 * k;
        const float *s = scale + p * 32;
        for (int64_t r0 = 0; r0 < rows; r0 += H2_ROWS) {
            const float *xr = xf + r0 * k;
            float *o = out + r0 * n + p * 32;
            switch (rows - r0 >= H2_ROWS ? H2_ROWS : rows - r0) {
                H2_PASS(4)
                H2_PASS(3)
                H2_PASS(2)
                H2_PASS(1)
            }
        }
    }
    free(xh), free(xf);
    return 0;
}
#else
/* `trioserve_int8_matmul` in plain C (the generic build, and ARM without
 * the dot-product extension): the AVX2 build's operations one lane at a
 * time, acc = fma(even code, x0, fma(odd code, x1, acc)) over the input
 * pairs in order, then acc times the scale, so the same bits.
 *
 * Without an FMA instruction a fused multiply-add is many instructions
 * (`g_fma`), and here it can mostly be spared: a code (|q| <= 128, at most 7 significant bits) times a
 * bf16 input (8) is exact in fp32 whenever the product is zero or normal
 * and finite, and a fused multiply-add of an exact product rounds once,
 * as the plain add of it does. So a pass whose rows' inputs are all zero
 * or of magnitude in [2^-126, 2^120] (every product then zero or in
 * [2^-126, 2^127)) multiplies and adds plainly (the library is built
 * without contraction; the compiler vectorizes the lanes), and any other
 * pass (subnormal, huge, infinite or NaN inputs) takes `g_fma`. Either way
 * each output is the same fused chain's bits. */
#define G8_ROWS 4

static inline __attribute__((always_inline)) void g8_pass(const int8_t *w, const float *scale, const float *x, float *out,
                                                         int64_t k, int64_t n, const int rows, const int exact) {
    for (int u = 0; u < 2; u++) {
        float acc[G8_ROWS][16];
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < 16; i++) acc[r][i] = 0.0f;
        for (int64_t j = 0; j < k / 2; j++) {
            const int8_t *p = w + (j * 2 + u) * 32;
            float even[16], odd[16];
            for (int i = 0; i < 16; i++) {
                even[i] = (float)p[2 * i];
                odd[i] = (float)p[2 * i + 1];
            }
            for (int r = 0; r < rows; r++) {
                const float x0 = x[r * k + 2 * j], x1 = x[r * k + 2 * j + 1];
                if (exact)
                    for (int i = 0; i < 16; i++) acc[r][i] = (acc[r][i] + odd[i] * x1) + even[i] * x0;
                else
                    for (int i = 0; i < 16; i++) acc[r][i] = g_fma(even[i], x0, g_fma(odd[i], x1, acc[r][i]));
            }
        }
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < 16; i++) out[r * n + u * 16 + i] = acc[r][i] * scale[u * 16 + i];
    }
}

/* Whether every product of a code and one of these n inputs is exact in fp32 (above). */
static int g8_exact_inputs(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        if (!(a == 0.0f || (a >= 0x1p-126f && a <= 0x1p120f))) return 0;
    }
    return 1;
}

#define G8_PASS(R)                                                            \
    case R:                                                                   \
        if (exact) g8_pass(w, s, xr, o, k, n, R, 1);                          \
        else g8_pass(w, s, xr, o, k, n, R, 0);                                \
        break;

int trioserve_int8_available(void) { return 1; }

int trioserve_int8_matmul(const int8_t *packed, const float *scale, const void *x, float *out, int64_t rows, int64_t n,
                          int64_t k, int x_bf16, int threads) {
    if (n % 32 || k % 2) return 1;
    /* the inputs rounded to bf16 (as the AVX-512 kernel takes them), widened back to fp32 once */
    uint16_t *xh = bf16_rows(x, rows * k, x_bf16);
    float *xf = malloc((size_t)(rows * k) * sizeof *xf + 1);
    int *exact_row = malloc((size_t)rows * sizeof *exact_row + 1);
    if (!xh || !xf || !exact_row) {
        free(xh), free(xf), free(exact_row);
        return 2;
    }
    for (int64_t i = 0; i < rows * k; i++) xf[i] = bf16_to_float(xh[i]);
    for (int64_t r = 0; r < rows; r++) exact_row[r] = g8_exact_inputs(xf + r * k, k);
    const int nt = threads > 0 ? (threads < MAX_THREADS ? threads : MAX_THREADS) : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t p = 0; p < n / 32; p++) {
        const int8_t *w = packed + p * 32 * k;
        const float *s = scale + p * 32;
        for (int64_t r0 = 0; r0 < rows; r0 += G8_ROWS) {
            const float *xr = xf + r0 * k;
            float *o = out + r0 * n + p * 32;
            const int here = (int)(rows - r0 >= G8_ROWS ? G8_ROWS : rows - r0);
            int exact = 1;
            for (int r = 0; r < here; r++) exact &= exact_row[r0 + r];
            switch (here) {
                G8_PASS(4)
                G8_PASS(3)
                G8_PASS(2)
                G8_PASS(1)
            }
        }
    }
    free(xh), free(xf), free(exact_row);
    return 0;
}
#endif
#endif

/* Without AVX-512 VNNI, the same kernel on 256-bit registers: AVX2 with FMA
 * and F16C (x86-64-v3: Intel since Haswell, AMD since Zen), with AVX-VNNI's
 * `vpdpbusd` where the CPU has it (Alder Lake and later client CPUs), else
 * the pair `vpmaddubsw` (code byte times input byte, adjacent pairs summed
 * into int16: at most 2 x 15 x 127, no saturation) then `vpmaddwd` by 1
 * (pairs of those into int32). Either way each block's integer sum is
 * exact, so it is the AVX-512 kernel's; the inputs are rounded to 8 bits
 * by the same operations, xs is summed in the same tree, and the per-block
 * scaling is the same two fused multiply-adds per lane. So a row gets the
 * same bits from this kernel as from the AVX-512 one (tested).
 *
 * The layout is `pack_int4_q8`'s (above). A pass computes half a tile
 * (8 outputs, one register) for up to four rows over every block, which
 * keeps 4 sums, 4 accumulators, the codes and the broadcast inputs within
 * the 16 registers. */
#if !(defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
#if (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) || NEON_DOT
#if NEON_DOT
/* The same kernel on NEON with `sdot` (vdotq_s32): 4 lanes, so a pass's
 * half tile (8 outputs) is two registers; the same operations and bits. */
#define A2_BLOCK 32
#define A2_ROWS 4
#define A2_TILES 3
#define A2_TILE_BLOCK 256

static inline __attribute__((always_inline)) void a2_pass(const uint8_t *w, const uint16_t *sc, const int8_t *xq,
                                                         const float *xd, const float *xs, void *out, int64_t nb,
                                                         int64_t k, int64_t n, const int rows, const int tiles,
                                                         const int c, const int h, const int bf16_out, Prefetch *ahead) {
    const uint8x16_t nibble = vdupq_n_u8(0x0F);
    float32x4_t acc[A2_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        if (ahead) prefetch_some(ahead);
        const uint8_t *wb = w + (b * tiles + c) * A2_TILE_BLOCK + h * 32;
        int32x4_t isum[A2_ROWS][2];
        for (int r = 0; r < rows; r++) isum[r][0] = isum[r][1] = vdupq_n_s32(0);
        for (int j = 0; j < 4; j++) {
            int8x16_t lo[2], hi[2];
            for (int v = 0; v < 2; v++) {
                const uint8x16_t bytes = vld1q_u8(wb + j * 64 + v * 16);
                lo[v] = vreinterpretq_s8_u8(vandq_u8(bytes, nibble));
                hi[v] = vreinterpretq_s8_u8(vshrq_n_u8(bytes, 4));
            }
            for (int r = 0; r < rows; r++) {
                const int8_t *xr = xq + r * k + b * A2_BLOCK + 4 * j;
                int32_t first, second;
                memcpy(&first, xr, sizeof first);
                memcpy(&second, xr + 16, sizeof second);
                const int8x16_t x0 = vreinterpretq_s8_s32(vdupq_n_s32(first)), x1 = vreinterpretq_s8_s32(vdupq_n_s32(second));
                for (int v = 0; v < 2; v++) isum[r][v] = vdotq_s32(vdotq_s32(isum[r][v], lo[v], x0), hi[v], x1);
            }
        }
        const uint16_t *s = sc + (b * tiles + c) * 32 + h * 8;
        for (int v = 0; v < 2; v++) {
            const float32x4_t d = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(s + v * 4)));
            const float32x4_t m = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(s + 16 + v * 4)));
            for (int r = 0; r < rows; r++) {
                const float32x4_t dx = vmulq_f32(d, vdupq_n_f32(xd[r * nb + b]));
                acc[r][v] = vfmaq_f32(acc[r][v], vcvtq_f32_s32(isum[r][v]), dx);
                acc[r][v] = vfmaq_f32(acc[r][v], m, vdupq_n_f32(xs[r * nb + b]));
            }
        }
    }
    const int64_t col = c * 16 + h * 8;
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < 2; v++) {
            if (bf16_out) {
                float f[4];
                vst1q_f32(f, acc[r][v]);
                for (int i = 0; i < 4; i++) ((uint16_t *)out)[r * n + col + v * 4 + i] = float_to_bf16(f[i]);
            } else {
                vst1q_f32((float *)out + r * n + col + v * 4, acc[r][v]);
            }
        }
}

/* `q8a_block` on NEON: the same xq (round half to even), xd and xs bits. */
static inline void a2_q8_block(const uint16_t *src, int8_t *xq, float *xd, float *xs) {
    float32x4_t v[8];
    float32x4_t top = vdupq_n_f32(0.0f);
    for (int i = 0; i < 8; i++) {
        v[i] = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(src + 4 * i), 16));
        top = vmaxq_f32(top, vabsq_f32(v[i]));
    }
    const float amax = vmaxvq_f32(top);
    const float32x4_t inv = vdupq_n_f32(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int i = 0; i < 8; i++) {
        int32_t q[4];
        vst1q_s32(q, vcvtnq_s32_f32(vmulq_f32(v[i], inv)));
        for (int e = 0; e < 4; e++) xq[4 * i + e] = (int8_t)(q[e] > 127 ? 127 : (q[e] < -128 ? -128 : q[e]));
    }
    *xd = amax / 127.0f;
    const float32x4_t s8a = vaddq_f32(vaddq_f32(v[0], v[4]), vaddq_f32(v[2], v[6]));
    const float32x4_t s8b = vaddq_f32(vaddq_f32(v[1], v[5]), vaddq_f32(v[3], v[7]));
    const float32x4_t s4 = vaddq_f32(s8a, s8b);
    const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));
    *xs = vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);
}
#else
#include <immintrin.h>
#define A2_BLOCK 32
#define A2_ROWS 4
#define A2_TILES 3
#define A2_TILE_BLOCK 256

/* acc + the sums of four code bytes (u, 0..15) times four input bytes (s),
 * per int32 lane: exact. */
static inline __attribute__((always_inline)) __m256i a2_dot(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* Says the accumulator is needed in a register now: an empty asm the
 * compiler cannot see through. Without it, GCC (12, -O3) computes a whole
 * block's `vpmaddubsw` products first, spills them to the stack (63 stores
 * a block in the 4-row pass) and sums them at the end; with it each product
 * is added as it comes. Integer sums, so no result changes: the 4-bit
 * kernel at 32-512 rows 250-270 -> 330-370 G int8 ops/s on two cores. */
#define A2_KEEP(v) __asm__("" : "+x"(v))

/* 8 outputs into out[at ..], fp32 or rounded to bf16. */
static inline __attribute__((always_inline)) void a2_store8(void *out, int64_t at, __m256 v, const int bf16_out) {
    if (bf16_out) {
        float f[8];
        _mm256_storeu_ps(f, v);
        for (int i = 0; i < 8; i++) ((uint16_t *)out)[at + i] = float_to_bf16(f[i]);
    } else {
        _mm256_storeu_ps((float *)out + at, v);
    }
}

/* A block's (or a 6-bit half block's) scaling of 8 columns, as every
 * build does it: acc += float(isum) (d xd), then acc += m xs. */
static inline __attribute__((always_inline)) __m256 a2_scale(__m256 acc, __m256i isum, __m256 d, __m256 m, float xd, float xs) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(xd)), acc);
    return _mm256_fmadd_ps(m, _mm256_set1_ps(xs), acc);
}

/* d and m of 8 columns from `s` (a tile-block's 16 d, then its 16 m). */
static inline __attribute__((always_inline)) void a2_dm(const uint16_t *s, __m256 *d, __m256 *m) {
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));
    *m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16)));
}

/* Row r's integer sum of one block of a half tile (8 columns; `wb` their
 * codes, `xb` the rows' inputs of the block, row stride k), rows 0 ..
 * rows - 1, by `a2_dot`; added to isum[r]. */
static inline __attribute__((always_inline)) void a2_half_sums(const uint8_t *wb, const int8_t *xb, int64_t k, const int rows,
                                                              __m256i *isum) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + j * 64));
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int r = 0; r < rows; r++) {
            int32_t first, second;
            memcpy(&first, xb + r * k + 4 * j, sizeof first);
            memcpy(&second, xb + r * k + 16 + 4 * j, sizeof second);
            isum[r] = a2_dot(isum[r], lo, _mm256_set1_epi32(first));
            isum[r] = a2_dot(isum[r], hi, _mm256_set1_epi32(second));
        }
    }
}

/* Without VNNI: row r's int16 sums of one block of a whole tile (both
 * halves, s16[r][h]), each half's eight `vpmaddubsw` added as they come. */
static inline __attribute__((always_inline)) void a2_tile_sums16(const uint8_t *wb, const int8_t *xb, int64_t k, const int rows,
                                                                __m256i (*s16)[2]) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(wb + j * 64));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wb + j * 64 + 32));
        const __m256i lo0 = _mm256_and_si256(v0, nibble), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
        const __m256i lo1 = _mm256_and_si256(v1, nibble), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
        for (int r = 0; r < rows; r++) {
            int32_t first, second;
            memcpy(&first, xb + r * k + 4 * j, sizeof first);
            memcpy(&second, xb + r * k + 16 + 4 * j, sizeof second);
            const __m256i x0 = _mm256_set1_epi32(first), x1 = _mm256_set1_epi32(second);
            s16[r][0] = _mm256_add_epi16(s16[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, x0), _mm256_maddubs_epi16(hi0, x1)));
            s16[r][1] = _mm256_add_epi16(s16[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, x0), _mm256_maddubs_epi16(hi1, x1)));
            A2_KEEP(s16[r][0]);
            A2_KEEP(s16[r][1]);
        }
    }
}

static inline __attribute__((always_inline)) void a2_pass(const uint8_t *w, const uint16_t *sc, const int8_t *xq,
                                                         const float *xd, const float *xs, void *out, int64_t nb,
                                                         int64_t k, int64_t n, const int rows, const int tiles,
                                                         const int c, const int h, const int bf16_out, Prefetch *ahead) {
    __m256 acc[A2_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (ahead) prefetch_some(ahead);
        __m256i isum[A2_ROWS];
        for (int r = 0; r < rows; r++) isum[r] = _mm256_setzero_si256();
        a2_half_sums(w + (b * tiles + c) * A2_TILE_BLOCK + h * 32, xq + b * A2_BLOCK, k, rows, isum);
        __m256 d, m;
        a2_dm(sc + (b * tiles + c) * 32 + h * 8, &d, &m);
        for (int r = 0; r < rows; r++) acc[r] = a2_scale(acc[r], isum[r], d, m, xd[r * nb + b], xs[r * nb + b]);
    }
    for (int r = 0; r < rows; r++) a2_store8(out, r * n + c * 16 + h * 8, acc[r], bf16_out);
}

#if !defined(__AVXVNNI__)
/* `a2_pass` for both halves of a tile at once (AVX2 without VNNI): the
 * inputs' broadcasts serve 16 outputs, and each half's eight `vpmaddubsw`
 * per block are summed in int16 before one `vpmaddwd` (at most 30,720 in
 * size: exact). The same integer sums and the same float steps per half,
 * so the same bits. */
static inline __attribute__((always_inline)) void a2_pass16(const uint8_t *w, const uint16_t *sc, const int8_t *xq,
                                                           const float *xd, const float *xs, void *out, int64_t nb,
                                                           int64_t k, int64_t n, const int rows, const int tiles,
                                                           const int c, const int bf16_out, Prefetch *ahead) {
    __m256 acc[A2_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_some(ahead);
        __m256i s16[A2_ROWS][2];
        for (int r = 0; r < rows; r++) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
        a2_tile_sums16(w + (b * tiles + c) * A2_TILE_BLOCK, xq + b * A2_BLOCK, k, rows, s16);
        for (int h = 0; h < 2; h++) {
            __m256 d, m;
            a2_dm(sc + (b * tiles + c) * 32 + h * 8, &d, &m);
            for (int r = 0; r < rows; r++)
                acc[r][h] = a2_scale(acc[r][h], _mm256_madd_epi16(s16[r][h], _mm256_set1_epi16(1)), d, m, xd[r * nb + b], xs[r * nb + b]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++) a2_store8(out, r * n + c * 16 + h * 8, acc[r][h], bf16_out);
}
#endif

/* One row (a decode step's projections): every tile of the group in one
 * pass, block by block, so the group's weights are read front to back as
 * one stream, with the next group prefetched as the 4-row passes do (those
 * read each tile at a stride of three tiles). Per tile and half, the same
 * integer sums and the same float steps as `a2_pass16` (or `a2_pass` with
 * AVX-VNNI), so the same bits. */
static inline __attribute__((always_inline)) void a2_row1(const uint8_t *w, const uint16_t *sc, const int8_t *xq,
                                                         const float *xd, const float *xs, void *out, int64_t nb,
                                                         const int tiles, const int bf16_out, Prefetch *ahead) {
    __m256 acc[A2_TILES][2];
    for (int c = 0; c < tiles; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_some(ahead);
        for (int c = 0; c < tiles; c++) {
            const uint8_t *wb = w + (b * tiles + c) * A2_TILE_BLOCK;
            __m256i isum[2];
#if defined(__AVXVNNI__)
            for (int h = 0; h < 2; h++) {
                isum[h] = _mm256_setzero_si256();
                a2_half_sums(wb + h * 32, xq + b * A2_BLOCK, 0, 1, &isum[h]);
            }
#else
            __m256i s16[1][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()}};
            a2_tile_sums16(wb, xq + b * A2_BLOCK, 0, 1, s16);
            for (int h = 0; h < 2; h++) isum[h] = _mm256_madd_epi16(s16[0][h], _mm256_set1_epi16(1));
#endif
            for (int h = 0; h < 2; h++) {
                __m256 d, m;
                a2_dm(sc + (b * tiles + c) * 32 + h * 8, &d, &m);
                acc[c][h] = a2_scale(acc[c][h], isum[h], d, m, xd[b], xs[b]);
            }
        }
    }
    for (int c = 0; c < tiles; c++)
        for (int h = 0; h < 2; h++) a2_store8(out, c * 16 + h * 8, acc[c][h], bf16_out);
}

/* `q8a_block` on 256-bit registers: the same xq, xd and xs bits. */
static inline void a2_q8_block(const uint16_t *src, int8_t *xq, float *xd, float *xs) {
    __m256 v[4];
    __m256 top = _mm256_setzero_ps();
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 8 * i))), 16));
        top = _mm256_max_ps(top, _mm256_and_ps(v[i], sign));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    float amax = lanes[0];
    for (int i = 1; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int i = 0; i < 4; i++) {
        int32_t q[8];
        _mm256_storeu_si256((__m256i *)q, _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
        for (int e = 0; e < 8; e++) xq[8 * i + e] = (int8_t)(q[e] > 127 ? 127 : (q[e] < -128 ? -128 : q[e]));
    }
    *xd = amax / 127.0f;
    const __m256 s8 = _mm256_add_ps(_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3]));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    *xs = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

#endif
#if !defined(__AVX2__) || defined(__AVXVNNI__)
#define A2_PASS(R)                                                                                   \
    case R:                                                                                          \
        for (int c = 0; c < tiles; c++)                                                               \
            for (int h = 0; h < 2; h++)                                                               \
                a2_pass(w, sc, xr, xdr, xsr, o, nb, k, n, R, tiles, c, h, bf16_out, c + h ? NULL : ahead); \
        break;
#else
#define A2_PASS(R)                                                                                   \
    case R:                                                                                          \
        for (int c = 0; c < tiles; c++) a2_pass16(w, sc, xr, xdr, xsr, o, nb, k, n, R, tiles, c, bf16_out, ahead); \
        break;
#endif

/* This build's pieces of `trioserve_int4_q8_matmul` (the one driver below). */
#define Q8ACT_KERNEL 1
#define q8act_block a2_q8_block
static void q8act_rows(const uint8_t *w, const uint16_t *sc, const int8_t *xr, const float *xdr, const float *xsr,
                       void *o, int64_t nb, int64_t k, int64_t n, int rows, int tiles, int bf16_out, Prefetch *ahead) {
    switch (rows) {
        A2_PASS(4)
        A2_PASS(3)
        A2_PASS(2)
#if defined(__AVX2__)
    case 1:
        a2_row1(w, sc, xr, xdr, xsr, o, nb, tiles, bf16_out, ahead);
        break;
#else
        A2_PASS(1)
#endif
    }
}
#else
/* Plain C (the generic build, and ARM without the dot-product extension):
 * the same kernel one lane at a time. The integer sums are exact (in any
 * order), the inputs are rounded to 8 bits by `a2_q8_block`'s operations,
 * and each block is scaled by the same two fused multiply-adds (`g_fma`,
 * exact; the library is built without contraction, so nothing else is
 * fused), so a row gets the SIMD builds' bits. */
#define G_ROWS 4

static inline float f16_bits_to_float(uint16_t h);

/* `_mm256_cvtps_epi32` then saturation to a byte, as `a2_q8_block` does:
 * round to nearest even (the default rounding mode, which the library
 * never changes), NaN and values outside int32 to INT32_MIN and so -128.
 * Adding and taking away 1.5 x 2^23 rounds |f| < 2^22 to an integer with
 * ties to even (the sum's last bit is the integer's parity). */
static inline int8_t g_byte(float f) {
    if (!(f >= -2147483648.0f && f < 2147483648.0f)) return -128;
    if (f >= 127.5f) return 127;
    if (f <= -128.5f) return -128;
    return (int8_t)(int32_t)((f + 0x1.8p23f) - 0x1.8p23f);
}

/* `a2_q8_block` one lane at a time: lane l of register i holds input
 * 8 i + l; the maximum of |x| per lane over the 4 registers (maxps: the
 * first operand where it is greater, else the second), then over the 8
 * lanes in order; xs as (0 + 2) + (1 + 3) per lane, then halves folded. */
static inline void g_q8_block(const uint16_t *src, int8_t *xq, float *xd, float *xs) {
    float v[32], top[8];
    for (int i = 0; i < 32; i++) v[i] = bf16_to_float(src[i]);
    for (int l = 0; l < 8; l++) top[l] = 0.0f;
    for (int i = 0; i < 4; i++)
        for (int l = 0; l < 8; l++) {
            uint32_t bits;
            memcpy(&bits, &v[8 * i + l], sizeof bits);
            bits &= 0x7fffffffu;
            float a;
            memcpy(&a, &bits, sizeof a);
            top[l] = top[l] > a ? top[l] : a;
        }
    float amax = top[0];
    for (int l = 1; l < 8; l++) amax = top[l] > amax ? top[l] : amax;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < 32; i++) xq[i] = g_byte(v[i] * inv);
    *xd = amax / 127.0f;
    float s8[8], s4[4];
    for (int l = 0; l < 8; l++) s8[l] = (v[l] + v[16 + l]) + (v[8 + l] + v[24 + l]);
    for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
    *xs = (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* A block's (or a 6-bit half block's) scaling of one column, as every
 * build does it (`a2_scale`): acc += float(isum) (d xd), then acc += m xs. */
static inline float g_scale(float acc, int32_t isum, float d, float m, float xd, float xs) {
    return g_fma(m, xs, g_fma((float)isum, d * xd, acc));
}

/* The 16 d and m of a tile's block (or half block) as floats. */
static inline void g_dm(const uint16_t *d16, const uint16_t *m16, float *d, float *m) {
    for (int i = 0; i < 16; i++) d[i] = f16_bits_to_float(d16[i]);
    for (int i = 0; i < 16; i++) m[i] = m16 ? f16_bits_to_float(m16[i]) : d[i] * -32.0f;
}

/* out[r * n + col] (fp32, or rounded to bf16) = v. */
static inline void g_store(void *out, int64_t at, float v, const int bf16_out) {
    if (bf16_out) ((uint16_t *)out)[at] = float_to_bf16(v);
    else ((float *)out)[at] = v;
}

/* Rows 0 .. rows - 1 (at most 4) times `tiles` tiles of the group, tile by
 * tile, block by block in order: per block the 16 columns' exact sums of
 * code times input byte, then the scaling. */
static inline __attribute__((always_inline)) void g_q4_pass(const uint8_t *w, const uint16_t *sc, const int8_t *xq,
                                                           const float *xd, const float *xs, void *out, int64_t nb,
                                                           int64_t k, int64_t n, const int rows, const int tiles,
                                                           const int bf16_out) {
    for (int c = 0; c < tiles; c++) {
        float acc[G_ROWS][16];
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < 16; i++) acc[r][i] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *wb = w + (b * tiles + c) * 256;
            int32_t isum[G_ROWS][16];
            for (int r = 0; r < rows; r++) {
                const int8_t *xb = xq + r * k + b * 32;
                /* lane 4 i + e: column i's products with inputs 4 j + e and
                 * 16 + 4 j + e summed over the quads j (at most 8 x 15 x 128
                 * in size: exact in int16), then the four lanes of a column */
                int16_t part[64];
                for (int l = 0; l < 64; l++) part[l] = 0;
                for (int j = 0; j < 4; j++) {
                    const uint8_t *q = wb + j * 64;
                    const int16_t x0 = xb[4 * j], x1 = xb[4 * j + 1], x2 = xb[4 * j + 2], x3 = xb[4 * j + 3];
                    const int16_t y0 = xb[16 + 4 * j], y1 = xb[17 + 4 * j], y2 = xb[18 + 4 * j], y3 = xb[19 + 4 * j];
                    for (int i = 0; i < 16; i++) {
                        part[4 * i] = (int16_t)(part[4 * i] + (q[4 * i] & 15) * x0 + (q[4 * i] >> 4) * y0);
                        part[4 * i + 1] = (int16_t)(part[4 * i + 1] + (q[4 * i + 1] & 15) * x1 + (q[4 * i + 1] >> 4) * y1);
                        part[4 * i + 2] = (int16_t)(part[4 * i + 2] + (q[4 * i + 2] & 15) * x2 + (q[4 * i + 2] >> 4) * y2);
                        part[4 * i + 3] = (int16_t)(part[4 * i + 3] + (q[4 * i + 3] & 15) * x3 + (q[4 * i + 3] >> 4) * y3);
                    }
                }
                for (int i = 0; i < 16; i++) isum[r][i] = (part[4 * i] + part[4 * i + 1]) + (part[4 * i + 2] + part[4 * i + 3]);
            }
            float d[16], m[16];
            g_dm(sc + (b * tiles + c) * 32, sc + (b * tiles + c) * 32 + 16, d, m);
            for (int r = 0; r < rows; r++)
                for (int i = 0; i < 16; i++) acc[r][i] = g_scale(acc[r][i], isum[r][i], d[i], m[i], xd[r * nb + b], xs[r * nb + b]);
        }
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < 16; i++) g_store(out, r * n + c * 16 + i, acc[r][i], bf16_out);
    }
}

#define G_Q4_PASS(R)                                                                                 \
    case R:                                                                                          \
        g_q4_pass(w, sc, xr, xdr, xsr, o, nb, k, n, R, tiles, bf16_out);                             \
        break;

/* This build's pieces of `trioserve_int4_q8_matmul` (the one driver below). */
#define Q8ACT_KERNEL 1
#define q8act_block g_q8_block
static void q8act_rows(const uint8_t *w, const uint16_t *sc, const int8_t *xr, const float *xdr, const float *xsr,
                       void *o, int64_t nb, int64_t k, int64_t n, int rows, int tiles, int bf16_out, Prefetch *ahead) {
    (void)ahead;
    switch (rows) {
        G_Q4_PASS(4)
        G_Q4_PASS(3)
        G_Q4_PASS(2)
        G_Q4_PASS(1)
    }
}
#endif
#endif

/* The int8-activation 4-bit kernel's one driver, for whichever build above
 * gave its pieces: each row's inputs to 8 bits per block of 32, then the
 * groups of three tiles split between the threads, rows four at a time
 * (which rows share a pass, and which thread runs a group, changes no bit).
 * Returns 1 when n is not a multiple of 16 or k of 32, 2 when scratch
 * memory cannot be had, else 0. x_bf16: 1 when x is bf16, 0 when fp32. */
#if defined(Q8ACT_KERNEL)
#define Q8ACT_BLOCK 32
#define Q8ACT_ROWS 4
#define Q8ACT_TILES 3
#define Q8ACT_TILE_BLOCK 256

int trioserve_int4_q8_available(void) { return 1; }

int trioserve_int4_q8_matmul(const uint8_t *packed, const uint16_t *scales, const void *x, void *out, int64_t rows,
                             int64_t n, int64_t k, int x_bf16, int bf16_out, int threads) {
    if (n % 16 || k % Q8ACT_BLOCK) return 1;
    const int64_t nb = k / Q8ACT_BLOCK, tiles = n / 16, groups = (tiles + Q8ACT_TILES - 1) / Q8ACT_TILES;
    Q8Scratch q8;
    if (q8_scratch(&q8, x, rows, k, x_bf16, 1)) return 2;
    uint16_t *xh = q8.xh;
    int8_t *xq = q8.xq;
    float *xd = q8.xd, *xs = q8.xs;
    const int nt = threads > 0 ? (threads < MAX_THREADS ? threads : MAX_THREADS) : 1;
    (void)nt;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * nb; i++) q8act_block(xh + i * Q8ACT_BLOCK, xq + i * Q8ACT_BLOCK, xd + i, xs + i);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t t0 = g * Q8ACT_TILES;
            const int tiles_here = tiles - t0 < Q8ACT_TILES ? (int)(tiles - t0) : Q8ACT_TILES;
            const int64_t left = tiles - t0 - tiles_here, next_bytes = (left < Q8ACT_TILES ? left : Q8ACT_TILES) * nb * Q8ACT_TILE_BLOCK;
            const uint8_t *w = packed + t0 * nb * Q8ACT_TILE_BLOCK;
            const uint16_t *sc = scales + t0 * nb * 32;
            Prefetch ahead = prefetch_plan(next_bytes ? w + tiles_here * nb * Q8ACT_TILE_BLOCK : NULL, next_bytes,
                                           ((rows + Q8ACT_ROWS - 1) / Q8ACT_ROWS) * nb);
            for (int64_t r0 = 0; r0 < rows; r0 += Q8ACT_ROWS) {
                void *o = bf16_out ? (void *)((uint16_t *)out + r0 * n + t0 * 16) : (void *)((float *)out + r0 * n + t0 * 16);
                q8act_rows(w, sc, xq + r0 * k, xd + r0 * nb, xs + r0 * nb, o, nb, k, n,
                           (int)(rows - r0 >= Q8ACT_ROWS ? Q8ACT_ROWS : rows - r0), tiles_here, bf16_out, &ahead);
            }
        }
    }
    q8_scratch_free(&q8);
    return 0;
}
#else
#error "no build of the int8-activation kernel's pieces (every build has one: AVX-512 VNNI, AVX2, NEON sdot or plain C)"
#endif

/* Codes of up to 6 bits, one byte each, with int8 activations
 * (`trioserve_int6_q8_matmul`): what GGUF's Q6_K, Q5_K, Q5_0 and Q5_1
 * tensors become at load (kernels/int6.py). Each group of 16 inputs has its
 * own f16 scale d and offset m, w = d u + m with u in 0..63 (so `vpmaddubsw`
 * cannot saturate: two products sum to at most 2 x 63 x 127). Inputs are
 * rounded to 8 bits per block of 32 as for the 4-bit kernel (xq, xd), and
 * each group of 16 takes the exact sum of its bf16 inputs, xs16: lanes
 * i + (8 + i), then 4 + 4, 2 + 2, 1 + 1. Per group, in order:
 *   acc = fma(float(isum), d xd, acc);  acc = fma(m, xs16, acc)
 * so a row's result depends on that row alone, and every build (AVX-512
 * VNNI; AVX2 with AVX-VNNI or with vpmaddubsw + vpmaddwd) gives the same
 * bits: the integer sums are exact and the rest is the same operations.
 *
 * Layout (kernels/int6.py `pack_int6_q8`): tiles of 16 outputs in groups of
 * three (the last may hold fewer); for group g of T tiles, block b (32
 * inputs), tile t, half h (inputs 16h .. 16h + 15), the codes of quads
 * j = 0..3 (inputs 16h + 4j .. 16h + 4j + 3) as 6 bits each, 384 bytes a
 * tile and block (the file's 6 bits a code, not a byte):
 *   packed [g][K/32][T][2][3][16][4] bytes: per half, plane 0 holds quad 0's
 *          low 4 bits in the low nibble and quad 1's in the high one, plane
 *          1 quads 2 and 3 alike, plane 2 the top 2 bits of quads 0, 1, 2, 3
 *          in bits 0-1, 2-3, 4-5, 6-7 (column i, input e of the quad at
 *          [i][e] in each plane);
 *   scales [g][K/32][T][4][16] f16: d of inputs 0-15, m of 0-15, d of 16-31, m of 16-31;
 *          or, for a symmetric weight (Q6_K: m = -32 d in every group,
 *          `trioserve_int6s_q8_matmul`), [g][K/32][T][2][16]: d of 0-15, d of
 *          16-31, and m = -32 d made in a register (exact: a power of two).
 * Unpacking is bit masks and shifts, so every build sums the same codes. */
#define I6_BLOCK 32
#define I6_TILE_BLOCK 384
#define I6_HALF 192
#define I8_TILE_BLOCK 512
#define I6_TILES 3
#define I6_ROWS 4

/* The 16 d of half `half` of tile-block `tb` (b * tiles + c); m follows
 * them unless the weight is symmetric (the scales layout above). */
static inline const uint16_t *i6_scales(const uint16_t *sc, int64_t tb, int half, const int sym) {
    return sym ? sc + (tb * 2 + half) * 16 : sc + (tb * 4 + 2 * half) * 16;
}

/* The two group-of-16 sums of one block's bf16 inputs, in the order above. */
static inline void i6_sums16(const uint16_t *src, float *out) {
    for (int h = 0; h < 2; h++) {
        float s8[8], s4[4], s2[2];
        for (int i = 0; i < 8; i++) s8[i] = bf16_to_float(src[16 * h + i]) + bf16_to_float(src[16 * h + 8 + i]);
        for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
        for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
        out[h] = s2[0] + s2[1];
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define I6_WIDE 1
/* Quad j's codes of a half: `low` its plane (0 or 1), `top` plane 2. Shifts
 * are 16-bit (there are no byte shifts); the masks drop what crossed a byte. */
static inline __attribute__((always_inline)) __m512i six16(__m512i low, __m512i top, const int j) {
    const __m512i lo = (j & 1) ? _mm512_srli_epi16(low, 4) : low;
    const __m512i hi = j == 0 ? _mm512_slli_epi16(top, 4) : j == 1 ? _mm512_slli_epi16(top, 2) : j == 2 ? top : _mm512_srli_epi16(top, 2);
    return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi8(0x0F)), _mm512_and_si512(hi, _mm512_set1_epi8(0x30)));
}
static inline __attribute__((always_inline)) void i6_pass(const uint8_t *w, const uint16_t *sc, const int8_t *xq,
                                                         const float *xd, const float *xs, void *out, int64_t nb,
                                                         int64_t k, int64_t n, const int rows, const int tiles,
                                                         const int bf16_out, const int sym, Prefetch *ahead) {
    __m512 acc[I6_ROWS][I6_TILES];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < tiles; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_some(ahead);
        for (int half = 0; half < 2; half++) {
            __m512i isum[I6_ROWS][I6_TILES];
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < tiles; c++) isum[r][c] = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                __m512i v[I6_TILES];
                for (int c = 0; c < tiles; c++) {
                    const uint8_t *at = w + (b * tiles + c) * I6_TILE_BLOCK + half * I6_HALF;
                    v[c] = six16(_mm512_loadu_si512((const void *)(at + (j >> 1) * 64)), _mm512_loadu_si512((const void *)(at + 128)), j);
                }
                for (int r = 0; r < rows; r++) {
                    int32_t quad;
                    memcpy(&quad, xq + r * k + b * I6_BLOCK + 16 * half + 4 * j, sizeof quad);
                    const __m512i x = _mm512_set1_epi32(quad);
                    for (int c = 0; c < tiles; c++) isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], v[c], x);
                }
            }
            for (int c = 0; c < tiles; c++) {
                const uint16_t *s = i6_scales(sc, b * tiles + c, half, sym);
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
                const __m512 m = sym ? _mm512_mul_ps(d, _mm512_set1_ps(-32.0f)) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 16)));
                for (int r = 0; r < rows; r++) {
                    const __m512 dx = _mm512_mul_ps(d, _mm512_set1_ps(xd[r * nb + b]));
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][c]), dx, acc[r][c]);
                    acc[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[(r * nb + b) * 2 + half]), acc[r][c]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < tiles; c++) {
            if (bf16_out) _mm256_storeu_si256((__m256i *)((uint16_t *)out + r * n + c * 16), bf16_of16(acc[r][c]));
            else _mm512_storeu_ps((float *)out + r * n + c * 16, acc[r][c]);
        }
}
/* Signed 8-bit codes (Q8_0): |w| as the unsigned operand and the input's
 * sign flipped where w < 0, so vpdpbusd sums w x exactly. */
static inline __attribute__((always_inline)) void i8_pass(const int8_t *w, const uint16_t *sc, const int8_t *xq,
                                                         const float *xd, void *out, int64_t nb, int64_t k, int64_t n,
                                                         const int rows, const int tiles, const int bf16_out, Prefetch *ahead) {
    __m512 acc[I6_ROWS][I6_TILES];
    const __m512i zero = _mm512_setzero_si512();
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < tiles; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_some(ahead);
        __m512i isum[I6_ROWS][I6_TILES];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < tiles; c++) isum[r][c] = zero;
        for (int j = 0; j < 8; j++) {
            __m512i mag[I6_TILES];
            __mmask64 neg[I6_TILES];
            for (int c = 0; c < tiles; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(w + (b * tiles + c) * I8_TILE_BLOCK + j * 64));
                mag[c] = _mm512_abs_epi8(v);
                neg[c] = _mm512_movepi8_mask(v);
            }
            for (int r = 0; r < rows; r++) {
                int32_t quad;
                memcpy(&quad, xq + r * k + b * I6_BLOCK + 4 * j, sizeof quad);
                const __m512i x = _mm512_set1_epi32(quad);
                for (int c = 0; c < tiles; c++)
                    isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], mag[c], _mm512_mask_sub_epi8(x, neg[c], zero, x));
            }
        }
        for (int c = 0; c < tiles; c++) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + (b * tiles + c) * 16)));
            for (int r = 0; r < rows; r++)
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][c]), _mm512_mul_ps(d, _mm512_set1_ps(xd[r * nb + b])), acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < tiles; c++) {
            if (bf16_out) _mm256_storeu_si256((__m256i *)((uint16_t *)out + r * n + c * 16), bf16_of16(acc[r][c]));
            else _mm512_storeu_ps((float *)out + r * n + c * 16, acc[r][c]);
        }
}
#define I6_QUANTIZE q8a_block
#elif NEON_DOT
#define I6_WIDE 0
static inline __attribute__((always_inline)) uint8x16_t six4(uint8x16_t low, uint8x16_t top, const int j) {
    const uint8x16_t lo = (j & 1) ? vshrq_n_u8(low, 4) : vandq_u8(low, vdupq_n_u8(0x0F));
    const uint8x16_t hi = j == 0 ? vshlq_n_u8(top, 4) : j == 1 ? vshlq_n_u8(top, 2) : j == 2 ? top : vshrq_n_u8(top, 2);
    return vorrq_u8(lo, vandq_u8(hi, vdupq_n_u8(0x30)));
}
static inline __attribute__((always_inline)) void i6_pass(const uint8_t *w, const uint16_t *sc, const int8_t *xq,
                                                         const float *xd, const float *xs, void *out, int64_t nb,
                                                         int64_t k, int64_t n, const int rows, const int tiles,
                                                         const int bf16_out, const int sym, Prefetch *ahead) {
    for (int c = 0; c < tiles; c++)
        for (int q4 = 0; q4 < 4; q4++) { /* four outputs at a time */
            float32x4_t acc[I6_ROWS];
            for (int r = 0; r < rows; r++) acc[r] = vdupq_n_f32(0.0f);
            for (int64_t b = 0; b < nb; b++) {
                if (c + q4 == 0) prefetch_some(ahead); /* the next group, during the first pass */
                for (int half = 0; half < 2; half++) {
                    int32x4_t isum[I6_ROWS];
                    for (int r = 0; r < rows; r++) isum[r] = vdupq_n_s32(0);
                    const uint8_t *at = w + (b * tiles + c) * I6_TILE_BLOCK + half * I6_HALF + q4 * 16;
                    for (int j = 0; j < 4; j++) {
                        const int8x16_t v = vreinterpretq_s8_u8(six4(vld1q_u8(at + (j >> 1) * 64), vld1q_u8(at + 128), j));
                        for (int r = 0; r < rows; r++) {
                            int32_t quad;
                            memcpy(&quad, xq + r * k + b * I6_BLOCK + 16 * half + 4 * j, sizeof quad);
                            isum[r] = vdotq_s32(isum[r], v, vreinterpretq_s8_s32(vdupq_n_s32(quad)));
                        }
                    }
                    const uint16_t *s = i6_scales(sc, b * tiles + c, half, sym) + q4 * 4;
                    const float32x4_t d = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(s)));
                    const float32x4_t m = sym ? vmulq_f32(d, vdupq_n_f32(-32.0f)) : vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(s + 16)));
                    for (int r = 0; r < rows; r++) {
                        const float32x4_t dx = vmulq_f32(d, vdupq_n_f32(xd[r * nb + b]));
                        acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(isum[r]), dx);
                        acc[r] = vfmaq_f32(acc[r], m, vdupq_n_f32(xs[(r * nb + b) * 2 + half]));
                    }
                }
            }
            const int64_t col = c * 16 + q4 * 4;
            for (int r = 0; r < rows; r++) {
                if (bf16_out) {
                    float f[4];
                    vst1q_f32(f, acc[r]);
                    for (int i = 0; i < 4; i++) ((uint16_t *)out)[r * n + col + i] = float_to_bf16(f[i]);
                } else {
                    vst1q_f32((float *)out + r * n + col, acc[r]);
                }
            }
        }
}
/* Signed 8-bit codes (Q8_0): sdot takes both signed. */
static inline __attribute__((always_inline)) void i8_pass(const int8_t *w, const uint16_t *sc, const int8_t *xq,
                                                         const float *xd, void *out, int64_t nb, int64_t k, int64_t n,
                                                         const int rows, const int tiles, const int bf16_out, Prefetch *ahead) {
    for (int c = 0; c < tiles; c++)
        for (int q4 = 0; q4 < 4; q4++) {
            float32x4_t acc[I6_ROWS];
            for (int r = 0; r < rows; r++) acc[r] = vdupq_n_f32(0.0f);
            for (int64_t b = 0; b < nb; b++) {
                if (c + q4 == 0) prefetch_some(ahead);
                int32x4_t isum[I6_ROWS];
                for (int r = 0; r < rows; r++) isum[r] = vdupq_n_s32(0);
                for (int j = 0; j < 8; j++) {
                    const int8x16_t v = vld1q_s8(w + (b * tiles + c) * I8_TILE_BLOCK + j * 64 + q4 * 16);
                    for (int r = 0; r < rows; r++) {
                        int32_t quad;
                        memcpy(&quad, xq + r * k + b * I6_BLOCK + 4 * j, sizeof quad);
                        isum[r] = vdotq_s32(isum[r], v, vreinterpretq_s8_s32(vdupq_n_s32(quad)));
                    }
                }
                const float32x4_t d = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(sc + (b * tiles + c) * 16 + q4 * 4)));
                for (int r = 0; r < rows; r++) acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(isum[r]), vmulq_f32(d, vdupq_n_f32(xd[r * nb + b])));
            }
            const int64_t col = c * 16 + q4 * 4;
            for (int r = 0; r < rows; r++) {
                if (bf16_out) {
                    float f[4];
                    vst1q_f32(f, acc[r]);
                    for (int i = 0; i < 4; i++) ((uint16_t *)out)[r * n + col + i] = float_to_bf16(f[i]);
                } else {
                    vst1q_f32((float *)out + r * n + col, acc[r]);
                }
            }
        }
}
#define I6_QUANTIZE a2_q8_block
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define I6_WIDE 0
/* `six16` on 256-bit registers. */
static inline __attribute__((always_inline)) __m256i six8(__m256i low, __m256i top, const int j) {
    const __m256i lo = (j & 1) ? _mm256_srli_epi16(low, 4) : low;
    const __m256i hi = j == 0 ? _mm256_slli_epi16(top, 4) : j == 1 ? _mm256_slli_epi16(top, 2) : j == 2 ? top : _mm256_srli_epi16(top, 2);
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(0x0F)), _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}
/* Row r's integer sum, for rows 0 .. rows - 1, of one half block (16
 * inputs) of 8 columns: `at` the half's codes for those columns, `xr` the
 * rows' inputs of that half (row stride k). Added to isum[r]. */
static inline __attribute__((always_inline)) void i6_half_sums(const uint8_t *at, const int8_t *xr, int64_t k, const int rows,
                                                              __m256i *isum) {
    const __m256i top = _mm256_loadu_si256((const __m256i *)(at + 128));
#if defined(__AVXVNNI__)
    for (int j = 0; j < 4; j++) {
        const __m256i v = six8(_mm256_loadu_si256((const __m256i *)(at + (j >> 1) * 64)), top, j);
        for (int r = 0; r < rows; r++) {
            int32_t quad;
            memcpy(&quad, xr + r * k + 4 * j, sizeof quad);
            isum[r] = a2_dot(isum[r], v, _mm256_set1_epi32(quad));
        }
    }
#else
    /* Two quads' `vpmaddubsw` results summed in int16 before one
     * `vpmaddwd`: each is at most 2 x 63 x 128 = 16,128 in size, two
     * 32,256, so the int32 sums are the VNNI build's. */
    for (int j = 0; j < 4; j += 2) {
        const __m256i low = _mm256_loadu_si256((const __m256i *)(at + (j >> 1) * 64));
        const __m256i v0 = six8(low, top, j), v1 = six8(low, top, j + 1);
        for (int r = 0; r < rows; r++) {
            int32_t quad[2];
            memcpy(quad, xr + r * k + 4 * j, sizeof quad);
            const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(v0, _mm256_set1_epi32(quad[0])),
                                                  _mm256_maddubs_epi16(v1, _mm256_set1_epi32(quad[1])));
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pair, _mm256_set1_epi16(1)));
            A2_KEEP(isum[r]);
        }
    }
#endif
}

/* d and m of half `half`, columns 8 h8 .. 8 h8 + 7, of tile-block tb. */
static inline __attribute__((always_inline)) void i6_dm(const uint16_t *sc, int64_t tb, int half, int h8, const int sym, __m256 *d,
                                                       __m256 *m) {
    const uint16_t *s = i6_scales(sc, tb, half, sym) + h8 * 8;
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));
    *m = sym ? _mm256_mul_ps(*d, _mm256_set1_ps(-32.0f)) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16)));
}

static inline __attribute__((always_inline)) void i6_half_pass(const uint8_t *w, const uint16_t *sc, const int8_t *xq,
                                                              const float *xd, const float *xs, void *out, int64_t nb,
                                                              int64_t k, int64_t n, const int rows, const int tiles,
                                                              const int c, const int h8, const int bf16_out, const int sym,
                                                              Prefetch *ahead) {
    __m256 acc[I6_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (ahead) prefetch_some(ahead);
        for (int half = 0; half < 2; half++) {
            __m256i isum[I6_ROWS];
            for (int r = 0; r < rows; r++) isum[r] = _mm256_setzero_si256();
            i6_half_sums(w + (b * tiles + c) * I6_TILE_BLOCK + half * I6_HALF + h8 * 32, xq + b * I6_BLOCK + 16 * half, k, rows, isum);
            __m256 d, m;
            i6_dm(sc, b * tiles + c, half, h8, sym, &d, &m);
            for (int r = 0; r < rows; r++) acc[r] = a2_scale(acc[r], isum[r], d, m, xd[r * nb + b], xs[(r * nb + b) * 2 + half]);
        }
    }
    for (int r = 0; r < rows; r++) a2_store8(out, r * n + c * 16 + h8 * 8, acc[r], bf16_out);
}

/* One row: every tile and both halves of its columns in one pass, block by
 * block, so the group is read front to back as one stream (see `a2_row1`);
 * per tile, half and 8 columns the same operations as `i6_half_pass`. */
static inline __attribute__((always_inline)) void i6_row1(const uint8_t *w, const uint16_t *sc, const int8_t *xq, const float *xd,
                                                         const float *xs, void *out, int64_t nb, const int tiles,
                                                         const int bf16_out, const int sym, Prefetch *ahead) {
    __m256 acc[I6_TILES][2];
    for (int c = 0; c < tiles; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_some(ahead);
        for (int half = 0; half < 2; half++)
            for (int c = 0; c < tiles; c++)
                for (int h8 = 0; h8 < 2; h8++) {
                    __m256i isum = _mm256_setzero_si256();
                    i6_half_sums(w + (b * tiles + c) * I6_TILE_BLOCK + half * I6_HALF + h8 * 32, xq + b * I6_BLOCK + 16 * half, 0, 1,
                                 &isum);
                    __m256 d, m;
                    i6_dm(sc, b * tiles + c, half, h8, sym, &d, &m);
                    acc[c][h8] = a2_scale(acc[c][h8], isum, d, m, xd[b], xs[b * 2 + half]);
                }
    }
    for (int c = 0; c < tiles; c++)
        for (int h8 = 0; h8 < 2; h8++) a2_store8(out, c * 16 + h8 * 8, acc[c][h8], bf16_out);
}

static inline __attribute__((always_inline)) void i6_pass(const uint8_t *w, const uint16_t *sc, const int8_t *xq,
                                                         const float *xd, const float *xs, void *out, int64_t nb,
                                                         int64_t k, int64_t n, const int rows, const int tiles,
                                                         const int bf16_out, const int sym, Prefetch *ahead) {
    if (rows == 1) {
        i6_row1(w, sc, xq, xd, xs, out, nb, tiles, bf16_out, sym, ahead);
        return;
    }
    for (int c = 0; c < tiles; c++)
        for (int h8 = 0; h8 < 2; h8++)
            i6_half_pass(w, sc, xq, xd, xs, out, nb, k, n, rows, tiles, c, h8, bf16_out, sym, c + h8 ? NULL : ahead);
}

/* Signed 8-bit codes (Q8_0): |w| as the unsigned operand and the input's
 * sign flipped where w < 0 (zeroed where w = 0), so vpmaddubsw cannot
 * saturate (two products sum to at most 2 x 128 x 127) and the sum is w x.
 * Row r's integer sum of one block of 8 columns (`at` the block's codes for
 * them, `xr` the rows' inputs of the block, row stride k), added to isum[r]. */
static inline __attribute__((always_inline)) void i8_block_sums(const int8_t *at, const int8_t *xr, int64_t k, const int rows,
                                                               __m256i *isum) {
    for (int j = 0; j < 8; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(at + j * 64));
        const __m256i mag = _mm256_sign_epi8(v, v);
        for (int r = 0; r < rows; r++) {
            int32_t quad;
            memcpy(&quad, xr + r * k + 4 * j, sizeof quad);
            isum[r] = a2_dot(isum[r], mag, _mm256_sign_epi8(_mm256_set1_epi32(quad), v));
            A2_KEEP(isum[r]);
        }
    }
}

static inline __attribute__((always_inline)) __m256 i8_d(const uint16_t *sc, int64_t tb, int h8) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + tb * 16 + h8 * 8)));
}

static inline __attribute__((always_inline)) void i8_half_pass(const int8_t *w, const uint16_t *sc, const int8_t *xq,
                                                              const float *xd, void *out, int64_t nb, int64_t k,
                                                              int64_t n, const int rows, const int tiles, const int c,
                                                              const int h8, const int bf16_out, Prefetch *ahead) {
    __m256 acc[I6_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (ahead) prefetch_some(ahead);
        __m256i isum[I6_ROWS];
        for (int r = 0; r < rows; r++) isum[r] = _mm256_setzero_si256();
        i8_block_sums(w + (b * tiles + c) * I8_TILE_BLOCK + h8 * 32, xq + b * I6_BLOCK, k, rows, isum);
        const __m256 d = i8_d(sc, b * tiles + c, h8);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(xd[r * nb + b])), acc[r]);
    }
    for (int r = 0; r < rows; r++) a2_store8(out, r * n + c * 16 + h8 * 8, acc[r], bf16_out);
}

/* One row of the 8-bit kernel, every tile in one pass (as `i6_row1`). */
static inline __attribute__((always_inline)) void i8_row1(const int8_t *w, const uint16_t *sc, const int8_t *xq, const float *xd,
                                                         void *out, int64_t nb, const int tiles, const int bf16_out, Prefetch *ahead) {
    __m256 acc[I6_TILES][2];
    for (int c = 0; c < tiles; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_some(ahead);
        for (int c = 0; c < tiles; c++)
            for (int h8 = 0; h8 < 2; h8++) {
                __m256i isum = _mm256_setzero_si256();
                i8_block_sums(w + (b * tiles + c) * I8_TILE_BLOCK + h8 * 32, xq + b * I6_BLOCK, 0, 1, &isum);
                acc[c][h8] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(i8_d(sc, b * tiles + c, h8), _mm256_set1_ps(xd[b])),
                                             acc[c][h8]);
            }
    }
    for (int c = 0; c < tiles; c++)
        for (int h8 = 0; h8 < 2; h8++) a2_store8(out, c * 16 + h8 * 8, acc[c][h8], bf16_out);
}

static inline __attribute__((always_inline)) void i8_pass(const int8_t *w, const uint16_t *sc, const int8_t *xq,
                                                         const float *xd, void *out, int64_t nb, int64_t k, int64_t n,
                                                         const int rows, const int tiles, const int bf16_out, Prefetch *ahead) {
    if (rows == 1) {
        i8_row1(w, sc, xq, xd, out, nb, tiles, bf16_out, ahead);
        return;
    }
    for (int c = 0; c < tiles; c++)
        for (int h8 = 0; h8 < 2; h8++) i8_half_pass(w, sc, xq, xd, out, nb, k, n, rows, tiles, c, h8, bf16_out, c + h8 ? NULL : ahead);
}
#define I6_QUANTIZE a2_q8_block
#else
/* Plain C (the generic build, ARM without dot products): the 6- and 8-bit
 * kernels one lane at a time, with the 4-bit one's `g_q8_block` and
 * `g_scale`. The same codes (the masks and shifts of `six8`, per byte), the
 * same exact integer sums, the same float steps in the same order: the
 * same bits as every SIMD build. */
#define I6_WIDE 0
static inline __attribute__((always_inline)) void i6_pass(const uint8_t *w, const uint16_t *sc, const int8_t *xq,
                                                         const float *xd, const float *xs, void *out, int64_t nb,
                                                         int64_t k, int64_t n, const int rows, const int tiles,
                                                         const int bf16_out, const int sym, Prefetch *ahead) {
    (void)ahead;
    for (int c = 0; c < tiles; c++) {
        float acc[I6_ROWS][16];
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < 16; i++) acc[r][i] = 0.0f;
        for (int64_t b = 0; b < nb; b++)
            for (int half = 0; half < 2; half++) {
                const uint8_t *at = w + (b * tiles + c) * I6_TILE_BLOCK + half * I6_HALF;
                uint8_t u[4][64]; /* quad j, lane 4 i + e (column i, input e): the code, 0..63 */
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 64; l++)
                        u[j][l] = (uint8_t)(((at[(j >> 1) * 64 + l] >> (4 * (j & 1))) & 0x0F) | (((at[128 + l] >> (2 * j)) & 3) << 4));
                int32_t isum[I6_ROWS][16];
                for (int r = 0; r < rows; r++) {
                    const int8_t *xh = xq + r * k + b * I6_BLOCK + 16 * half;
                    /* lane 4 i + e: column i's products with inputs 4 j + e
                     * summed over the quads j (at most 4 x 63 x 128 in size:
                     * exact in int16), then the four lanes of a column */
                    int16_t part[64];
                    for (int l = 0; l < 64; l++) part[l] = 0;
                    for (int j = 0; j < 4; j++) {
                        const int16_t x0 = xh[4 * j], x1 = xh[4 * j + 1], x2 = xh[4 * j + 2], x3 = xh[4 * j + 3];
                        for (int i = 0; i < 16; i++) {
                            part[4 * i] = (int16_t)(part[4 * i] + u[j][4 * i] * x0);
                            part[4 * i + 1] = (int16_t)(part[4 * i + 1] + u[j][4 * i + 1] * x1);
                            part[4 * i + 2] = (int16_t)(part[4 * i + 2] + u[j][4 * i + 2] * x2);
                            part[4 * i + 3] = (int16_t)(part[4 * i + 3] + u[j][4 * i + 3] * x3);
                        }
                    }
                    for (int i = 0; i < 16; i++) isum[r][i] = (part[4 * i] + part[4 * i + 1]) + (part[4 * i + 2] + part[4 * i + 3]);
                }
                const uint16_t *s = i6_scales(sc, b * tiles + c, half, sym);
                float d[16], m[16];
                g_dm(s, sym ? NULL : s + 16, d, m);
                for (int r = 0; r < rows; r++)
                    for (int i = 0; i < 16; i++)
                        acc[r][i] = g_scale(acc[r][i], isum[r][i], d[i], m[i], xd[r * nb + b], xs[(r * nb + b) * 2 + half]);
            }
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < 16; i++) g_store(out, r * n + c * 16 + i, acc[r][i], bf16_out);
    }
}
/* Signed 8-bit codes (Q8_0): the SIMD builds' product, |w| times the input
 * with its sign flipped where w < 0 (a byte's negation: -128 stays -128),
 * which is w x for every input byte the rounding makes (-127..127). */
static inline __attribute__((always_inline)) void i8_pass(const int8_t *w, const uint16_t *sc, const int8_t *xq,
                                                         const float *xd, void *out, int64_t nb, int64_t k, int64_t n,
                                                         const int rows, const int tiles, const int bf16_out, Prefetch *ahead) {
    (void)ahead;
    for (int c = 0; c < tiles; c++) {
        float acc[I6_ROWS][16];
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < 16; i++) acc[r][i] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *at = w + (b * tiles + c) * I8_TILE_BLOCK;
            int32_t isum[I6_ROWS][16];
            for (int r = 0; r < rows; r++) {
                const int8_t *xb = xq + r * k + b * I6_BLOCK;
                int wrap = 0;
                for (int t = 0; t < 32; t++) wrap |= xb[t] == -128;
                if (!wrap) {
                    /* lane 4 i + e: column i's products with inputs 4 j + e,
                     * in pairs of quads (at most 2 x 128 x 127 in size: exact
                     * in int16) added to int32, then the four lanes of a column */
                    int32_t part[64];
                    for (int l = 0; l < 64; l++) part[l] = 0;
                    for (int j = 0; j < 8; j += 2) {
                        const int8_t *q0 = at + j * 64, *q1 = q0 + 64;
                        const int16_t x0 = xb[4 * j], x1 = xb[4 * j + 1], x2 = xb[4 * j + 2], x3 = xb[4 * j + 3];
                        const int16_t y0 = xb[4 * j + 4], y1 = xb[4 * j + 5], y2 = xb[4 * j + 6], y3 = xb[4 * j + 7];
                        for (int i = 0; i < 16; i++) {
                            part[4 * i] += (int16_t)(q0[4 * i] * x0 + q1[4 * i] * y0);
                            part[4 * i + 1] += (int16_t)(q0[4 * i + 1] * x1 + q1[4 * i + 1] * y1);
                            part[4 * i + 2] += (int16_t)(q0[4 * i + 2] * x2 + q1[4 * i + 2] * y2);
                            part[4 * i + 3] += (int16_t)(q0[4 * i + 3] * x3 + q1[4 * i + 3] * y3);
                        }
                    }
                    for (int i = 0; i < 16; i++) isum[r][i] = (part[4 * i] + part[4 * i + 1]) + (part[4 * i + 2] + part[4 * i + 3]);
                } else { /* an input byte of -128 (NaN, infinite or subnormal inputs): its sign flipped stays -128 */
                    for (int i = 0; i < 16; i++) {
                        int32_t s = 0;
                        for (int j = 0; j < 8; j++)
                            for (int e = 0; e < 4; e++) {
                                const int v = at[j * 64 + i * 4 + e], x = xb[4 * j + e];
                                s += v < 0 ? -v * (x == -128 ? -128 : -x) : v * x;
                            }
                        isum[r][i] = s;
                    }
                }
            }
            float d[16];
            for (int i = 0; i < 16; i++) d[i] = f16_bits_to_float(sc[(b * tiles + c) * 16 + i]);
            for (int r = 0; r < rows; r++)
                for (int i = 0; i < 16; i++) acc[r][i] = g_fma((float)isum[r][i], d[i] * xd[r * nb + b], acc[r][i]);
        }
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < 16; i++) g_store(out, r * n + c * 16 + i, acc[r][i], bf16_out);
    }
}
#define I6_QUANTIZE g_q8_block
#endif

#if defined(I6_WIDE)
#define I6_TILES_CASE(R, S)                                                                          \
    if (tiles_here == 3) i6_pass(w, sc, xr, xdr, xsr, o, nb, k, n, R, 3, bf16_out, S, &ahead);       \
    else if (tiles_here == 2) i6_pass(w, sc, xr, xdr, xsr, o, nb, k, n, R, 2, bf16_out, S, &ahead);  \
    else i6_pass(w, sc, xr, xdr, xsr, o, nb, k, n, R, 1, bf16_out, S, &ahead);
#define I6_CASE(R)                                                                                   \
    case R:                                                                                          \
        if (sym) {                                                                                   \
            I6_TILES_CASE(R, 1)                                                                      \
        } else {                                                                                     \
            I6_TILES_CASE(R, 0)                                                                      \
        }                                                                                            \
        break;

#define I8_CASE(R)                                                                                   \
    case R:                                                                                          \
        if (tiles_here == 3) i8_pass((const int8_t *)w, sc, xr, xdr, o, nb, k, n, R, 3, bf16_out, &ahead); \
        else if (tiles_here == 2) i8_pass((const int8_t *)w, sc, xr, xdr, o, nb, k, n, R, 2, bf16_out, &ahead); \
        else i8_pass((const int8_t *)w, sc, xr, xdr, o, nb, k, n, R, 1, bf16_out, &ahead);           \
        break;

int trioserve_int6_q8_available(void) { return 1; }
int trioserve_int8_q8_available(void) { return 1; }

/* The one driver of the 6-bit kernel (symmetric or not, `sym`) and the
 * signed 8-bit one (`eight`): each row's inputs to 8 bits per block of 32
 * (and, for 6 bits, the sums of 16), then the groups of three tiles split
 * between the threads, rows four at a time. Returns 1 when n is not a
 * multiple of 16 or k of 32, 2 when scratch memory cannot be had, else 0.
 * x [R, K] bf16 or fp32; out [R, N] fp32 or bf16. */
static int codes_q8_matmul(const uint8_t *packed, const uint16_t *scales, const void *x, void *out, int64_t rows,
                           int64_t n, int64_t k, int x_bf16, int bf16_out, int threads, const int eight, const int sym) {
    if (n % 16 || k % I6_BLOCK) return 1;
    const int64_t nb = k / I6_BLOCK, tiles = n / 16, groups = (tiles + I6_TILES - 1) / I6_TILES;
    const int64_t scales_per_block = eight ? 16 : sym ? 32 : 64, tile_block = eight ? I8_TILE_BLOCK : I6_TILE_BLOCK;
    Q8Scratch q8;
    if (q8_scratch(&q8, x, rows, k, x_bf16, 2)) return 2;
    uint16_t *xh = q8.xh;
    int8_t *xq = q8.xq;
    float *xd = q8.xd, *xs = q8.xs;
    const int nt = threads > 0 ? (threads < MAX_THREADS ? threads : MAX_THREADS) : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * nb; i++) {
            float unused;
            I6_QUANTIZE(xh + i * I6_BLOCK, xq + i * I6_BLOCK, xd + i, &unused);
            if (!eight) i6_sums16(xh + i * I6_BLOCK, xs + 2 * i);
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t t0 = g * I6_TILES;
            const int tiles_here = tiles - t0 < I6_TILES ? (int)(tiles - t0) : I6_TILES;
            const uint8_t *w = packed + t0 * nb * tile_block;
            const uint16_t *sc = scales + t0 * nb * scales_per_block;
            const int64_t left = tiles - t0 - tiles_here, next_bytes = (left < I6_TILES ? left : I6_TILES) * nb * tile_block;
            Prefetch ahead = prefetch_plan(next_bytes ? w + tiles_here * nb * tile_block : NULL, next_bytes,
                                           ((rows + I6_ROWS - 1) / I6_ROWS) * nb);
            for (int64_t r0 = 0; r0 < rows; r0 += I6_ROWS) {
                const int8_t *xr = xq + r0 * k;
                const float *xdr = xd + r0 * nb, *xsr = xs + r0 * nb * 2;
                void *o = bf16_out ? (void *)((uint16_t *)out + r0 * n + t0 * 16) : (void *)((float *)out + r0 * n + t0 * 16);
                const int here = (int)(rows - r0 >= I6_ROWS ? I6_ROWS : rows - r0);
                if (eight) {
                    switch (here) {
                        I8_CASE(4)
                        I8_CASE(3)
                        I8_CASE(2)
                        I8_CASE(1)
                    }
                } else {
                    switch (here) {
                        I6_CASE(4)
                        I6_CASE(3)
                        I6_CASE(2)
                        I6_CASE(1)
                    }
                }
            }
        }
    }
    q8_scratch_free(&q8);
    return 0;
}

int trioserve_int6_q8_matmul(const uint8_t *packed, const uint16_t *scales, const void *x, void *out, int64_t rows,
                             int64_t n, int64_t k, int x_bf16, int bf16_out, int threads) {
    return codes_q8_matmul(packed, scales, x, out, rows, n, k, x_bf16, bf16_out, threads, 0, 0);
}

/* The same for a symmetric weight (m = -32 d in every group: Q6_K), whose
 * scales hold d alone (the layout above). */
int trioserve_int6s_q8_matmul(const uint8_t *packed, const uint16_t *scales, const void *x, void *out, int64_t rows,
                              int64_t n, int64_t k, int x_bf16, int bf16_out, int threads) {
    return codes_q8_matmul(packed, scales, x, out, rows, n, k, x_bf16, bf16_out, threads, 0, 1);
}

/* Signed 8-bit codes with one f16 scale per output and block of 32 (GGUF's
 * Q8_0, kernels/int8w.py): per block, in order,
 *   acc = fma(float(isum), d xd, acc)
 * with isum the exact sum of the 32 products of codes and 8-bit inputs;
 * every build gives the same bits. Layout: the 6-bit kernel's tile groups,
 * with the codes a byte each (read as int8), [g][K/32][T][8][16][4] (quad j
 * of the block, column, input), and scales [g][K/32][T][16] f16. */
int trioserve_int8_q8_matmul(const int8_t *packed, const uint16_t *scales, const void *x, void *out, int64_t rows,
                             int64_t n, int64_t k, int x_bf16, int bf16_out, int threads) {
    return codes_q8_matmul((const uint8_t *)packed, scales, x, out, rows, n, k, x_bf16, bf16_out, threads, 1, 0);
}
#else
#error "no build of the 6- and 8-bit kernels' passes (every build has one: AVX-512 VNNI, AVX2, NEON sdot or plain C)"
#endif

/* 16-bit float weights (GGUF's F16 and BF16) kept as they are in the file,
 * products in fp32 (`trioserve_w16_matmul`). Layout (kernels/w16.py
 * `pack_w16`): tiles of 16 outputs, each [K][16] (input-major), so that one
 * vector holds one input's weights for 16 outputs. Each output's sum runs
 * over the inputs in order, acc = fma(x[k], w[k], acc) from 0: one chain per
 * output, so the vector width (16 lanes, 8, 4 or 1), which rows share a pass
 * and which thread runs a tile change no bit, and every build (AVX-512, AVX2
 * with F16C, NEON, plain C) gives the same result. K may be any size; N a
 * multiple of 16. */
#define W16_ROWS 6
#define W16_TILES 4

static inline float f16_bits_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        uint32_t m = man;
        do {
            e++;
            m <<= 1;
        } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float w16_value(uint16_t h, const int bf16w) { return bf16w ? bf16_to_float(h) : f16_bits_to_float(h); }

#if defined(__AVX512F__)
static inline __m512 w16_lanes16(const uint16_t *p, const int bf16w) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return bf16w ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}
static inline __attribute__((always_inline)) void w16_pass(const uint16_t *w, const float *x, float *out, int64_t k,
                                                          int64_t n, const int rows, const int tiles, const int bf16w) {
    __m512 acc[W16_ROWS][W16_TILES];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < tiles; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m512 v[W16_TILES];
        for (int t = 0; t < tiles; t++) v[t] = w16_lanes16(w + (t * k + i) * 16, bf16w);
        for (int r = 0; r < rows; r++) {
            const __m512 xi = _mm512_set1_ps(x[r * k + i]);
            for (int t = 0; t < tiles; t++) acc[r][t] = _mm512_fmadd_ps(xi, v[t], acc[r][t]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < tiles; t++) _mm512_storeu_ps(out + r * n + t * 16, acc[r][t]);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static inline __m256 w16_lanes8(const uint16_t *p, const int bf16w) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16w ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}
static inline __attribute__((always_inline)) void w16_pass(const uint16_t *w, const float *x, float *out, int64_t k,
                                                          int64_t n, const int rows, const int tiles, const int bf16w) {
    for (int t = 0; t < tiles; t++) {
        __m256 acc[W16_ROWS][2];
        for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i++) {
            const __m256 lo = w16_lanes8(w + (t * k + i) * 16, bf16w), hi = w16_lanes8(w + (t * k + i) * 16 + 8, bf16w);
            for (int r = 0; r < rows; r++) {
                const __m256 xi = _mm256_set1_ps(x[r * k + i]);
                acc[r][0] = _mm256_fmadd_ps(xi, lo, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(xi, hi, acc[r][1]);
            }
        }
        for (int r = 0; r < rows; r++) {
            _mm256_storeu_ps(out + r * n + t * 16, acc[r][0]);
            _mm256_storeu_ps(out + r * n + t * 16 + 8, acc[r][1]);
        }
    }
}
#elif defined(__ARM_NEON)
static inline float32x4_t w16_lanes4(const uint16_t *p, const int bf16w) {
    const uint16x4_t h = vld1_u16(p);
    return bf16w ? vreinterpretq_f32_u32(vshll_n_u16(h, 16)) : vcvt_f32_f16(vreinterpret_f16_u16(h));
}
static inline __attribute__((always_inline)) void w16_pass(const uint16_t *w, const float *x, float *out, int64_t k,
                                                          int64_t n, const int rows, const int tiles, const int bf16w) {
    for (int t = 0; t < tiles; t++) {
        float32x4_t acc[W16_ROWS][4];
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < 4; q++) acc[r][q] = vdupq_n_f32(0.0f);
        for (int64_t i = 0; i < k; i++) {
            float32x4_t v[4];
            for (int q = 0; q < 4; q++) v[q] = w16_lanes4(w + (t * k + i) * 16 + 4 * q, bf16w);
            for (int r = 0; r < rows; r++) {
                const float32x4_t xi = vdupq_n_f32(x[r * k + i]);
                for (int q = 0; q < 4; q++) acc[r][q] = vfmaq_f32(acc[r][q], xi, v[q]);
            }
        }
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < 4; q++) vst1q_f32(out + r * n + t * 16 + 4 * q, acc[r][q]);
    }
}
#else
static inline __attribute__((always_inline)) void w16_pass(const uint16_t *w, const float *x, float *out, int64_t k,
                                                          int64_t n, const int rows, const int tiles, const int bf16w) {
    for (int t = 0; t < tiles; t++)
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < 16; j++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < k; i++) acc = fmaf(x[r * k + i], w16_value(w[(t * k + i) * 16 + j], bf16w), acc);
                out[r * n + t * 16 + j] = acc;
            }
}
#endif

/* Rows, tiles and the weight's kind as constants in each call, so that the
 * accumulators stay in registers. */
#define W16_CALL(R, T)                                                                    \
    if (bf16w) w16_pass(w, xr, o, k, n, R, T, 1);                                         \
    else w16_pass(w, xr, o, k, n, R, T, 0);
#define W16_CASE(R)                                                                       \
    case R:                                                                               \
        if (tiles_here == 4) {                                                            \
            W16_CALL(R, 4)                                                                \
        } else if (tiles_here == 3) {                                                     \
            W16_CALL(R, 3)                                                                \
        } else if (tiles_here == 2) {                                                     \
            W16_CALL(R, 2)                                                                \
        } else {                                                                          \
            W16_CALL(R, 1)                                                                \
        }                                                                                 \
        break;

/* out [R, N] (fp32, or bf16 when out_bf16) = x [R, K] (fp32, or bf16 when
 * x_bf16) times the 16-bit weight (F16, or BF16 when w_bf16) transposed.
 * The packed weight holds N rounded up to a multiple of 16 outputs (the
 * last tile's padding rows zero); only N are written. Returns 1 when k < 1,
 * 2 when scratch memory cannot be had, else 0. */
int trioserve_w16_matmul(const uint16_t *packed, const void *x, void *out, int64_t rows, int64_t n, int64_t k, int w_bf16,
                         int x_bf16, int out_bf16, int threads) {
    if (n < 1 || k < 1) return 1;
    const int64_t tiles = (n + 15) / 16, width = tiles * 16, groups = (tiles + W16_TILES - 1) / W16_TILES;
    const int direct = !out_bf16 && width == n;
    float *xf = malloc((size_t)(rows * k) * sizeof(float) + 1);
    float *of = direct ? (float *)out : malloc((size_t)(rows * width) * sizeof(float) + 1);
    if (!xf || !of) {
        free(xf);
        if (!direct) free(of);
        return 2;
    }
    for (int64_t i = 0; i < rows * k; i++) xf[i] = load(x, i, x_bf16);
    const int bf16w = w_bf16 != 0;
    const int nt = threads > 0 ? (threads < MAX_THREADS ? threads : MAX_THREADS) : 1;
    (void)nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t t0 = g * W16_TILES;
        const int tiles_here = tiles - t0 < W16_TILES ? (int)(tiles - t0) : W16_TILES;
        const uint16_t *w = packed + t0 * k * 16;
        for (int64_t r0 = 0; r0 < rows; r0 += W16_ROWS) {
            const float *xr = xf + r0 * k;
            float *o = of + r0 * width + t0 * 16;
            const int64_t n = width; /* the passes' row stride */
            switch (rows - r0 >= W16_ROWS ? W16_ROWS : (int)(rows - r0)) {
                W16_CASE(6)
                W16_CASE(5)
                W16_CASE(4)
                W16_CASE(3)
                W16_CASE(2)
                W16_CASE(1)
            }
        }
    }
    if (!direct) {
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < n; j++) {
                if (out_bf16) ((uint16_t *)out)[r * n + j] = float_to_bf16(of[r * width + j]);
                else ((float *)out)[r * n + j] = of[r * width + j];
            }
        free(of);
    }
    free(xf);
    return 0;
}

/* ---- A step's decoder layers in one call (kernels/layer_runner.py `LayerRunner`) ----
 *
 * models/decoder.py `_residual` calls the kernels above one at a time, about
 * nine a layer; each call costs a few microseconds of Python and ctypes,
 * ~1.6 ms a step for a 30-layer model (a sixth of a one-sequence decode step
 * on two cores). This runs the same kernels, in the same order, on buffers
 * of the same dtypes, so every bit is the same (tests/kernels/
 * test_layer_runner.py, test_layer_runner_families.py): the loop over
 * layers has only moved into C. Each layer says what it has beyond a Llama
 * layer (`TsLayer`): q/k norm (Qwen3), its RoPE tables, a sliding window,
 * sandwich norms and GeGLU (Gemma 3).
 *
 * Activations between kernels are the weights' dtype (bf16, else fp32), the
 * residual stream h [rows, hidden] fp32, updated in place: after the call it
 * holds the stream after the last layer. Projections whose parts the file
 * stores in different types (a Q4_K_M file's q and k in Q4_K, v in Q6_K) run
 * part by part into a scratch row, copied side by side. Pad rows (after
 * `real`) go through every projection, are rotated but never stored, and
 * their attention is zero, as in the Python forward.
 *
 * Returns 0; else the failing kernel's code plus 16 x which kernel failed
 * (1 a projection, 2 rope and the K/V write, 3 attention), or 64 when
 * scratch memory cannot be had. */

enum { TS_INT4_Q8 = 1, TS_INT6_Q8 = 2, TS_INT6S_Q8 = 3, TS_INT8_Q8 = 4, TS_W16 = 5 };
#define TS_MAX_PARTS 4

typedef struct {
    int32_t kind;    /* TS_* */
    int32_t w_bf16;  /* TS_W16: the weight is BF16, else F16 */
    int64_t n, k;
    const void *packed;
    const void *scales;
} TsMat;

typedef struct {
    TsMat part[TS_MAX_PARTS];
    int64_t parts;
    int64_t n; /* the parts' outputs, side by side */
} TsProj;

typedef struct {
    const float *attn_norm, *mlp_norm;
    TsProj qkv, o, gate_up, down;
    const float *q_norm, *k_norm; /* [dim] each, applied to every query and key head before RoPE; NULL: none (a Llama layer) */
    const float *cos, *sin;       /* this layer's RoPE tables [max_position, dim / 2] (Gemma 3's local layers have their own) */
    int64_t window;               /* a sliding-window layer's keys (`trioserve_window_attention`); 0: the whole history */
    /* Sandwich norms (Gemma 3): [hidden] each, RMS-normed in fp32 onto the attention's and the MLP's output before
     * each is added to the stream (mlp_norm is then the pre-feedforward norm); NULL: none. */
    const float *post_attn_norm, *post_mlp_norm;
    int32_t activation; /* TS_SILU or TS_GELU_TANH (GeGLU) */
} TsLayer;

enum { TS_SILU = 0, TS_GELU_TANH = 1 };

typedef struct {
    const TsLayer *layers;
    int64_t num_layers, hidden, heads, kv_heads, dim, max_position; /* max_position: the RoPE tables' rows */
    float eps, scale;
    int32_t bf16;    /* the weights' dtype */
    int32_t kv_bf16; /* the pool's */
} TsModel;

typedef struct {
    int64_t first, count, num_tables, max_blocks;
    const int64_t *tables, *lens, *row_seq; /* row_seq NULL: decode rows, a table row each */
} TsGroup;

typedef struct {
    void *k_pool, *v_pool; /* [layers, KVH, NB, BS, D] */
    int64_t num_blocks, block_size;
    const int64_t *positions, *slots;
    int64_t rows, real;
    const TsGroup *groups;
    int64_t num_groups;
    int32_t threads;
} TsStep;

static int ts_mat(const TsMat *w, const void *x, void *out, int64_t rows, int bf16, int threads) {
    switch (w->kind) {
    case TS_INT4_Q8:
        return trioserve_int4_q8_matmul(w->packed, w->scales, x, out, rows, w->n, w->k, bf16, bf16, threads);
    case TS_INT6_Q8:
        return trioserve_int6_q8_matmul(w->packed, w->scales, x, out, rows, w->n, w->k, bf16, bf16, threads);
    case TS_INT6S_Q8:
        return trioserve_int6s_q8_matmul(w->packed, w->scales, x, out, rows, w->n, w->k, bf16, bf16, threads);
    case TS_INT8_Q8:
        return trioserve_int8_q8_matmul(w->packed, w->scales, x, out, rows, w->n, w->k, bf16, bf16, threads);
    case TS_W16:
        return trioserve_w16_matmul(w->packed, x, out, rows, w->n, w->k, w->w_bf16, bf16, bf16, threads);
    default:
        return 1;
    }
}

/* out [rows, p->n] = x times the projection; `part` holds one part's rows. */
static int ts_proj(const TsProj *p, const void *x, void *out, void *part, int64_t rows, int bf16, int threads) {
    if (p->parts == 1) return ts_mat(&p->part[0], x, out, rows, bf16, threads);
    const size_t es = bf16 ? 2 : 4;
    int64_t col = 0;
    for (int64_t i = 0; i < p->parts; i++) {
        const TsMat *w = &p->part[i];
        const int code = ts_mat(w, x, part, rows, bf16, threads);
        if (code) return code;
        for (int64_t r = 0; r < rows; r++)
            memcpy((char *)out + (size_t)(r * p->n + col) * es, (const char *)part + (size_t)(r * w->n) * es, (size_t)w->n * es);
        col += w->n;
    }
    return 0;
}

static int64_t ts_widest(const TsProj *p, int64_t most) {
    for (int64_t i = 0; i < p->parts; i++) most = p->part[i].n > most ? p->part[i].n : most;
    return p->n > most ? p->n : most;
}

/* A sandwich norm: a projection's output rows `y` [rows, hidden] (the
 * weights' dtype) widened to fp32 into `out` and RMS-normed there in place
 * (`rms_norm_row` reads a row whole before it writes it), as the Python
 * forward's `rms_norm(o.float(), w, eps, float32)`. Returns out. */
static float *ts_post_norm(const void *y, const float *weight, float *out, int64_t rows, int64_t hidden, float eps, int bf16) {
    if (bf16)
        for (int64_t j = 0; j < rows * hidden; j++) out[j] = bf16_to_float(((const uint16_t *)y)[j]);
    else
        memcpy(out, y, (size_t)(rows * hidden) * sizeof(float));
    trioserve_rms_norm(out, weight, out, rows, hidden, eps, 0);
    return out;
}

/* q/k norm (Qwen3, Gemma 3): each query head of packed qkv rows [rows,
 * (H + 2 KVH) dim] RMS-normed with q_norm and each key head with k_norm, in
 * place: the head widened to fp32, normed as `trioserve_rms_norm` computes
 * a row of dim (`rms_norm_row`), stored back in qkv's dtype (rounded as
 * torch casts). The Python forward (models/decoder.py `_qk_norm`) runs that
 * kernel on the widened heads and casts: the same bits. dim <= 256. */
static void ts_qk_norm(void *qkv, const float *q_norm, const float *k_norm, int64_t rows, int64_t heads, int64_t kv_heads,
                       int64_t dim, float eps, int bf16) {
    const int64_t width = (heads + 2 * kv_heads) * dim;
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float head[LANES * 16];
        for (int64_t n = 0; n < heads + kv_heads; n++) {
            const int64_t at = r * width + n * dim;
            const float *w = n < heads ? q_norm : k_norm;
            for (int64_t i = 0; i < dim; i++) head[i] = load(qkv, at + i, bf16);
            if (bf16) rms_norm_row(head, w, (uint16_t *)qkv + at, 0, dim, eps, 1);
            else rms_norm_row(head, w, (float *)qkv + at, 0, dim, eps, 0);
        }
    }
}

int trioserve_run_layers(const TsModel *m, const TsStep *s, float *h) {
    const int64_t rows = s->rows, hidden = m->hidden, nq = m->heads * m->dim;
    const int bf16 = m->bf16 != 0;
    const size_t es = bf16 ? 2 : 4, kes = m->kv_bf16 ? 2 : 4;
    if (m->num_layers < 1 || rows < 1) return 0;
    if (m->dim > LANES * 16) return 1 + 48; /* attention's own limit (`trioserve_window_attention`) */
    /* Scratch, sized for the widest layer: the norms' output (also the
     * attention rows cast to bf16), qkv, q, the attention rows in fp32,
     * gate+up, SiLU's output, a projection's output, and one stacked part. */
    int64_t w_qkv = 0, w_gu = 0, w_ffn = 0, w_part = 0;
    for (int64_t i = 0; i < m->num_layers; i++) {
        const TsLayer *l = &m->layers[i];
        w_qkv = l->qkv.n > w_qkv ? l->qkv.n : w_qkv;
        w_gu = l->gate_up.n > w_gu ? l->gate_up.n : w_gu;
        w_ffn = l->down.part[0].k > w_ffn ? l->down.part[0].k : w_ffn;
        const TsProj *ps[4] = {&l->qkv, &l->o, &l->gate_up, &l->down};
        for (int j = 0; j < 4; j++)
            if (ps[j]->parts > 1) w_part = ts_widest(ps[j], w_part);
    }
    const int64_t w_x = hidden > nq ? hidden : nq;
    const size_t cells = (size_t)rows * (size_t)(w_x + w_qkv + nq + w_gu + w_ffn + hidden + w_part);
    char *arena = (char *)malloc(cells * es + (size_t)(rows * (nq + hidden)) * sizeof(float) + 64);
    if (arena == NULL) return 64;
    void *x = arena;
    void *qkv = (char *)x + (size_t)(rows * w_x) * es;
    void *q = (char *)qkv + (size_t)(rows * w_qkv) * es;
    void *gu = (char *)q + (size_t)(rows * nq) * es;
    void *act = (char *)gu + (size_t)(rows * w_gu) * es;
    void *delta = (char *)act + (size_t)(rows * w_ffn) * es;
    void *part = (char *)delta + (size_t)(rows * hidden) * es;
    float *att = (float *)(void *)((char *)part + (size_t)(rows * w_part) * es);
    float *normed = att + rows * nq; /* a sandwich norm's fp32 output */
    const int64_t layer_cells = m->kv_heads * s->num_blocks * s->block_size * m->dim;
    const int64_t num_slots = s->num_blocks * s->block_size;
    int code = 0;
    trioserve_rms_norm(h, m->layers[0].attn_norm, x, rows, hidden, m->eps, bf16);
    for (int64_t i = 0; i < m->num_layers && !code; i++) {
        const TsLayer *l = &m->layers[i];
        if ((code = ts_proj(&l->qkv, x, qkv, part, rows, bf16, s->threads))) {
            code += 16;
            break;
        }
        if (l->q_norm) ts_qk_norm(qkv, l->q_norm, l->k_norm, rows, m->heads, m->kv_heads, m->dim, m->eps, bf16);
        void *kc = (char *)s->k_pool + (size_t)(i * layer_cells) * kes;
        void *vc = (char *)s->v_pool + (size_t)(i * layer_cells) * kes;
        code = trioserve_rope_write_kv(qkv, s->positions, l->cos, l->sin, q, kc, vc, s->slots, rows, s->real, m->heads,
                                       m->kv_heads, m->dim, m->max_position, num_slots, bf16, m->kv_bf16);
        if (code) {
            code += 32;
            break;
        }
        int64_t end = 0;
        for (int64_t g = 0; g < s->num_groups; g++) {
            const TsGroup *gr = &s->groups[g];
            code = trioserve_window_attention((const char *)q + (size_t)(gr->first * nq) * es, kc, vc, gr->tables, gr->row_seq,
                                              gr->lens, att + gr->first * nq, gr->count, gr->num_tables, m->heads, m->kv_heads,
                                              s->num_blocks, s->block_size, m->dim, gr->max_blocks, l->window, m->scale, bf16,
                                              m->kv_bf16, s->threads);
            if (code) break;
            end = gr->first + gr->count;
        }
        if (code) {
            code += 48;
            break;
        }
        if (end < rows) memset(att + end * nq, 0, (size_t)((rows - end) * nq) * sizeof(float));
        const void *att_in = att;
        if (bf16) { /* the attention rows in the weights' dtype, as the Python forward casts them */
            uint16_t *xb = (uint16_t *)x;
            for (int64_t j = 0; j < rows * nq; j++) xb[j] = float_to_bf16(att[j]);
            att_in = x;
        }
        if ((code = ts_proj(&l->o, att_in, delta, part, rows, bf16, s->threads))) {
            code += 16;
            break;
        }
        /* The stream's update: the projection's rows, or (sandwich norms) their fp32 norm. */
        const void *update = delta;
        int update_bf16 = bf16;
        if (l->post_attn_norm) update = ts_post_norm(delta, l->post_attn_norm, normed, rows, hidden, m->eps, bf16), update_bf16 = 0;
        trioserve_add_rms_norm(h, update, l->mlp_norm, x, rows, hidden, m->eps, update_bf16, bf16);
        if ((code = ts_proj(&l->gate_up, x, gu, part, rows, bf16, s->threads))) {
            code += 16;
            break;
        }
        if (l->activation == TS_GELU_TANH) trioserve_gelu_tanh_mul(gu, act, rows, l->gate_up.n / 2, bf16);
        else trioserve_silu_mul(gu, act, rows, l->gate_up.n / 2, bf16);
        if ((code = ts_proj(&l->down, act, delta, part, rows, bf16, s->threads))) {
            code += 16;
            break;
        }
        update = delta, update_bf16 = bf16;
        if (l->post_mlp_norm) update = ts_post_norm(delta, l->post_mlp_norm, normed, rows, hidden, m->eps, bf16), update_bf16 = 0;
        if (i + 1 < m->num_layers) {
            trioserve_add_rms_norm(h, update, m->layers[i + 1].attn_norm, x, rows, hidden, m->eps, update_bf16, bf16);
        } else {
            for (int64_t j = 0; j < rows * hidden; j++) h[j] += load(update, j, update_bf16);
        }
    }
    free(arena);
    return code;
}

/* ---- Load-time layouts (plain C on every build) ----------------------------
   The weight layouts of trioserve_int4_q8_matmul and trioserve_int6_q8_matmul
   (drawn above each) made from codes one a byte, u [n, k] (n a multiple of 16,
   k of 32): tiles of 16 outputs in groups of `group` tiles (the last group
   may hold fewer), each group block by block across its tiles. The same
   bytes as the numpy packers in kernels/native_pack.py (pack_int4_q8) and
   kernels/int6.py (pack_int6_q8), which run where this library does not;
   tests/kernels/test_pack_layout.py holds the two together. Groups are
   independent, so they are shared among `threads`. */

/* Writes one tile's block: u at the tile's first output and the block's
   first input (rows k apart), dst its bytes. */
typedef void (*tile_block_writer)(const uint8_t *u, int64_t k, uint8_t *dst);

static void pack_tiles(const uint8_t *u, int64_t n, int64_t k, int64_t group, int64_t bytes, tile_block_writer write, uint8_t *out, int threads) {
    const int64_t tiles = n / 16, nb = k / 32, groups = (tiles + group - 1) / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t left = tiles - g * group, count = left < group ? left : group;
        uint8_t *dst = out + g * group * nb * bytes;
        for (int64_t b = 0; b < nb; b++)
            for (int64_t t = 0; t < count; t++, dst += bytes) write(u + (g * group + t) * 16 * k + b * 32, k, dst);
    }
}

/* 4-bit: a tile's block is 4 quads x 16 outputs x 4 bytes; byte e of quad j
   of output c holds the block's input 4 j + e (low nibble) and 16 + 4 j + e
   (high nibble). */
static void int4_tile_block(const uint8_t *u, int64_t k, uint8_t *dst) {
    for (int j = 0; j < 4; j++)
        for (int c = 0; c < 16; c++) {
            const uint8_t *src = u + c * k + 4 * j;
            for (int e = 0; e < 4; e++) *dst++ = (uint8_t)(src[e] | (src[16 + e] << 4));
        }
}

/* 6-bit: a tile's block is 2 halves (inputs 0-15, 16-31) x 3 planes x 16
   outputs x 4 bytes. For half h, byte e of output c, with a..d the codes of
   quads 0..3 (input 16 h + 4 j + e): plane 0 holds a's and b's low nibbles,
   plane 1 c's and d's, plane 2 the four top 2-bit parts (a lowest). */
static void int6_tile_block(const uint8_t *u, int64_t k, uint8_t *dst) {
    for (int h = 0; h < 2; h++, dst += 192)
        for (int c = 0; c < 16; c++) {
            const uint8_t *src = u + c * k + 16 * h;
            for (int e = 0; e < 4; e++) {
                const uint8_t a = src[e], b = src[4 + e], cq = src[8 + e], d = src[12 + e];
                dst[c * 4 + e] = (uint8_t)((a & 15) | ((b & 15) << 4));
                dst[64 + c * 4 + e] = (uint8_t)((cq & 15) | ((d & 15) << 4));
                dst[128 + c * 4 + e] = (uint8_t)((a >> 4) | ((b >> 4) << 2) | ((cq >> 4) << 4) | ((d >> 4) << 6));
            }
        }
}

void trioserve_pack_int4_q8_codes(const uint8_t *u, int64_t n, int64_t k, int64_t group, uint8_t *out, int threads) {
    pack_tiles(u, n, k, group, 256, int4_tile_block, out, threads);
}

void trioserve_pack_int6_q8_codes(const uint8_t *u, int64_t n, int64_t k, int64_t group, uint8_t *out, int threads) {
    pack_tiles(u, n, k, group, 384, int6_tile_block, out, threads);
}

/* 4-bit codes out of GGUF blocks, one a byte: each of `blocks` blocks of
   `block_bytes` bytes skips `header` bytes of scales, and every run of
   `run` bytes after it holds `run` codes in its low nibbles, then `run`
   more in its high ones (Q4_0/Q4_1: runs of 16; Q4_K: of 32). out: the
   codes in the file's order, 2 (block_bytes - header) a block. */
void trioserve_unpack_nibbles(const uint8_t *raw, int64_t blocks, int64_t block_bytes, int64_t header, int64_t run, uint8_t *out, int threads) {
    const int64_t nibble_bytes = block_bytes - header;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *src = raw + b * block_bytes + header;
        uint8_t *dst = out + b * nibble_bytes * 2;
        for (int64_t r = 0; r < nibble_bytes; r += run) {
            for (int64_t i = 0; i < run; i++) dst[2 * r + i] = src[r + i] & 15;
            for (int64_t i = 0; i < run; i++) dst[2 * r + run + i] = src[r + i] >> 4;
        }
    }
}

/* Codes of up to 6 bits out of GGUF blocks, one a byte, in the file's
   order: `kind` 0 Q6_K (210-byte blocks of 256: 128 bytes of low nibbles,
   64 of 2-bit high parts), 1 Q5_K (176 of 256: 16 bytes of scales, 32 of
   fifth bits, 128 of nibbles), 2 Q5_0 and 3 Q5_1 (22 and 24 of 32: f16
   fields, a 32-bit word of fifth bits, 16 bytes of nibbles). The layouts
   are kernels/int6.py's (_q6_k_codes, _q5_k_codes, _q5_codes), which serve
   where this library does not. */
void trioserve_unpack_codes6(const uint8_t *raw, int64_t blocks, int kind, uint8_t *out, int threads) {
    static const int64_t bytes[4] = {210, 176, 22, 24}, weights[4] = {256, 256, 32, 32};
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *src = raw + b * bytes[kind];
        uint8_t *o = out + b * weights[kind];
        if (kind == 0) {
            for (int half = 0; half < 2; half++, o += 128) {
                const uint8_t *l = src + 64 * half, *h = src + 128 + 32 * half;
                for (int i = 0; i < 32; i++) {
                    o[i] = (uint8_t)((l[i] & 15) | ((h[i] & 3) << 4));
                    o[32 + i] = (uint8_t)((l[32 + i] & 15) | (((h[i] >> 2) & 3) << 4));
                    o[64 + i] = (uint8_t)((l[i] >> 4) | (((h[i] >> 4) & 3) << 4));
                    o[96 + i] = (uint8_t)((l[32 + i] >> 4) | (((h[i] >> 6) & 3) << 4));
                }
            }
        } else if (kind == 1) {
            const uint8_t *h = src + 16, *q = src + 48;
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 32; i++) {
                    o[64 * j + i] = (uint8_t)((q[32 * j + i] & 15) | (((h[i] >> (2 * j)) & 1) << 4));
                    o[64 * j + 32 + i] = (uint8_t)((q[32 * j + i] >> 4) | (((h[i] >> (2 * j + 1)) & 1) << 4));
                }
        } else {
            const uint8_t *w = src + (kind == 2 ? 2 : 4), *q = w + 4;
            const uint32_t fifth = (uint32_t)w[0] | ((uint32_t)w[1] << 8) | ((uint32_t)w[2] << 16) | ((uint32_t)w[3] << 24);
            for (int j = 0; j < 16; j++) {
                o[j] = (uint8_t)((q[j] & 15) | (((fifth >> j) & 1) << 4));
                o[16 + j] = (uint8_t)((q[j] >> 4) | (((fifth >> (j + 16)) & 1) << 4));
            }
        }
    }
}

/* A float rounded to the nearest f16 (ties to even; overflow to infinity,
   NaN kept NaN with its top payload bits), as numpy's astype(float16)
   rounds: the bits. */
static uint16_t float_to_f16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {
        uint32_t payload = (ax & 0x7fffffu) >> 13;
        if (ax > 0x7f800000u && !payload) payload = 1;
        return (uint16_t)(sign | 0x7c00 | payload);
    }
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* 65520 and up: infinity */
    if (ax < 0x38800000u) { /* below 2^-14: a subnormal f16 or zero */
        if (ax <= 0x33000000u) return (uint16_t)sign; /* at most 2^-25: 0 (the tie goes to even) */
        const uint32_t m = (ax & 0x7fffffu) | 0x800000u, shift = 126 - (ax >> 23);
        uint32_t h = m >> shift;
        const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = (ax - 0x38000000u) >> 13;
    const uint32_t rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

/* Q4_K's group scales as kernels/int4.py (_parts_from_q4_k) makes them:
   each of a super-block's 8 groups takes scale f16(d s) and offset
   f16(-dmin m) (d, dmin the block's f16 fields; s, m its 6-bit scale and
   min, packed in 12 bytes), and zero = offset + 8 scale. `supers` blocks
   of 144 bytes; scale and zero [supers * 8]. The products are exact in
   float (11 by 6 bits), so rounding them once to f16 is numpy's rounding
   of its float64 product. */
void trioserve_q4_k_scales(const uint8_t *raw, int64_t supers, float *scale, float *zero, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *b = raw + s * 144, *q = b + 4;
        const float d = f16_bits_to_float((uint16_t)(b[0] | (b[1] << 8)));
        const float dmin = f16_bits_to_float((uint16_t)(b[2] | (b[3] << 8)));
        for (int j = 0; j < 8; j++) {
            const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
            const int mn = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
            const float gd = f16_bits_to_float(float_to_f16_bits(d * (float)sc));
            const float gm = f16_bits_to_float(float_to_f16_bits(-dmin * (float)mn));
            scale[s * 8 + j] = gd;
            zero[s * 8 + j] = gm + 8.0f * gd;
        }
    }
}

/* A 4-bit weight laid out for the int8-activation kernel straight from
   its GGUF blocks, without the codes one a byte, the grouped copy or the
   fused projection's concatenation in between (for an 8B model those took
   most of the build). rows[i]: output row i's blocks in the mapped file
   (any row of any tensor: the fused projection's parts and the Q/K row
   order are in the pointers). kind 0 Q4_0 (18-byte blocks: f16 d, 16
   nibble bytes), 1 Q4_1 (20: f16 d, f16 m, 16), 2 Q4_K (144-byte
   super-blocks of 256). codes: `trioserve_pack_int4_q8_codes`'s bytes;
   scales [group][K/32][tiles][d, m][16] f16, as kernels/native_pack.py
   `pack_int4_q8` writes them, with the same float steps (Int4Parts' scale
   and zero, then m = zero - 8 d, both rounded to f16), so the same bits.
   A Q4_0/Q4_1 tile byte is the file's nibble byte as it is: input 4 j + e
   in its low nibble, 16 + 4 j + e in its high one. */
/* One block's d and m as `pack_int4_q8` rounds them to f16 (from
   Int4Parts' scale and zero: m = zero - 8 d), and its 16 nibble bytes
   with input i (0-15) in the low nibble and 16 + i in the high one. For
   Q4_K, d and m of the super-block's group j, and `shift` says which
   nibbles of its 32 bytes are the group's. */
#if defined(__F16C__)
#include <immintrin.h>
#endif
/* `float_to_f16_bits` of a finite float: F16C's conversion where the
   CPU has it (round to nearest even, as IEEE and numpy round). Infinities
   and quiet NaN come out as numpy's too; a signalling NaN is quieted,
   which the loader never meets (it refuses NaN scales, `_check_finite`). */
static inline uint16_t f16_of_finite(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    return float_to_f16_bits(f);
#endif
}

/* f16 bits to float (exact), F16C's where the CPU has it. */
static inline float f16_value(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return f16_bits_to_float(h);
#endif
}

static inline void q4_write(uint8_t *dst, uint16_t *sc, int c, float d, float zero, const uint8_t *nib, int shift, int k_quant) {
    sc[c] = f16_of_finite(d);
    sc[16 + c] = f16_of_finite(zero - 8.0f * d);
    uint8_t b[16];
    if (k_quant)
        for (int i = 0; i < 16; i++) b[i] = (uint8_t)(((nib[i] >> shift) & 15) | (((nib[16 + i] >> shift) & 15) << 4));
    else
        memcpy(b, nib, 16);
    for (int j = 0; j < 4; j++) memcpy(dst + j * 64 + c * 4, b + 4 * j, 4);
}

/* The row packers' one driver: output row (g group + t) 16 + c, for every
   group g of tiles (the groups shared among `threads`), tile t of it and
   column c, goes to `pack` with where its tile's blocks lie: block b at
   at0 + b count (in tile-blocks), as `pack_tiles` lays them. */
typedef void (*row_packer)(const uint8_t *row, int64_t nb, int64_t at0, int64_t count, int c, int kind, int symmetric,
                           uint8_t *codes, uint16_t *scales);

static void pack_rows(const uint8_t *const *rows, int64_t n, int64_t k, int kind, int symmetric, int64_t group, row_packer pack,
                      uint8_t *codes, uint16_t *scales, int threads) {
    const int64_t tiles = n / 16, nb = k / 32, groups = (tiles + group - 1) / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t left = tiles - g * group, count = left < group ? left : group;
        for (int64_t t = 0; t < count; t++)
            for (int c = 0; c < 16; c++) pack(rows[(g * group + t) * 16 + c], nb, g * group * nb + t, count, c, kind, symmetric, codes, scales);
    }
}

/* A 4-bit row's blocks into its tile-blocks: 256 code bytes and 32 scales each. */
static void int4_row(const uint8_t *row, int64_t nb, int64_t at0, int64_t count, int c, int kind, int symmetric, uint8_t *codes,
                     uint16_t *scales) {
    (void)symmetric;
    if (kind == 2) {
        for (int64_t s = 0; s < nb / 8; s++) {
            const uint8_t *blk = row + s * 144, *q = blk + 4;
            const float sd = f16_value((uint16_t)(blk[0] | (blk[1] << 8)));
            const float smin = f16_value((uint16_t)(blk[2] | (blk[3] << 8)));
            for (int j = 0; j < 8; j++) {
                const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
                const int mn = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
                const float d = f16_value(f16_of_finite(sd * (float)sc));
                const float zero = f16_value(f16_of_finite(-smin * (float)mn)) + 8.0f * d;
                const int64_t at = at0 + (8 * s + j) * count;
                q4_write(codes + at * 256, scales + at * 32, c, d, zero, blk + 16 + 32 * (j / 2), (j % 2) * 4, 1);
            }
        }
        return;
    }
    const int64_t bytes = kind ? 20 : 18;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bytes;
        const float d = f16_value((uint16_t)(blk[0] | (blk[1] << 8)));
        const float zero = kind ? f16_value((uint16_t)(blk[2] | (blk[3] << 8))) + 8.0f * d : 0.0f;
        const int64_t at = at0 + b * count;
        q4_write(codes + at * 256, scales + at * 32, c, d, zero, blk + (kind ? 4 : 2), 0, 0);
    }
}

void trioserve_pack_int4_q8_rows(const uint8_t *const *rows, int64_t n, int64_t k, int kind, int64_t group, uint8_t *codes,
                                 uint16_t *scales, int threads) {
    pack_rows(rows, n, k, kind, 0, group, int4_row, codes, scales, threads);
}

/* The up-to-6-bit weights (Q6_K, Q5_K, Q5_0, Q5_1; `kind` as
   `trioserve_unpack_codes6`'s) laid out for `trioserve_int6_q8_matmul`
   straight from their GGUF blocks, as the 4-bit ones above: the bytes and
   f16 scales that kernels/int6.py's `parts_from_gguf6` then `pack_int6_q8`
   write, by the same float steps. i6_block: block b's (32 inputs) codes
   u[0..31], and each of its halves' exact d and m (before f16 rounding). */
static inline void i6_block(const uint8_t *row, int kind, int64_t b, uint8_t *u, float *d, float *m) {
    if (kind == 0) { /* Q6_K: 210 bytes a super-block of 256 */
        const uint8_t *s = row + (b / 8) * 210;
        const int jj = (int)(b % 8), half = jj / 4, r = jj % 4;
        const uint8_t *l = s + 64 * half + (r & 1) * 32, *h = s + 128 + 32 * half;
        for (int i = 0; i < 32; i++) u[i] = (uint8_t)(((l[i] >> (r & 2 ? 4 : 0)) & 15) | (((h[i] >> (2 * r)) & 3) << 4));
        const float sd = f16_value((uint16_t)(s[208] | (s[209] << 8)));
        for (int g = 0; g < 2; g++) {
            d[g] = sd * (float)(int8_t)s[192 + 2 * jj + g];
            m[g] = -32.0f * d[g];
        }
    } else if (kind == 1) { /* Q5_K: 176 bytes a super-block of 256 */
        const uint8_t *s = row + (b / 8) * 176, *q = s + 4, *h = s + 16, *nib = s + 48 + 32 * ((b % 8) / 2);
        const int jj = (int)(b % 8), shift = (jj % 2) * 4;
        for (int i = 0; i < 32; i++) u[i] = (uint8_t)(((nib[i] >> shift) & 15) | (((h[i] >> jj) & 1) << 4));
        const int sc = jj < 4 ? q[jj] & 63 : (q[jj + 4] & 15) | ((q[jj - 4] >> 6) << 4);
        const int mn = jj < 4 ? q[jj + 4] & 63 : (q[jj + 4] >> 4) | ((q[jj] >> 6) << 4);
        d[0] = d[1] = f16_value((uint16_t)(s[0] | (s[1] << 8))) * (float)sc;
        m[0] = m[1] = -f16_value((uint16_t)(s[2] | (s[3] << 8))) * (float)mn;
    } else { /* Q5_0 (22 bytes a block of 32) and Q5_1 (24) */
        const int header = kind == 2 ? 2 : 4;
        const uint8_t *s = row + b * (kind == 2 ? 22 : 24), *w = s + header, *q = w + 4;
        const uint32_t fifth = (uint32_t)w[0] | ((uint32_t)w[1] << 8) | ((uint32_t)w[2] << 16) | ((uint32_t)w[3] << 24);
        for (int j = 0; j < 16; j++) {
            u[j] = (uint8_t)((q[j] & 15) | (((fifth >> j) & 1) << 4));
            u[16 + j] = (uint8_t)((q[j] >> 4) | (((fifth >> (j + 16)) & 1) << 4));
        }
        d[0] = d[1] = f16_value((uint16_t)(s[0] | (s[1] << 8)));
        m[0] = m[1] = kind == 2 ? -16.0f * d[0] : f16_value((uint16_t)(s[2] | (s[3] << 8)));
    }
}

/* Whether every group's m is -32 d once both are rounded to f16 (Q6_K's
   always are): then the layout keeps d alone (`symmetric`). 1 or 0. */
int trioserve_int6_rows_symmetric(const uint8_t *const *rows, int64_t n, int64_t k, int kind, int threads) {
    int symmetric = 1;
#pragma omp parallel for num_threads(threads) reduction(&& : symmetric) schedule(static)
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < k / 32; b++) {
            uint8_t u[32];
            float d[2], m[2];
            i6_block(rows[r], kind, b, u, d, m);
            for (int g = 0; g < 2; g++) symmetric = symmetric && f16_value(f16_of_finite(m[g])) == -32.0f * f16_value(f16_of_finite(d[g]));
        }
    return symmetric;
}

/* An up-to-6-bit row's blocks into its tile-blocks: 384 code bytes and
   2 x (1 or 2) x 16 scales each (d alone where `symmetric`). */
static void int6_row(const uint8_t *row, int64_t nb, int64_t at0, int64_t count, int c, int kind, int symmetric, uint8_t *codes,
                     uint16_t *scales) {
    const int64_t which = symmetric ? 1 : 2;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t u[32];
        float d[2], m[2];
        i6_block(row, kind, b, u, d, m);
        const int64_t at = at0 + b * count;
        uint8_t *dst = codes + at * 384;
        uint16_t *sc = scales + at * 2 * which * 16;
        for (int h = 0; h < 2; h++, dst += 192) {
            const uint8_t *q = u + 16 * h;
            const int zero = d[h] == 0.0f; /* a group whose scale is 0: its codes 0 */
            sc[(h * which) * 16 + c] = f16_of_finite(d[h]);
            if (!symmetric) sc[(h * which + 1) * 16 + c] = f16_of_finite(m[h]);
            for (int e = 0; e < 4; e++) {
                const uint8_t a = zero ? 0 : q[e], bb = zero ? 0 : q[4 + e], cq = zero ? 0 : q[8 + e], dd = zero ? 0 : q[12 + e];
                dst[c * 4 + e] = (uint8_t)((a & 15) | ((bb & 15) << 4));
                dst[64 + c * 4 + e] = (uint8_t)((cq & 15) | ((dd & 15) << 4));
                dst[128 + c * 4 + e] = (uint8_t)((a >> 4) | ((bb >> 4) << 2) | ((cq >> 4) << 4) | ((dd >> 4) << 6));
            }
        }
    }
}

void trioserve_pack_int6_q8_rows(const uint8_t *const *rows, int64_t n, int64_t k, int kind, int64_t group, int symmetric,
                                 uint8_t *codes, uint16_t *scales, int threads) {
    pack_rows(rows, n, k, kind, symmetric, group, int6_row, codes, scales, threads);
}

/* A Q8_0 row (34-byte blocks: f16 d, 32 int8 codes) into
   `trioserve_int8_q8_matmul`'s tile-blocks (kernels/int8w.py
   `pack_int8_q8`): 512 code bytes (quad j of 4 inputs, column c) and 16
   f16 scales each, the file's bits as they are. */
static void int8_row(const uint8_t *row, int64_t nb, int64_t at0, int64_t count, int c, int kind, int symmetric, uint8_t *codes,
                     uint16_t *scales) {
    (void)kind, (void)symmetric;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 34;
        const int64_t at = at0 + b * count;
        scales[at * 16 + c] = (uint16_t)(blk[0] | (blk[1] << 8));
        for (int j = 0; j < 8; j++) memcpy(codes + at * 512 + j * 64 + c * 4, blk + 2 + 4 * j, 4);
    }
}

void trioserve_pack_int8_q8_rows(const uint8_t *const *rows, int64_t n, int64_t k, int64_t group, uint8_t *codes, uint16_t *scales,
                                 int threads) {
    pack_rows(rows, n, k, 0, 0, group, int8_row, codes, scales, threads);
}

/* An F16/BF16 weight's rows (the file's 2-byte values; rows[i] output row
   i's) into `trioserve_w16_matmul`'s tiles of 16 outputs, each [K][16],
   rows past n zero (kernels/w16.py `pack_w16`), a run of inputs at a time
   so that the 16 rows are read in order. */
void trioserve_pack_w16_rows(const uint16_t *const *rows, int64_t n, int64_t k, uint16_t *out, int threads) {
    const int64_t tiles = (n + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t i0 = 0; i0 < k; i0 += 64) {
            const int64_t i1 = i0 + 64 < k ? i0 + 64 : k;
            for (int c = 0; c < 16; c++) {
                const int64_t r = t * 16 + c;
                uint16_t *dst = out + t * k * 16 + c;
                if (r < n)
                    for (int64_t i = i0; i < i1; i++) dst[i * 16] = rows[r][i];
                else
                    for (int64_t i = i0; i < i1; i++) dst[i * 16] = 0;
            }
        }
}
