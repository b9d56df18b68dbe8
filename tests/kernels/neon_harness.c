/* Drives the C kernels built for 64-bit ARM, under qemu-user in the tests
 * (tests/kernels/test_neon.py). Normally linked against the shared library
 * built with kernels/native_build.py's own flags; with -DHARNESS_STATIC it
 * includes cpu_kernels.c instead (the fallback where no cross libgomp
 * exists), and the compiler then checks the declarations below against
 * the definitions.
 *
 * argv[1] is a job file of cases, one after another, each (all int64,
 * little-endian): op, the count of ints then the ints, the count of
 * floats then the floats (as float64), the count of inputs then each as
 * its byte length and bytes, the count of outputs then each one's byte
 * length. `run` below says what each op reads. For every case, argv[2]
 * receives: the return code (int64), the count of buffers, then every
 * input as the call left it (kernels that write in place: the pool, the
 * residual rows), then every output, each as its byte length and bytes.
 * stdout: the kernels' instruction-set word. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *trioserve_isa(void);
int trioserve_int4_q8_matmul(const uint8_t *packed, const uint16_t *scales, const void *x, void *out, int64_t rows, int64_t n,
                             int64_t k, int x_bf16, int bf16_out, int threads);
int trioserve_int6_q8_matmul(const uint8_t *packed, const uint16_t *scales, const void *x, void *out, int64_t rows, int64_t n,
                             int64_t k, int x_bf16, int bf16_out, int threads);
int trioserve_int6s_q8_matmul(const uint8_t *packed, const uint16_t *scales, const void *x, void *out, int64_t rows, int64_t n,
                              int64_t k, int x_bf16, int bf16_out, int threads);
int trioserve_int8_q8_matmul(const int8_t *packed, const uint16_t *scales, const void *x, void *out, int64_t rows, int64_t n,
                             int64_t k, int x_bf16, int bf16_out, int threads);
int trioserve_int8_matmul(const int8_t *packed, const float *scale, const void *x, float *out, int64_t rows, int64_t n, int64_t k,
                          int x_bf16, int threads);
int trioserve_w16_matmul(const uint16_t *packed, const void *x, void *out, int64_t rows, int64_t n, int64_t k, int w_bf16,
                         int x_bf16, int out_bf16, int threads);
int trioserve_decode_attention(const void *q, const void *k, const void *v, const int64_t *tables, const int64_t *row_seq,
                               const int64_t *lens, float *out, int64_t rows, int64_t num_tables, int64_t heads,
                               int64_t kv_heads, int64_t num_blocks, int64_t block_size, int64_t dim, int64_t max_blocks,
                               float scale, int bf16, int kv_bf16, int threads);
void trioserve_rms_norm(const float *x, const float *weight, void *out, int64_t rows, int64_t n, float eps, int bf16);
void trioserve_add_rms_norm(float *h, const void *delta, const float *weight, void *out, int64_t rows, int64_t n, float eps,
                            int delta_bf16, int bf16);
void trioserve_silu_mul(const void *gu, void *out, int64_t rows, int64_t f, int bf16);
int trioserve_rope_write_kv(const void *qkv, const int64_t *positions, const float *cos, const float *sin, void *q_out,
                            void *k_cache, void *v_cache, const int64_t *slots, int64_t rows, int64_t real, int64_t heads,
                            int64_t kv_heads, int64_t dim, int64_t max_position, int64_t num_slots, int bf16, int kv_bf16);
void trioserve_pack_int4_q8_rows(const uint8_t *const *rows, int64_t n, int64_t k, int kind, int64_t group, uint8_t *codes,
                                 uint16_t *scales, int threads);
void trioserve_pack_int6_q8_rows(const uint8_t *const *rows, int64_t n, int64_t k, int kind, int64_t group, int symmetric,
                                 uint8_t *codes, uint16_t *scales, int threads);
void trioserve_pack_int8_q8_rows(const uint8_t *const *rows, int64_t n, int64_t k, int64_t group, uint8_t *codes,
                                 uint16_t *scales, int threads);
void trioserve_pack_w16_rows(const uint16_t *const *rows, int64_t n, int64_t k, uint16_t *out, int threads);
int trioserve_int6_rows_symmetric(const uint8_t *const *rows, int64_t n, int64_t k, int kind, int threads);

void trioserve_exp_shifted(const float *x, const float *shift, float *out, int64_t rows, int64_t n, int threads);
void trioserve_block_sums(const float *w, double *sums, int64_t rows, int64_t n, int64_t block, int threads);
void trioserve_exp_sums(const float *x, float *maxes, double *sums, int64_t rows, int64_t n, int64_t block, int threads);
void trioserve_log_softmax(const float *x, const float *maxes, const double *lse, float *out, int64_t rows, int64_t n, int threads);

#ifdef HARNESS_STATIC
#include "cpu_kernels.c"
#include "sampler.c"
#endif

#define MOST 16

static int64_t word(FILE *f) {
    int64_t v;
    if (fread(&v, sizeof v, 1, f) != 1) exit(3);
    return v;
}

static int64_t count(FILE *f) {
    const int64_t n = word(f);
    if (n < 0 || n > MOST) exit(3);
    return n;
}

/* Row i of a weight starts at raw + order[i] * row_bytes (the packers read
 * rows through pointers, in any order). Freed by the caller. */
static const void **row_pointers(const void *raw, const int64_t *order, int64_t n, int64_t row_bytes) {
    const void **rows = malloc(sizeof *rows * (size_t)n + 1);
    if (!rows) exit(4);
    for (int64_t i = 0; i < n; i++) rows[i] = (const char *)raw + order[i] * row_bytes;
    return rows;
}

/* One case: `a` the ints, `f` the floats, `in` the inputs, `out` the outputs. */
static int64_t run(int64_t op, const int64_t *a, const double *f, void **in, void **out) {
    switch (op) {
    /* matmuls: ints rows, n, k, threads; inputs packed, scales, x (fp32); output out (fp32) */
    case 1: return trioserve_int4_q8_matmul(in[0], in[1], in[2], out[0], a[0], a[1], a[2], 0, 0, (int)a[3]);
    case 2: return trioserve_int6_q8_matmul(in[0], in[1], in[2], out[0], a[0], a[1], a[2], 0, 0, (int)a[3]);
    case 3: return trioserve_int8_matmul(in[0], in[1], in[2], out[0], a[0], a[1], a[2], 0, (int)a[3]);
    case 4: return trioserve_int8_q8_matmul(in[0], in[1], in[2], out[0], a[0], a[1], a[2], 0, 0, (int)a[3]);
    case 5: return trioserve_w16_matmul(in[0], in[2], out[0], a[0], a[1], a[2], 0, 0, 0, (int)a[3]); /* F16 weights */
    case 6: return trioserve_int6s_q8_matmul(in[0], in[1], in[2], out[0], a[0], a[1], a[2], 0, 0, (int)a[3]);
    /* the sampler's fixed order: ints rows, n (, block), threads */
    case 30: trioserve_exp_shifted(in[0], in[1], out[0], a[0], a[1], (int)a[2]); return 0;    /* x, shift -> out */
    case 31: trioserve_block_sums(in[0], out[0], a[0], a[1], a[2], (int)a[3]); return 0;      /* w -> sums */
    case 32: trioserve_exp_sums(in[0], out[0], out[1], a[0], a[1], a[2], (int)a[3]); return 0; /* x -> maxes, sums */
    case 33: trioserve_log_softmax(in[0], in[1], in[2], out[0], a[0], a[1], (int)a[2]); return 0; /* x, maxes, lse -> out */
    /* attention: ints rows, num_tables, heads, kv_heads, num_blocks, block_size, dim, max_blocks, bf16,
     * kv_bf16, threads; float scale; inputs q, k, v, tables, row_seq (empty: none), lens; output out */
    case 10:
        return trioserve_decode_attention(in[0], in[1], in[2], in[3], a[11] ? in[4] : NULL, in[5], out[0], a[0], a[1], a[2], a[3], a[4],
                                          a[5], a[6], a[7], (float)f[0], (int)a[8], (int)a[9], (int)a[10]);
    /* ints rows, n, bf16; float eps; inputs x, weight; output out */
    case 11: trioserve_rms_norm(in[0], in[1], out[0], a[0], a[1], (float)f[0], (int)a[2]); return 0;
    /* ints rows, n, delta_bf16, bf16; float eps; inputs h (written), delta, weight; output out */
    case 12: trioserve_add_rms_norm(in[0], in[1], in[2], out[0], a[0], a[1], (float)f[0], (int)a[2], (int)a[3]); return 0;
    /* ints rows, f, bf16; input gate_up; output out */
    case 13: trioserve_silu_mul(in[0], out[0], a[0], a[1], (int)a[2]); return 0;
    /* ints rows, real, heads, kv_heads, dim, max_position, num_slots, bf16, kv_bf16; inputs qkv,
     * positions, cos, sin, k_cache, v_cache (both written), slots; output q */
    case 14:
        return trioserve_rope_write_kv(in[0], in[1], in[2], in[3], out[0], in[4], in[5], in[6], a[0], a[1], a[2], a[3], a[4], a[5],
                                       a[6], (int)a[7], (int)a[8]);
    /* packers: ints n, k, kind, group, symmetric, row_bytes, threads; inputs raw rows, order (int64);
     * outputs codes, scales (w16: out alone). The 6-bit one returns what
     * trioserve_int6_rows_symmetric finds. */
    case 20:
    case 21:
    case 22:
    case 23: {
        const void **rows = row_pointers(in[0], in[1], a[0], a[5]);
        int64_t code = 0;
        if (op == 20) trioserve_pack_int4_q8_rows((const uint8_t *const *)rows, a[0], a[1], (int)a[2], a[3], out[0], out[1], (int)a[6]);
        if (op == 21) {
            code = trioserve_int6_rows_symmetric((const uint8_t *const *)rows, a[0], a[1], (int)a[2], (int)a[6]);
            trioserve_pack_int6_q8_rows((const uint8_t *const *)rows, a[0], a[1], (int)a[2], a[3], (int)a[4], out[0], out[1], (int)a[6]);
        }
        if (op == 22) trioserve_pack_int8_q8_rows((const uint8_t *const *)rows, a[0], a[1], a[3], out[0], out[1], (int)a[6]);
        if (op == 23) trioserve_pack_w16_rows((const uint16_t *const *)rows, a[0], a[1], out[0], (int)a[6]);
        free(rows);
        return code;
    }
    default: return -1;
    }
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    FILE *job = fopen(argv[1], "rb"), *res = fopen(argv[2], "wb");
    if (!job || !res) return 3;
    int64_t op;
    while (fread(&op, sizeof op, 1, job) == 1) {
        int64_t a[MOST] = {0}, size[2 * MOST];
        double f[MOST] = {0};
        void *buf[2 * MOST];
        const int64_t ints = count(job);
        for (int64_t i = 0; i < ints; i++) a[i] = word(job);
        const int64_t floats = count(job);
        if (floats && fread(f, sizeof f[0], (size_t)floats, job) != (size_t)floats) return 3;
        const int64_t inputs = count(job);
        for (int64_t i = 0; i < inputs; i++) {
            size[i] = word(job);
            buf[i] = malloc((size_t)size[i] + 1);
            if (!buf[i] || fread(buf[i], 1, (size_t)size[i], job) != (size_t)size[i]) return 3;
        }
        const int64_t outputs = count(job);
        for (int64_t i = inputs; i < inputs + outputs; i++) {
            size[i] = word(job);
            buf[i] = calloc((size_t)size[i] + 1, 1);
            if (!buf[i]) return 4;
        }
        const int64_t code = run(op, a, f, buf, buf + inputs), total = inputs + outputs;
        fwrite(&code, sizeof code, 1, res);
        fwrite(&total, sizeof total, 1, res);
        for (int64_t i = 0; i < total; i++) {
            fwrite(&size[i], sizeof size[i], 1, res);
            if (fwrite(buf[i], 1, (size_t)size[i], res) != (size_t)size[i]) return 4;
            free(buf[i]);
        }
    }
    if (fclose(res)) return 4;
    fclose(job);
    printf("%s\n", trioserve_isa());
    return 0;
}
