/* out[M, N] = x[M, K] @ W[N, K]^T with W kept in a GGUF block format.
 *
 * Decode on a CPU streams every weight once per step: SmolLM2-135M's 540 MB of float32
 * weights are 47 of a 66 ms step. Its file keeps them as Q4_1 (5 bits a weight) and Q8_0
 * (8.5 bits); multiplying by those blocks reads 5-6x fewer bytes. A block holds 32 weights:
 *   Q4_0  w = d * (q - 8)      q: 4 bits   (f16 d, 16 bytes of codes)
 *   Q4_1  w = d * q + m        q: 4 bits   (f16 d, f16 m, 16 bytes of codes)
 *   Q8_0  w = d * q            q: int8     (f16 d, 32 bytes of codes)
 * Codes of a 4-bit block as stored here: byte j holds element 2j in its low nibble and
 * element 2j + 1 in its high one (QuantWeight.from_blocks reorders GGUF's, where byte j holds
 * elements j and j + 16), so a 32-bit word is 8 consecutive elements. d and m come as float32 arrays [N, K / 32] (converted from f16 once, at load:
 * exact); Q4_0 comes with m = -8 d.
 *
 * The product is the float32 product with the dequantized weights up to rounding (a few
 * float32 ulps of the result; tests/unit/engine/test_quant.py): per block it computes
 * d * sum(q * x) + m * sum(x), which never scales a code. Each output element is summed in
 * one fixed order whatever M is, so a sequence's logits do not depend on which others share
 * its batch. Rows of x go in tiles of up to 4 against each block's converted codes; the
 * caller sends large M (prefill) to a float32 GEMM instead. kvf_quant_dequantize gives the
 * weights themselves, bit for bit what gguf.quants gives (multiply and add each rounded: the
 * build passes -ffp-contract=off).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVF_AVX2 1
#else
#define KVF_AVX2 0
#endif

enum { QK = 32, TILE = 8 };
enum { FMT_Q4_0 = 0, FMT_Q4_1 = 1, FMT_Q8_0 = 2 };

int kvf_quant_simd(void) { return KVF_AVX2; }

static int code_bytes_per_block(int fmt) { return fmt == FMT_Q8_0 ? QK : QK / 2; }

/* A block's 32 codes as floats: q (0..15) for 4-bit blocks, the int8 for Q8_0. */
static void codes_scalar(int fmt, const uint8_t *codes, float *q) {
    for (int j = 0; j < QK; j++) {
        if (fmt == FMT_Q8_0)
            q[j] = (float)(int8_t)codes[j];
        else
            q[j] = (float)((codes[j / 2] >> (4 * (j % 2))) & 0x0F);
    }
}

#if KVF_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A block's 32 codes as floats (q for 4-bit blocks, the int8 for Q8_0), in element order. */
static inline __attribute__((always_inline)) void codes_avx2(int fmt, const uint8_t *codes, __m256 q[4]) {
    if (fmt == FMT_Q8_0) {
        for (int i = 0; i < 4; i++) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(codes + 8 * i));
            q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        }
        return;
    }
    /* Each 32-bit word holds 8 consecutive elements, element l in bits 4l..4l+3. */
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i mask = _mm256_set1_epi32(0x0F);
    for (int i = 0; i < 4; i++) {
        uint32_t word;
        memcpy(&word, codes + 4 * i, 4);
        const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts);
        q[i] = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
    }
}
#endif

/* Rows [n0, n1) of the output for rows [r0, r0 + rows) of x, rows <= TILE.
 *
 * Per block b of row n: d_b * sum_j(q_j * x_j) + m_b * sum_j(x_j) -- the same sum as
 * sum_j((d_b * q_j + m_b) * x_j), factored so that the codes are only converted, never
 * scaled, and the m_b * sum(x) terms come from `xsum` (each x row's per-block sums, shared by
 * all N rows). Q4_0 arrives here with m = -8 d. */
static inline __attribute__((always_inline)) void rows_tile(int fmt, const float *x, const float *xsum, int64_t K, const uint8_t *codes,
                      const float *d, const float *m, int64_t N, float *out, int64_t n0,
                      int64_t n1, int64_t r0, int rows) {
    const int64_t nblocks = K / QK;
    const int cb = code_bytes_per_block(fmt);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wc = codes + n * nblocks * cb;
        const float *wd = d + n * nblocks;
        const float *wm = m ? m + n * nblocks : NULL;
        float sums[TILE];
#if KVF_AVX2
        __m256 acc[TILE];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nblocks; b++) {
            __m256 q[4];
            codes_avx2(fmt, wc + b * cb, q);
            const __m256 db = _mm256_set1_ps(wd[b]);
            for (int r = 0; r < rows; r++) {
                const float *xb = x + (r0 + r) * K + b * QK;
                __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
                t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), t);
                t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), t);
                t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), t);
                acc[r] = _mm256_fmadd_ps(t, db, acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) sums[r] = hsum(acc[r]);
#else
        float acc[TILE][8];
        memset(acc, 0, sizeof(acc));
        for (int64_t b = 0; b < nblocks; b++) {
            float q[QK];
            codes_scalar(fmt, wc + b * cb, q);
            for (int r = 0; r < rows; r++) {
                const float *xb = x + (r0 + r) * K + b * QK;
                float t[8];
                for (int l = 0; l < 8; l++) t[l] = q[l] * xb[l];
                for (int i = 1; i < 4; i++)
                    for (int l = 0; l < 8; l++) t[l] += q[8 * i + l] * xb[8 * i + l];
                for (int l = 0; l < 8; l++) acc[r][l] += t[l] * wd[b];
            }
        }
        for (int r = 0; r < rows; r++) {
            float s = 0.0f;
            for (int l = 0; l < 8; l++) s += acc[r][l];
            sums[r] = s;
        }
#endif
        for (int r = 0; r < rows; r++) {
            float offset = 0.0f;
            if (wm) {
                const float *xs = xsum + (r0 + r) * nblocks;
                for (int64_t b = 0; b < nblocks; b++) offset += wm[b] * xs[b];
            }
            out[(r0 + r) * N + n] = sums[r] + offset;
        }
    }
}

/* rows_tile with fmt and rows as constants, so that each copy keeps its accumulators in
 * registers and drops the branches on the format. */
#define KVF_ROWS(F, R) \
    case R: rows_tile(F, x, xsum, K, codes, d, m, N, out, n0, n1, r0, R); break
#define KVF_FORMAT(F)                                                                           \
    case F:                                                                                     \
        switch (rows) {                                                                         \
            KVF_ROWS(F, 1); KVF_ROWS(F, 2); KVF_ROWS(F, 3); KVF_ROWS(F, 4);                     \
            KVF_ROWS(F, 5); KVF_ROWS(F, 6); KVF_ROWS(F, 7); KVF_ROWS(F, 8);                     \
        }                                                                                       \
        break
static void tile(int fmt, const float *x, const float *xsum, int64_t K, const uint8_t *codes,
                 const float *d, const float *m, int64_t N, float *out, int64_t n0, int64_t n1,
                 int64_t r0, int rows) {
    switch (fmt) {
        KVF_FORMAT(FMT_Q4_0);
        KVF_FORMAT(FMT_Q4_1);
        KVF_FORMAT(FMT_Q8_0);
    }
}

/* The whole product; output rows are split among `num_threads` OpenMP threads. `xsum` is
 * scratch of M * K / 32 floats. */
void kvf_quant_matmul(int fmt, const float *x, int64_t M, int64_t K, const uint8_t *codes,
                      const float *d, const float *m, int64_t N, float *out, float *xsum,
                      int num_threads) {
    const int64_t nblocks = K / QK;
    if (m) {
        for (int64_t r = 0; r < M; r++)
            for (int64_t b = 0; b < nblocks; b++) {
                float s = 0.0f;
                for (int j = 0; j < QK; j++) s += x[r * K + b * QK + j];
                xsum[r * nblocks + b] = s;
            }
    }
    const int64_t chunk = 16;
    const int64_t nchunks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        for (int64_t r0 = 0; r0 < M; r0 += TILE) {
            int rows = M - r0 < TILE ? (int)(M - r0) : TILE;
            tile(fmt, x, xsum, K, codes, d, m, N, out, n0, n1, r0, rows);
        }
    }
}

/* The float32 weights [N, K] themselves, exactly as gguf.quants computes them. */
void kvf_quant_dequantize(int fmt, int64_t N, int64_t K, const uint8_t *codes, const float *d,
                          const float *m, float *w) {
    const int64_t nblocks = K / QK;
    const int cb = code_bytes_per_block(fmt);
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nblocks; b++) {
            float q[QK];
            const float db = d[n * nblocks + b];
            float *wb = w + n * K + b * QK;
            codes_scalar(fmt, codes + (n * nblocks + b) * cb, q);
            for (int j = 0; j < QK; j++) {
                if (fmt == FMT_Q4_1)
                    wb[j] = db * q[j] + m[n * nblocks + b];
                else if (fmt == FMT_Q4_0)
                    wb[j] = db * (q[j] - 8.0f);
                else
                    wb[j] = q[j] * db;
            }
        }
}
