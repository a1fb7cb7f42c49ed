/* Causal attention of one prefill chunk over its keys in the paged KV pool, read in place.
 *
 * The chunk's queries sit at positions start .. start + num_q - 1; its own K/V is already in
 * the pool, so every key 0 .. start + num_q - 1 is read from the sequence's blocks (block
 * table), one 64-token block at a time: no gather into a contiguous copy, no repeat of K/V
 * per query head, no mask tensor, no merge of a prefix part and a causal part. A query at
 * position p sees keys 0 .. p; blocks wholly after a tile's last query are never read.
 *
 * Pool layout (worker.engine.kv_cache): float32 [num_blocks, full_layers, 2 (K, V),
 * block_tokens, kv_heads, head_dim]. q and out: [num_q, heads, head_dim], query head
 * h * n_rep + r reading KV head h (transformers' repeat_kv grouping).
 *
 * The n_rep query heads of a KV head are folded into its rows, position-major (row
 * t * n_rep + r), and taken RT rows (a tile) at a time, GT tiles (a group) per work item:
 * each block is read once per group. Per tile and block it is flash attention:
 *   S = Q K^T for RT rows x 64 keys in 24 AVX-512 accumulators, against K transposed once
 *       per block and KV head into `scratch` ([kv_heads][blocks][head_dim][64]);
 *   the running max and sum of each row rescale its output (online softmax, base 2: the
 *       queries carry scale * log2(e));
 *   O += P V, V read in place one key at a time.
 * Work items are (KV head, group), handed out dynamically to the OpenMP team (torch's own
 * libgomp: the one already loaded in the process).
 *
 * Needs AVX-512F (kvf_attention_simd() says whether this build has it), head_dim a multiple
 * of 64 up to 256 and 64-token blocks; the caller checks and otherwise uses SDPA.
 */
#include <math.h>
#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>
#define KVF_ATTN_AVX512 1
#else
#define KVF_ATTN_AVX512 0
#endif

int kvf_attention_simd(void) { return KVF_ATTN_AVX512; }

enum { KT = 64, RT = 6, GT = 4, MAX_DIM = 256 };

#if KVF_ATTN_AVX512

/* 2^x for x <= 128: 2^round(x) * p(x - round(x)), p of degree 6 fitted on [-0.5, 0.5]
 * (relative error 3e-9 before float32 rounding). x = -inf gives +0. */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-160.0f));
    const __m512 xi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, xi);
    __m512 p = _mm512_set1_ps(1.546973197e-04f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.340043217e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618025603e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550327214e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265121e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472067e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, xi);
}

/* Lane r (r < 8) of the result: the largest of v[r]'s 16 lanes. Halves, then quarters of
 * pairs of vectors are folded together, then each quarter within itself. */
static inline __m512 row_maxima(const __m512 v[8]) {
    __m512 a[4], b[2];
    for (int i = 0; i < 4; i++) /* quarters: v[2i] (2), v[2i+1] (2) */
        a[i] = _mm512_max_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++) { /* quarters: v[4i] .. v[4i+3], one each */
        b[i] = _mm512_max_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
        b[i] = _mm512_max_ps(b[i], _mm512_permute_ps(b[i], _MM_SHUFFLE(2, 3, 0, 1)));
        b[i] = _mm512_max_ps(b[i], _mm512_permute_ps(b[i], _MM_SHUFFLE(1, 0, 3, 2)));
    }
    const __m512i first = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 28, 24, 20, 16, 12, 8, 4, 0);
    return _mm512_permutex2var_ps(b[0], first, b[1]);
}

/* Lanes of 16 keys from key0 that a query at position pos may see. */
static inline __mmask16 visible(int64_t key0, int64_t pos) {
    const int64_t n = pos - key0 + 1;
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* A tile's running state: RT rows' scaled queries, unnormalised outputs, maxima and sums. */
struct tile_state {
    float qs[RT][MAX_DIM] __attribute__((aligned(64)));
    float o[RT][MAX_DIM] __attribute__((aligned(64)));
    float l[RT][16] __attribute__((aligned(64))); /* running sums, 16 lanes a row */
    float m[16] __attribute__((aligned(64)));     /* running maxima, rows' lanes 0 .. RT-1 */
    int64_t pos[RT];
    float *orow[RT];
};

/* One tile against one block: S = Q K^T, online softmax, O = alpha O + P V. */
static inline __attribute__((always_inline)) void tile_block(
    struct tile_state *st, int dim, int num_kv_heads, int64_t key0, const float *ktb,
    const float *vb) {
    float pr[RT][KT] __attribute__((aligned(64)));
    float alpha[16] __attribute__((aligned(64)));
    __m512 s[RT][4];
#pragma GCC unroll 6
    for (int r = 0; r < RT; r++)
        for (int c = 0; c < 4; c++) s[r][c] = _mm512_setzero_ps();
    for (int d = 0; d < dim; d++) {
        const __m512 k0 = _mm512_load_ps(ktb + d * KT);
        const __m512 k1 = _mm512_load_ps(ktb + d * KT + 16);
        const __m512 k2 = _mm512_load_ps(ktb + d * KT + 32);
        const __m512 k3 = _mm512_load_ps(ktb + d * KT + 48);
#pragma GCC unroll 6
        for (int r = 0; r < RT; r++) {
            const __m512 x = _mm512_set1_ps(st->qs[r][d]);
            s[r][0] = _mm512_fmadd_ps(x, k0, s[r][0]);
            s[r][1] = _mm512_fmadd_ps(x, k1, s[r][1]);
            s[r][2] = _mm512_fmadd_ps(x, k2, s[r][2]);
            s[r][3] = _mm512_fmadd_ps(x, k3, s[r][3]);
        }
    }
    /* Online softmax. The rows' maxima over this block together (lanes after a row's
     * position are -inf), then the rows' new maxima and rescale factors as one vector, then
     * the probabilities, whose sums stay in 16 lanes a row until the end. */
    const int full = key0 + KT - 1 <= st->pos[0];
    __mmask16 mk[RT][4];
    __m512 mx[8];
#pragma GCC unroll 6
    for (int r = 0; r < RT; r++) {
        for (int c = 0; c < 4; c++) {
            mk[r][c] = full ? (__mmask16)0xFFFF : visible(key0 + 16 * c, st->pos[r]);
            s[r][c] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mk[r][c], s[r][c]);
        }
        mx[r] = _mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]), _mm512_max_ps(s[r][2], s[r][3]));
    }
    for (int r = RT; r < 8; r++) mx[r] = _mm512_set1_ps(-INFINITY);
    const __mmask16 rows = (__mmask16)((1u << RT) - 1);
    const __m512 m_old = _mm512_maskz_load_ps(rows, st->m);
    const __m512 m_max = _mm512_max_ps(m_old, row_maxima(mx));
    _mm512_mask_store_ps(st->m, rows, m_max);
    /* m = -inf before the first block: alpha 0 */
    _mm512_store_ps(alpha, exp2_ps(_mm512_sub_ps(m_old, m_max)));
#pragma GCC unroll 6
    for (int r = 0; r < RT; r++) {
        const __m512 mn = _mm512_set1_ps(st->m[r]);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < 4; c++) {
            const __m512 p = _mm512_maskz_mov_ps(mk[r][c], exp2_ps(_mm512_sub_ps(s[r][c], mn)));
            _mm512_store_ps(pr[r] + 16 * c, p);
            sum = _mm512_add_ps(sum, p);
        }
        _mm512_store_ps(st->l[r], _mm512_add_ps(
            _mm512_mul_ps(_mm512_load_ps(st->l[r]), _mm512_set1_ps(alpha[r])), sum));
    }
    /* O = alpha O + P V over the keys some row of the tile sees. */
    const int64_t seen = st->pos[RT - 1] - key0 + 1;
    const int num_keys = seen < KT ? (int)seen : KT;
    for (int d0 = 0; d0 < dim; d0 += 64) {
        __m512 acc[RT][4];
#pragma GCC unroll 6
        for (int r = 0; r < RT; r++) {
            const __m512 a = _mm512_set1_ps(alpha[r]);
            for (int c = 0; c < 4; c++)
                acc[r][c] = _mm512_mul_ps(a, _mm512_load_ps(st->o[r] + d0 + 16 * c));
        }
        for (int j = 0; j < num_keys; j++) {
            const float *vj = vb + (int64_t)j * num_kv_heads * dim + d0;
            const __m512 v0 = _mm512_loadu_ps(vj);
            const __m512 v1 = _mm512_loadu_ps(vj + 16);
            const __m512 v2 = _mm512_loadu_ps(vj + 32);
            const __m512 v3 = _mm512_loadu_ps(vj + 48);
#pragma GCC unroll 6
            for (int r = 0; r < RT; r++) {
                const __m512 p = _mm512_set1_ps(pr[r][j]);
                acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
                acc[r][2] = _mm512_fmadd_ps(p, v2, acc[r][2]);
                acc[r][3] = _mm512_fmadd_ps(p, v3, acc[r][3]);
            }
        }
#pragma GCC unroll 6
        for (int r = 0; r < RT; r++)
            for (int c = 0; c < 4; c++) _mm512_store_ps(st->o[r] + d0 + 16 * c, acc[r][c]);
    }
}

/* A group of up to GT tiles (GT * RT folded rows from row0) of KV head h. Each block is
 * read once for the whole group, so its K and V stay in L1/L2 across the tiles. */
static void group(const float *q, float *out, int64_t num_q, int64_t start, int num_heads,
                  int num_kv_heads, int dim, int h, int64_t row0, const float *pool,
                  int64_t block_stride, int64_t layer_offset, const int64_t *block_table,
                  const float *kt, int64_t num_blocks, float scale_log2) {
    struct tile_state states[GT];
    const int n_rep = num_heads / num_kv_heads;
    const int64_t num_rows = num_q * n_rep;
    const int64_t v_offset = (int64_t)KT * num_kv_heads * dim;
    int num_tiles = 0;
    for (int g = 0; g < GT; g++)
        for (int j = 0; j < 16; j++) states[g].m[j] = -INFINITY;
    for (int g = 0; g < GT && row0 + g * RT < num_rows; g++, num_tiles++) {
        struct tile_state *st = &states[g];
        for (int r = 0; r < RT; r++) {
            const int64_t row = row0 + g * RT + r;
            const int64_t f = row < num_rows ? row : num_rows - 1; /* padding repeats a row */
            const int64_t t = f / n_rep;
            const int head = h * n_rep + (int)(f % n_rep);
            const float *qrow = q + (t * num_heads + head) * dim;
            st->orow[r] = row < num_rows ? out + (t * num_heads + head) * dim : 0;
            st->pos[r] = start + t;
            for (int d = 0; d < dim; d++) {
                st->qs[r][d] = qrow[d] * scale_log2;
                st->o[r][d] = 0.0f;
            }
            for (int j = 0; j < 16; j++) st->l[r][j] = 0.0f;
        }
    }
    const int64_t last_block = states[num_tiles - 1].pos[RT - 1] / KT;
    for (int64_t b = 0; b <= last_block && b < num_blocks; b++) {
        const int64_t key0 = b * KT;
        const float *ktb = kt + ((int64_t)h * num_blocks + b) * dim * KT;
        const float *vb = pool + block_table[b] * block_stride + layer_offset + v_offset
                          + (int64_t)h * dim;
        for (int g = 0; g < num_tiles; g++)
            if (states[g].pos[RT - 1] >= key0)
                tile_block(&states[g], dim, num_kv_heads, key0, ktb, vb);
    }
    for (int g = 0; g < num_tiles; g++)
        for (int r = 0; r < RT; r++) {
            const struct tile_state *st = &states[g];
            if (!st->orow[r]) continue;
            const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_load_ps(st->l[r]));
            for (int d = 0; d < dim; d++) st->orow[r][d] = st->o[r][d] * inv;
        }
}

#endif

/* Returns 0, or -1 when this build or these shapes are not served (the caller checks first).
 * scratch: kv_heads * ceil((start + num_q) / 64) * head_dim * 64 floats, 64-byte aligned. */
int kvf_paged_attention(const float *q, int64_t num_q, int64_t start, int num_heads,
                        int num_kv_heads, int head_dim, const float *pool, int64_t block_stride,
                        int64_t layer_offset, int block_tokens, const int64_t *block_table,
                        float scale, float *out, float *scratch, int num_threads) {
#if KVF_ATTN_AVX512
    if (block_tokens != KT || head_dim % 64 || head_dim > MAX_DIM || num_q <= 0 ||
        num_kv_heads <= 0 || num_heads % num_kv_heads)
        return -1;
    const int dim = head_dim;
    const int64_t num_blocks = (start + num_q + KT - 1) / KT;
    const int64_t num_rows = num_q * (num_heads / num_kv_heads);
    const int64_t groups = (num_rows + GT * RT - 1) / (GT * RT);
    const float scale_log2 = scale * 1.44269504088896340736f;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        /* K of each (KV head, block) transposed to [dim][64]. */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_kv_heads * num_blocks; i++) {
            const int h = (int)(i / num_blocks);
            const int64_t b = i % num_blocks;
            const float *kb = pool + block_table[b] * block_stride + layer_offset + (int64_t)h * dim;
            float *dst = scratch + i * dim * KT;
            const int64_t valid = start + num_q - b * KT;
            const int n = valid < KT ? (int)valid : KT;
            for (int j = 0; j < n; j++) {
                const float *kj = kb + (int64_t)j * num_kv_heads * dim;
                for (int d = 0; d < dim; d++) dst[d * KT + j] = kj[d];
            }
            for (int j = n; j < KT; j++)
                for (int d = 0; d < dim; d++) dst[d * KT + j] = 0.0f;
        }
        /* Head-major order: both threads work through one head's blocks at a time. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_kv_heads * groups; i++)
            group(q, out, num_q, start, num_heads, num_kv_heads, dim, (int)(i / groups),
                  (i % groups) * GT * RT, pool, block_stride, layer_offset, block_table, scratch,
                  num_blocks, scale_log2);
    }
    return 0;
#else
    (void)q; (void)num_q; (void)start; (void)num_heads; (void)num_kv_heads; (void)head_dim;
    (void)pool; (void)block_stride; (void)layer_offset; (void)block_tokens; (void)block_table;
    (void)scale; (void)out; (void)scratch; (void)num_threads;
    return -1;
#endif
}
