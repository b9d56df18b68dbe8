/* A harness for tests/kernels/test_arm_window.py: runs the ARM build of the
 * C kernels (linked to the shared object test_neon.py builds) under qemu on
 * one case read from a file, for the kernels neon_harness.c does not call:
 * sliding-window attention and GeGLU.
 *
 *   harness window IN OUT   IN: int64 rows, num_tables, heads, kv_heads,
 *                           num_blocks, block_size, dim, max_blocks, window,
 *                           bf16, kv_bf16, threads, has_row_seq; float64
 *                           scale; then q, k, v, tables, row_seq (rows int64,
 *                           when has_row_seq), lens, each as in memory.
 *                           OUT: int64 code, then out [rows, heads, dim] fp32.
 *   harness geglu IN OUT    IN: int64 rows, f, bf16; then gu [rows, 2f].
 *                           OUT: out [rows, f] in gu's dtype. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int trioserve_window_attention(const void *q, const void *k, const void *v, const int64_t *tables, const int64_t *row_seq,
                               const int64_t *lens, float *out, int64_t rows, int64_t num_tables, int64_t heads,
                               int64_t kv_heads, int64_t num_blocks, int64_t block_size, int64_t dim, int64_t max_blocks,
                               int64_t window, float scale, int bf16, int kv_bf16, int threads);
void trioserve_gelu_tanh_mul(const void *gu, void *out, int64_t rows, int64_t f, int bf16);

static void *take(FILE *in, size_t bytes) {
    void *p = malloc(bytes + 1);
    if (!p || fread(p, 1, bytes, in) != bytes) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    FILE *in = fopen(argv[2], "rb"), *out = fopen(argv[3], "wb");
    if (!in || !out) return 2;
    if (!strcmp(argv[1], "window")) {
        int64_t *a = take(in, 13 * sizeof(int64_t));
        double *scale = take(in, sizeof(double));
        const int64_t rows = a[0], tables = a[1], heads = a[2], kvh = a[3], nb = a[4], bs = a[5], dim = a[6], mb = a[7];
        const size_t qe = a[9] ? 2 : 4, ke = a[10] ? 2 : 4;
        void *q = take(in, (size_t)(rows * heads * dim) * qe);
        void *k = take(in, (size_t)(kvh * nb * bs * dim) * ke), *v = take(in, (size_t)(kvh * nb * bs * dim) * ke);
        int64_t *t = take(in, (size_t)(tables * mb) * 8), *seq = a[12] ? take(in, (size_t)rows * 8) : NULL;
        int64_t *lens = take(in, (size_t)rows * 8);
        float *o = calloc((size_t)(rows * heads * dim) + 1, sizeof(float));
        int64_t code = trioserve_window_attention(q, k, v, t, seq, lens, o, rows, tables, heads, kvh, nb, bs, dim, mb, a[8],
                                                  (float)*scale, (int)a[9], (int)a[10], (int)a[11]);
        fwrite(&code, sizeof code, 1, out);
        fwrite(o, sizeof(float), (size_t)(rows * heads * dim), out);
    } else if (!strcmp(argv[1], "geglu")) {
        int64_t *a = take(in, 3 * sizeof(int64_t));
        const size_t es = a[2] ? 2 : 4;
        void *gu = take(in, (size_t)(a[0] * 2 * a[1]) * es), *o = malloc((size_t)(a[0] * a[1]) * es + 1);
        trioserve_gelu_tanh_mul(gu, o, a[0], a[1], (int)a[2]);
        fwrite(o, es, (size_t)(a[0] * a[1]), out);
    } else {
        return 2;
    }
    return fclose(out) ? 2 : 0;
}
