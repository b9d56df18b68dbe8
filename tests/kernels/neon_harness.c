/* Runs one of the C kernels built for 64-bit ARM (under qemu-user in the
 * tests: tests/kernels/test_neon.py). Reads a job file: int64 kind
 * (1 int4_q8_matmul, 2 int6_q8_matmul, 3 int8_matmul, 4 int8_q8_matmul, 5 w16_matmul, 6 int6s_q8_matmul
 * on F16), rows, n, k, the
 * packed bytes' count, the scales' byte count; then the packed bytes, the
 * scales and x (rows x k fp32). Writes out (rows x n fp32), then the
 * kernels' instruction-set word on stdout. */
#include "cpu_kernels.c"

#include <stdio.h>

static void *read_all(FILE *f, size_t bytes) {
    void *p = malloc(bytes + 1);
    if (!p || fread(p, 1, bytes, f) != bytes) exit(3);
    return p;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    FILE *in = fopen(argv[1], "rb");
    if (!in) return 3;
    int64_t h[6];
    if (fread(h, sizeof h[0], 6, in) != 6) return 3;
    const int64_t kind = h[0], rows = h[1], n = h[2], k = h[3];
    void *packed = read_all(in, (size_t)h[4]), *scales = read_all(in, (size_t)h[5]);
    float *x = read_all(in, (size_t)(rows * k) * sizeof(float)), *out = malloc((size_t)(rows * n) * sizeof(float) + 1);
    fclose(in);
    int code = 5;
    if (kind == 1) code = trioserve_int4_q8_matmul(packed, scales, x, out, rows, n, k, 0, 0, 1);
    if (kind == 2) code = trioserve_int6_q8_matmul(packed, scales, x, out, rows, n, k, 0, 0, 1);
    if (kind == 3) code = trioserve_int8_matmul(packed, scales, x, out, rows, n, k, 0, 1);
    if (kind == 5) code = trioserve_w16_matmul(packed, x, out, rows, n, k, 0, 0, 0, 1);
    if (kind == 4) code = trioserve_int8_q8_matmul(packed, scales, x, out, rows, n, k, 0, 0, 1);
    if (kind == 6) code = trioserve_int6s_q8_matmul(packed, scales, x, out, rows, n, k, 0, 0, 1);
    if (code) return 10 + code;
    FILE *o = fopen(argv[2], "wb");
    if (!o || fwrite(out, sizeof(float), (size_t)(rows * n), o) != (size_t)(rows * n)) return 4;
    fclose(o);
    printf("%s\n", trioserve_isa());
    return 0;
}
