/* A decoder layer's elementwise steps, each one pass over its rows (float32).
 *
 * Between its matmuls a layer normalises, rotates and gates [tokens, width] activations. As
 * torch ops each step is several passes with a fresh tensor per op (RMSNorm alone: pow, mean,
 * add, rsqrt, mul, mul); here each is one loop over the row while it sits in L1:
 *   kvf_add_rms_norm  x += add (the residual stream), then out = weight * x / rms(x)
 *   kvf_rope          rotate q or k (neox halves) from a strided view into a packed copy
 *   kvf_silu_mul      out = silu(gate) * up
 * The arithmetic is the reference's, operation for operation where it can be (the build
 * passes -ffp-contract=off, so no multiply-add is fused): RoPE and the gate are rounded as
 * torch rounds them, up to exp's last bit; RMSNorm's sum of squares goes in 16 lanes, a
 * different order from torch's, so its results may differ from torch's by an ulp or two.
 * Plain C that the compiler vectorises (16-lane accumulators, no reduction across lanes in
 * the hot loop); rows are shared out to `num_threads` OpenMP threads when there are enough.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { LANES = 16 };

/* Below this many elements a step runs on the calling thread (a decode row is 576). */
#define PARALLEL_MIN 16384

/* x[r] += add[r] (when add is not NULL), then out[r] = weight * (x[r] * rsqrt(mean(x[r]^2) +
 * eps)). Rows are contiguous, `dim` floats apart; out may be x. */
void kvf_add_rms_norm(float *x, const float *add, const float *weight, float *out,
                      int64_t rows, int64_t dim, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && rows * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        float *yr = out + r * dim;
        if (add) {
            const float *ar = add + r * dim;
            for (int64_t j = 0; j < dim; j++) xr[j] = xr[j] + ar[j];
        }
        float acc[LANES] = {0};
        int64_t j = 0;
        for (; j + LANES <= dim; j += LANES)
            for (int k = 0; k < LANES; k++) acc[k] += xr[j + k] * xr[j + k];
        float ss = 0.0f;
        for (int k = 0; k < LANES; k++) ss += acc[k];
        for (; j < dim; j++) ss += xr[j] * xr[j];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (j = 0; j < dim; j++) yr[j] = weight[j] * (xr[j] * inv);
    }
}

/* Rotary embedding, transformers' rotate_half layout: per head of `dim` (halves h = dim/2),
 *   out[i]     = x[i]     * cos[i]     - x[i + h] * sin[i]
 *   out[i + h] = x[i + h] * cos[i + h] + x[i]     * sin[i + h]
 * x: rows of `heads` contiguous heads, `x_stride` floats apart (a view into a wider
 * projection output); out: the same shape with rows `out_stride` apart (may be x itself);
 * cos, sin: [rows, dim]. */
void kvf_rope(const float *x, int64_t x_stride, float *out, int64_t out_stride, int64_t rows,
              int heads, int dim, const float *cos_, const float *sin_, int num_threads) {
    const int h = dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && rows * heads * dim >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_ + r * dim;
        const float *s = sin_ + r * dim;
        for (int hd = 0; hd < heads; hd++) {
            const float *xr = x + r * x_stride + (int64_t)hd * dim;
            float *yr = out + r * out_stride + (int64_t)hd * dim;
            float lo[256], hi[256]; /* in place (out == x) needs the inputs kept */
            for (int i = 0; i < h; i++) {
                lo[i] = xr[i] * c[i] + -xr[i + h] * s[i];
                hi[i] = xr[i + h] * c[i + h] + xr[i] * s[i + h];
            }
            memcpy(yr, lo, sizeof(float) * h);
            memcpy(yr + h, hi, sizeof(float) * h);
        }
    }
}

/* e^x, Cephes' expf: x = n ln2 + r with ln2 in two parts (n * the first is exact), |r| <=
 * ln2 / 2, e^r by a degree-7 polynomial, then scaled by 2^n (in two steps, so that the
 * largest and the subnormal results come out right). Within an ulp or two of torch's exp;
 * 0 below -104, inf above 89. */
static inline float exp_approx(float x) {
    x = x < -104.0f ? -104.0f : x > 89.0f ? 89.0f : x;
    const float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * (r * r) + r + 1.0f;
    const int32_t ni = (int32_t)n;
    const int32_t a = ni >> 1, b = ni - a;
    float sa, sb;
    const uint32_t ua = (uint32_t)(a + 127) << 23, ub = (uint32_t)(b + 127) << 23;
    memcpy(&sa, &ua, sizeof sa);
    memcpy(&sb, &ub, sizeof sb);
    return y * sa * sb;
}

/* out[r] = silu(gate[r]) * up[r] = gate / (1 + e^-gate) * up, rows of n; gate and up rows
 * `gate_stride` and `up_stride` floats apart (halves of one gate/up product), out packed. */
void kvf_silu_mul(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride,
                  float *out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && rows * n >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gate_stride;
        const float *u = up + r * up_stride;
        float *y = out + r * n;
        for (int64_t j = 0; j < n; j++) y[j] = g[j] / (1.0f + exp_approx(-g[j])) * u[j];
    }
}
