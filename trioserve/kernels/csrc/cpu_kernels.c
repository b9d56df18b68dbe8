/* CPU kernels for the forward pass, each a twin of a torch reference in
 * kernels/reference.py (tests/kernels/test_native.py). Built by
 * trioserve/kernels/native.py with the system C compiler.
 *
 *   trioserve_decode_attention  paged attention of decode rows (below)
 *   trioserve_rms_norm          RMSNorm of fp32 rows, cast to the weights' dtype
 *   trioserve_rope_write_kv     RoPE on q and k of packed qkv rows, k and v stored in the pool
 *   trioserve_int4_matmul       decode rows times GGUF 4-bit weights (AVX-512 BF16 CPUs; at the end)
 *   trioserve_int8_matmul       rows times an 8-bit weight with a scale per output (the output head; same CPUs)
 *
 * Every kernel computes a row from that row alone, so its result is the
 * same bits in any company (batch invariance).
 *
 * Decode attention: one query token per sequence, attending to the keys and
 * values where they lie in the block pool (no gathered copy).
 *
 * Layouts (all contiguous, row-major):
 *   q        [S, H, D]            the decode rows' queries (after RoPE)
 *   k, v     [KVH, NB, BS, D]     one layer of the block pool
 *   tables   [S, MB] int64        block ids per sequence (padded entries unread)
 *   lens     [S] int64            keys each sequence attends to (its new token included)
 *   out      [S, H, D] float32
 * Query head h reads KV head h / (H / KVH).
 *
 * Arithmetic: every (sequence, KV head) item is computed by one thread from
 * its own query, keys and values alone, in an order fixed by its own length:
 * scores (fp32 dot products, with fused multiply-adds where the CPU has
 * them: ATTENTION_MATH below; summed in 16 lanes then a fixed tree), their
 * maximum, exp by the polynomial below, the weighted sum of values key by
 * key. Nothing depends on the other sequences, how many there are, how the
 * work is split between threads, or the padding of the tables, so a row's
 * result is the same bits in any company (batch invariance). */

#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_GROUP 16
#define MAX_THREADS 64

static inline float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* exp(x) for x <= 0 (scores minus their maximum), relative error ~2e-7:
 * x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n
 * put in the exponent bits. Below -87 it returns 0. Plain arithmetic, so
 * the compiler vectorizes the loop that calls it. */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) return 0.0f;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

static inline float lane_sum(const float *acc) {
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = acc[i] + acc[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}

typedef struct {
    const void *q, *k, *v;
    const int64_t *tables, *lens;
    float *out;
    int64_t heads, kv_heads, num_blocks, block_size, dim, max_blocks;
    float scale;
    int bf16;
} Job;

static inline float load(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* One (sequence, KV head) item. Always inlined into `run_item`'s cases, so
 * for the common shapes dim and group are constants and the compiler keeps
 * the accumulators in vector registers. */
/* Each of `group` score rows of `len` (scores[j * len + t]) turned into
 * probabilities in place: minus its maximum, exp, divided by its sum (in
 * 16 lanes, the fixed tree, then the tail). Not inlined, and built without
 * contraction, so both attention paths round it alike. */
static void softmax_rows(float *scores, int64_t len, int64_t group) {
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

/* The attention loops may fuse multiplies and adds (the library is built
 * without contraction, for the elementwise kernels' sake); the result is
 * still fixed for a given build and CPU. */
#define ATTENTION_MATH __attribute__((optimize("fp-contract=fast")))

static inline __attribute__((always_inline)) ATTENTION_MATH void item_body(const Job *job, int64_t item, float *scores, const int64_t dim,
                                                           const int64_t group, const int bf16) {
    const int64_t bs = job->block_size;
    const int64_t s = item / job->kv_heads, g = item % job->kv_heads;
    const int64_t len = job->lens[s];
    const int64_t *table = job->tables + s * job->max_blocks;
    float qf[MAX_GROUP][LANES * 16], kf[LANES * 16], acc[MAX_GROUP][LANES * 16];
    for (int64_t j = 0; j < group; j++)
        for (int64_t d = 0; d < dim; d++) qf[j][d] = load(job->q, (s * job->heads + g * group + j) * dim + d, bf16) * job->scale;
    for (int64_t t = 0; t < len; t++) {
        const int64_t at = ((g * job->num_blocks + table[t / bs]) * bs + t % bs) * dim;
        for (int64_t d = 0; d < dim; d++) kf[d] = load(job->k, at + d, bf16);
        for (int64_t j = 0; j < group; j++) {
            float lanes[LANES] = {0};
            for (int64_t d0 = 0; d0 < dim; d0 += LANES)
                for (int l = 0; l < LANES; l++) lanes[l] += qf[j][d0 + l] * kf[d0 + l];
            scores[j * len + t] = lane_sum(lanes);
        }
    }
    softmax_rows(scores, len, group);
    for (int64_t j = 0; j < group; j++)
        for (int64_t d = 0; d < dim; d++) acc[j][d] = 0.0f;
    for (int64_t t = 0; t < len; t++) {
        const int64_t at = ((g * job->num_blocks + table[t / bs]) * bs + t % bs) * dim;
        for (int64_t d = 0; d < dim; d++) kf[d] = load(job->v, at + d, bf16);
        for (int64_t j = 0; j < group; j++) {
            const float p = scores[j * len + t];
            for (int64_t d = 0; d < dim; d++) acc[j][d] += p * kf[d];
        }
    }
    for (int64_t j = 0; j < group; j++)
        memcpy(job->out + (s * job->heads + g * group + j) * dim, acc[j], (size_t)dim * sizeof(float));
}

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 bf16x16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* `item_body` for bf16 with a head dim of 64, in AVX-512 registers: a
 * score is 4 fused multiply-adds of 16 lanes and the lanes' fixed
 * reduction, a value row 4 fused multiply-adds into each query head's
 * accumulators. Its own fixed order, so a row's bits still depend on
 * nothing but the row. */
static inline __attribute__((always_inline)) void item_bf16_d64(const Job *job, int64_t item, float *scores, const int64_t group) {
    const int64_t bs = job->block_size;
    const int64_t s = item / job->kv_heads, g = item % job->kv_heads;
    const int64_t len = job->lens[s];
    const int64_t *table = job->tables + s * job->max_blocks;
    const uint16_t *q = (const uint16_t *)job->q, *kc = (const uint16_t *)job->k, *vc = (const uint16_t *)job->v;
    const __m512 scale = _mm512_set1_ps(job->scale);
    __m512 qv[MAX_GROUP][4], acc[MAX_GROUP][4];
    for (int64_t j = 0; j < group; j++)
        for (int c = 0; c < 4; c++) {
            qv[j][c] = _mm512_mul_ps(bf16x16(q + (s * job->heads + g * group + j) * 64 + 16 * c), scale);
            acc[j][c] = _mm512_setzero_ps();
        }
    for (int64_t t = 0; t < len; t++) {
        const uint16_t *key = kc + ((g * job->num_blocks + table[t / bs]) * bs + t % bs) * 64;
        const __m512 k0 = bf16x16(key), k1 = bf16x16(key + 16), k2 = bf16x16(key + 32), k3 = bf16x16(key + 48);
        for (int64_t j = 0; j < group; j++) {
            __m512 a = _mm512_mul_ps(qv[j][0], k0);
            a = _mm512_fmadd_ps(qv[j][1], k1, a);
            a = _mm512_fmadd_ps(qv[j][2], k2, a);
            a = _mm512_fmadd_ps(qv[j][3], k3, a);
            scores[j * len + t] = _mm512_reduce_add_ps(a);
        }
    }
    softmax_rows(scores, len, group);
    for (int64_t t = 0; t < len; t++) {
        const uint16_t *val = vc + ((g * job->num_blocks + table[t / bs]) * bs + t % bs) * 64;
        const __m512 v0 = bf16x16(val), v1 = bf16x16(val + 16), v2 = bf16x16(val + 32), v3 = bf16x16(val + 48);
        for (int64_t j = 0; j < group; j++) {
            const __m512 p = _mm512_set1_ps(scores[j * len + t]);
            acc[j][0] = _mm512_fmadd_ps(p, v0, acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(p, v1, acc[j][1]);
            acc[j][2] = _mm512_fmadd_ps(p, v2, acc[j][2]);
            acc[j][3] = _mm512_fmadd_ps(p, v3, acc[j][3]);
        }
    }
    for (int64_t j = 0; j < group; j++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(job->out + (s * job->heads + g * group + j) * 64 + 16 * c, acc[j][c]);
}
#define FAST_BF16_D64(G)                                                            \
    if (job->bf16 && dim == 64 && group == G) {                                     \
        item_bf16_d64(job, item, scores, G);                                        \
        return;                                                                     \
    }
#else
#define FAST_BF16_D64(G)
#endif

/* The same arithmetic for every shape; the cases only let the compiler
 * specialize the loops (a row's bits do not depend on which case runs,
 * since every shape takes exactly one). */
#define CASE(D, G)                                                                  \
    if (dim == D && group == G) {                                                   \
        if (job->bf16) item_body(job, item, scores, D, G, 1);                        \
        else item_body(job, item, scores, D, G, 0);                                  \
        return;                                                                     \
    }

static ATTENTION_MATH void run_item(const Job *job, int64_t item, float *scores) {
    const int64_t dim = job->dim, group = job->heads / job->kv_heads;
    FAST_BF16_D64(1) FAST_BF16_D64(2) FAST_BF16_D64(3) FAST_BF16_D64(4) FAST_BF16_D64(8)
    CASE(64, 1) CASE(64, 2) CASE(64, 3) CASE(64, 4) CASE(64, 8)
    CASE(128, 1) CASE(128, 2) CASE(128, 4) CASE(128, 8)
    if (job->bf16) item_body(job, item, scores, dim, group, 1);
    else item_body(job, item, scores, dim, group, 0);
}

/* Returns 0 on success, 1 on a shape this kernel does not take (head dim
 * not a multiple of 16 or above 256, more than 16 query heads per KV head),
 * 2 when memory could not be had, 3 when a length or block id would read
 * outside the pool. threads: at most this many, from the OpenMP runtime
 * torch itself runs on (the library links the libgomp torch has loaded,
 * so no second pool competes for the cores); small calls run on the
 * caller's thread alone. Which thread computes an item changes nothing. */
int trioserve_decode_attention(const void *q, const void *k, const void *v, const int64_t *tables, const int64_t *lens,
                               float *out, int64_t seqs, int64_t heads, int64_t kv_heads, int64_t num_blocks,
                               int64_t block_size, int64_t dim, int64_t max_blocks, float scale, int bf16, int threads) {
    if (dim % LANES || dim > LANES * 16 || kv_heads <= 0 || heads % kv_heads || heads / kv_heads > MAX_GROUP)
        return 1;
    int64_t most = 1;
    for (int64_t s = 0; s < seqs; s++) { /* nothing is read outside the pool */
        if (lens[s] < 1 || lens[s] > max_blocks * block_size) return 3;
        for (int64_t b = 0; b * block_size < lens[s]; b++)
            if (tables[s * max_blocks + b] < 0 || tables[s * max_blocks + b] >= num_blocks) return 3;
        most = lens[s] > most ? lens[s] : most;
    }
    const Job job = {q, k, v, tables, lens, out, heads, kv_heads, num_blocks, block_size, dim, max_blocks, scale, bf16};
    const int64_t items = seqs * kv_heads, group = heads / kv_heads;
    int n = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
    if (items * most * dim < ((int64_t)1 << 16)) n = 1; /* waking threads would cost more than it saves */
    if (n > items) n = (int)items;
    float *scores = (float *)malloc(sizeof(float) * (size_t)(n * most * group));
    if (scores == NULL) return 2;
#pragma omp parallel for num_threads(n) schedule(static) if (n > 1)
    for (int64_t item = 0; item < items; item++) {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        run_item(&job, item, scores + (size_t)me * most * group);
    }
    free(scores);
    return 0;
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

/* One head of one row: x1 c - x2 s and x2 c + x1 s in fp32, rounded once. */
static inline __attribute__((always_inline)) void rotate(const void *src, int64_t in, void *dst, int64_t at, const float *c,
                                                        const float *sn, int64_t half, const int bf16) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = load(src, in + i, bf16), x2 = load(src, in + half + i, bf16);
        const float a = x1 * c[i], b = x2 * sn[i], e = x2 * c[i], f = x1 * sn[i];
        store(dst, at + i, a - b, bf16);
        store(dst, at + half + i, e + f, bf16);
    }
}

static inline __attribute__((always_inline)) void rope_row(const void *qkv, const int64_t *positions, const float *cos,
                                                          const float *sin, void *q_out, void *k_cache, void *v_cache,
                                                          const int64_t *slots, int64_t t, int64_t real, int64_t heads,
                                                          int64_t kv_heads, int64_t dim, int64_t num_slots, const int bf16) {
    const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
    const float *c = cos + positions[t] * half, *sn = sin + positions[t] * half;
    for (int64_t h = 0; h < heads; h++) rotate(qkv, t * width + h * dim, q_out, (t * heads + h) * dim, c, sn, half, bf16);
    if (t >= real) return; /* a pad row: its k and v are never stored */
    for (int64_t h = 0; h < kv_heads; h++) {
        const int64_t at = (h * num_slots + slots[t]) * dim;
        rotate(qkv, t * width + (heads + h) * dim, k_cache, at, c, sn, half, bf16);
        const int64_t in = t * width + (heads + kv_heads + h) * dim;
        if (bf16) memcpy((uint16_t *)v_cache + at, (const uint16_t *)qkv + in, (size_t)dim * 2);
        else memcpy((float *)v_cache + at, (const float *)qkv + in, (size_t)dim * 4);
    }
}

/* qkv [rows, (H + 2 KVH) * D] in the model dtype: each row's q, k, v heads.
 * Rotate-half RoPE (pair i is (x[i], x[i + D/2])) with cos, sin [*, D/2]
 * fp32 at the row's position, computed as the torch twin does (with no
 * fused multiply-adds: the same bits). Writes the rotated q to
 * q_out [rows, H, D]; for the first `real` rows, the rotated k and the v to
 * the pool k_cache, v_cache [KVH, NB * BS, D] at slots[t]. Returns 3 when a
 * position or slot is out of range, else 0. */
int trioserve_rope_write_kv(const void *qkv, const int64_t *positions, const float *cos, const float *sin, void *q_out,
                            void *k_cache, void *v_cache, const int64_t *slots, int64_t rows, int64_t real, int64_t heads,
                            int64_t kv_heads, int64_t dim, int64_t max_position, int64_t num_slots, int bf16) {
    for (int64_t t = 0; t < rows; t++) {
        if (positions[t] < 0 || positions[t] >= max_position) return 3;
        if (t < real && (slots[t] < 0 || slots[t] >= num_slots)) return 3;
    }
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; t++) {
        if (bf16) rope_row(qkv, positions, cos, sin, q_out, k_cache, v_cache, slots, t, real, heads, kv_heads, dim, num_slots, 1);
        else rope_row(qkv, positions, cos, sin, q_out, k_cache, v_cache, slots, t, real, heads, kv_heads, dim, num_slots, 0);
    }
    return 0;
}

/* 4-bit projections of decode rows: y = x W^T with W held as GGUF's 4-bit
 * blocks, w = q d + m (q in 0..15; d and m per 32 inputs, stored as f16,
 * which holds GGUF's own f16 values exactly).
 *
 * Layout (kernels/native.py `pack_int4` writes it): the N outputs go in
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

/* The next panel's weights, fetched into cache a few lines per block while
 * the rows of this panel are computed from it (after the first pass this
 * panel is in L1 and the memory would idle). Changes no result. */
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
    for (int64_t i = 0; i < ahead->step && ahead->at < ahead->end; i += 64, ahead->at += 64)
        _mm_prefetch(ahead->at, _MM_HINT_T0);
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


/* A bf16 copy of n inputs (rounded as torch casts when they are fp32), or
 * NULL when memory cannot be had. */
static uint16_t *bf16_rows(const void *x, int64_t n, int x_bf16) {
    uint16_t *xh = malloc((size_t)n * sizeof *xh + 1);
    if (!xh) return NULL;
    if (x_bf16) memcpy(xh, x, (size_t)n * sizeof *xh);
    else
        for (int64_t i = 0; i < n; i++) xh[i] = float_to_bf16(((const float *)x)[i]);
    return xh;
}

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
    for (int64_t i = 0; i < rows * nb; i++) {
        float s = 0.0f;
        for (int j = 0; j < Q4_BLOCK; j++) s += bf16_to_float(xh[i * Q4_BLOCK + j]);
        xsum[i] = s;
    }
    const int nt = threads > 0 ? (threads < MAX_THREADS ? threads : MAX_THREADS) : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
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
    free(xh);
    free(xsum);
    return 0;
}

/* The output head: y = (x W^T) scale, W int8 [N, K] with one fp32 scale per
 * output (kernels/int4.py `Int8Rows`; the bf16 scale, widened).
 *
 * Layout (native.py `pack_int8` writes it): packed [N/32][K/2][2][16][2]
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
#else
int trioserve_int4_available(void) { return 0; }
int trioserve_int4_matmul(const uint8_t *packed, const uint16_t *scales, const void *x, void *out, int64_t rows, int64_t n,
                          int64_t k, int x_bf16, int bf16_out, int threads) {
    (void)packed, (void)scales, (void)x, (void)out, (void)rows, (void)n, (void)k, (void)x_bf16, (void)bf16_out, (void)threads;
    return 4;
}
int trioserve_int8_matmul(const int8_t *packed, const float *scale, const void *x, float *out, int64_t rows, int64_t n,
                          int64_t k, int x_bf16, int threads) {
    (void)packed, (void)scale, (void)x, (void)out, (void)rows, (void)n, (void)k, (void)x_bf16, (void)threads;
    return 4;
}
#endif
