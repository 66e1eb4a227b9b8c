/* Paged decode attention on the CPU, fp32: one query token per sequence over its cached K/V,
 * read in place from the blocks (no gather into a contiguous copy first).
 *
 * Layout as kernels/reference.py: caches [num_blocks, block_size, Hkv, D] contiguous, so one
 * token's K (or V) row for every kv head is Hkv * D floats in a row, and a block's tokens
 * follow each other. Per sequence, two passes over its context:
 *
 *   scores[h][t] = scale * q[h] . K[t][h / G]     (every query head at once, token by token)
 *   p[h][t]      = softmax_t(scores[h])            (max-subtracted; exp vectorized)
 *   out[h]       = sum_t p[h][t] * V[t][h / G]
 *
 * Built by kernels/cpu_paged_attention.py with -O3 -march=native -ffast-math; the loops over D
 * and over t are what the compiler vectorizes. One thread: the caller's replica owns one core.
 */
#include <math.h>
#include <stdint.h>

static inline void prefetch_row(const float *p, int64_t row, int locality) {
    for (int64_t off = 0; off < row * (int64_t)sizeof(float); off += 64) {
        if (locality == 3) __builtin_prefetch((const char *)p + off, 0, 3);
        else __builtin_prefetch((const char *)p + off, 0, 1);
    }
}

/* Blocks are scattered, so the hardware prefetcher loses the stream at every block boundary
 * (16 chats, random block order: 3x slower than the same blocks in order). Each token's row
 * asks for the row one block ahead, which is then in flight while this block is read (the
 * default model's 30 layers, 16 chats of 225 tokens over scattered blocks: 28 -> 13 ms). */
static inline void prefetch_ahead(const float *cache, const int32_t *table, int64_t t, int64_t len,
                                  int64_t block_size, int64_t row) {
    const int64_t ahead = t + block_size;
    if (ahead >= len) return;
    prefetch_row(cache + ((int64_t)table[ahead / block_size] * block_size + ahead % block_size) * row, row, 3);
}

void tandem_paged_decode_f32(const float *q, float *out, const float *k_cache, const float *v_cache,
                             const int32_t *block_tables, int64_t table_width, const int32_t *context_lens,
                             int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             int64_t block_size, float scale, float *scores /* [num_heads * max_len] */) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats per token in a cache */
    for (int64_t b = 0; b < batch; b++) {
        const float *qb = q + b * num_heads * head_dim;
        float *ob = out + b * num_heads * head_dim;
        const int32_t *table = block_tables + b * table_width;
        const int64_t len = context_lens[b];

        for (int64_t t = 0; t < len; t++) {
            const float *k = k_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row;
            prefetch_ahead(k_cache, table, t, len, block_size, row);
            prefetch_row(v_cache + (k - k_cache), row, 1); /* for the V pass: 16 chats, 13.1 -> 12.1 ms */
            for (int64_t h = 0; h < num_heads; h++) {
                const float *kh = k + (h / group) * head_dim, *qh = qb + h * head_dim;
                float s = 0.f;
                for (int64_t d = 0; d < head_dim; d++) s += qh[d] * kh[d];
                scores[h * len + t] = s * scale;
            }
        }
        for (int64_t h = 0; h < num_heads; h++) {
            float *sh = scores + h * len, m = sh[0], sum = 0.f;
            for (int64_t t = 1; t < len; t++) m = sh[t] > m ? sh[t] : m;
            for (int64_t t = 0; t < len; t++) {
                sh[t] = expf(sh[t] - m);
                sum += sh[t];
            }
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < len; t++) sh[t] *= inv;
            for (int64_t d = 0; d < head_dim; d++) ob[h * head_dim + d] = 0.f;
        }
        for (int64_t t = 0; t < len; t++) {
            const float *v = v_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row;
            prefetch_ahead(v_cache, table, t, len, block_size, row);
            for (int64_t h = 0; h < num_heads; h++) {
                const float *vh = v + (h / group) * head_dim, p = scores[h * len + t];
                float *oh = ob + h * head_dim;
                for (int64_t d = 0; d < head_dim; d++) oh[d] += p * vh[d];
            }
        }
    }
}

/* Causal attention of a prefill chunk, fp32: queries [n, Hq, D] are the last n of the ctx
 * positions in K/V [ctx, Hkv, D] (rows `*_stride` floats apart; heads contiguous inside a row).
 * Flash-style: per kv head, a tile of QT queries times the G query heads that share it (rows
 * that read the same K/V), over key tiles of KT with an online softmax, so the n x ctx scores
 * never exist whole. Each head's K is transposed once so scores run along keys, 16 lanes at a time;
 * four rows go together so each loaded K (or V) vector feeds four FMAs. D is a multiple of 64.
 * Masked scores are -1e30, not -inf: -ffast-math assumes finite values. */
#define QT 8
#define KT 64
#define RB 4
#define MASKED (-1e30f)
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));
#ifdef __AVX512F__ /* one v16 is one register */
#define PIN4(x) __asm__("" : "+v"(x[0]), "+v"(x[1]), "+v"(x[2]), "+v"(x[3]))
#else
#define PIN4(x) ((void)0)
#endif

static inline __attribute__((always_inline)) void prefill_head(
        const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride, float *out,
        int64_t out_stride, int64_t n, int64_t ctx, int64_t hk, int64_t group, const int64_t D, float scale,
        float *qbuf, float *acc, float *m, float *l, float *kt) {
    /* kt rows one cache line longer than the key tiles need: at a multiple of 4 KB apart (ctx 1,024)
     * the 64 rows a tile reads share L1 sets and evict each other (1,000 tokens: 14.7 -> 10 ms) */
    const int64_t dv = D / 16, width = (ctx + KT - 1) / KT * KT + 16;
    for (int64_t t = 0; t < width; t++) { /* this head's K transposed once: kt[d][t], zero past ctx */
        const float *kr = k + (t < ctx ? t : 0) * kv_stride + hk * D;
        for (int64_t d = 0; d < D; d++) kt[d * width + t] = t < ctx ? kr[d] : 0.f;
    }
    for (int64_t i0 = 0; i0 < n; i0 += QT) {
        const int64_t qn = n - i0 < QT ? n - i0 : QT, rows = qn * group;
        const int64_t padded = (rows + RB - 1) / RB * RB; /* pad rows repeat the last one */
        for (int64_t r = 0; r < padded; r++) {
            const int64_t rr = r < rows ? r : rows - 1;
            const float *src = q + (i0 + rr / group) * q_stride + (hk * group + rr % group) * D;
            for (int64_t d = 0; d < D; d++) { qbuf[r * D + d] = src[d] * scale; acc[r * D + d] = 0.f; }
            m[r] = MASKED;
            l[r] = 0.f;
        }
        const int64_t first = ctx - n + i0, keys = first + qn; /* positions first.. ; keys [0, keys) */
        for (int64_t t0 = 0; t0 < keys; t0 += KT) {
            const int64_t tn = keys - t0 < KT ? keys - t0 : KT;
            for (int64_t r0 = 0; r0 < padded; r0 += RB) {
                v16 sc[RB][KT / 16];
                for (int64_t a = 0; a < RB; a++)
                    for (int64_t j = 0; j < KT / 16; j++) sc[a][j] = (v16){};
                for (int64_t d = 0; d < D; d++) {
                    const v16 *kd = (const v16 *)(kt + d * width + t0);
                    v16 kv[KT / 16];
                    for (int64_t j = 0; j < KT / 16; j++) kv[j] = kd[j];
                    /* an empty asm that "changes" them keeps the four K vectors in registers: folded
                     * into each FMA instead, they were loaded four times (1,000 tokens: 13.3 -> 9.5 ms) */
                    PIN4(kv);
                    for (int64_t a = 0; a < RB; a++) {
                        const float qd = qbuf[(r0 + a) * D + d];
                        for (int64_t j = 0; j < KT / 16; j++) sc[a][j] += qd * kv[j];
                    }
                }
                float pr[RB][KT] __attribute__((aligned(64)));
                int64_t upto = 0;
                for (int64_t a = 0; a < RB; a++) {
                    const int64_t r = r0 + a, rr = r < rows ? r : rows - 1;
                    float *sr = pr[a];
                    for (int64_t j = 0; j < KT / 16; j++) *(v16 *)(sr + 16 * j) = sc[a][j];
                    const int64_t visible = first + rr / group + 1 - t0; /* keys t < visible are seen */
                    const int64_t seen = visible < tn ? visible : tn;
                    upto = seen > upto ? seen : upto;
                    float mt = m[r];
                    for (int64_t t = 0; t < KT; t++) {
                        sr[t] = t < seen ? sr[t] : MASKED;
                        mt = sr[t] > mt ? sr[t] : mt;
                    }
                    const float alpha = expf(m[r] - mt);
                    float sum = 0.f;
                    for (int64_t t = 0; t < KT; t++) { sr[t] = expf(sr[t] - mt); sum += sr[t]; }
                    l[r] = l[r] * alpha + sum;
                    m[r] = mt;
                    for (int64_t d = 0; d < D; d++) acc[r * D + d] *= alpha;
                }
                for (int64_t c = 0; c < dv; c += 4) { /* four vectors of D at a time: 16 accumulators */
                    const int64_t cn = 4;
                    v16 o[RB][4];
                    for (int64_t a = 0; a < RB; a++)
                        for (int64_t j = 0; j < cn; j++) o[a][j] = *(const v16 *)(acc + (r0 + a) * D + 16 * (c + j));
                    for (int64_t t = 0; t < upto; t++) {
                        const v16 *vp = (const v16 *)(v + (t0 + t) * kv_stride + hk * D) + c;
                        v16 vr[4];
                        for (int64_t j = 0; j < 4; j++) vr[j] = vp[j];
                        PIN4(vr);
                        for (int64_t a = 0; a < RB; a++) {
                            const float p = pr[a][t];
                            for (int64_t j = 0; j < cn; j++) o[a][j] += p * vr[j];
                        }
                    }
                    for (int64_t a = 0; a < RB; a++)
                        for (int64_t j = 0; j < cn; j++) *(v16 *)(acc + (r0 + a) * D + 16 * (c + j)) = o[a][j];
                }
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            float *dst = out + (i0 + r / group) * out_stride + (hk * group + r % group) * D;
            const float inv = 1.f / l[r];
            for (int64_t d = 0; d < D; d++) dst[d] = acc[r * D + d] * inv;
        }
    }
}

/* scratch: floats for 2 * (QT * G + RB) * D (queries, accumulators) + 2 * (QT * G + RB) (max,
 * sum) + D * (ctx rounded up to KT, + 16) (one head's K, transposed). */
void tandem_prefill_attention_f32(const float *q, int64_t q_stride, const float *k, const float *v,
                                  int64_t kv_stride, float *out, int64_t out_stride, int64_t n, int64_t ctx,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                                  float *scratch) {
    const int64_t group = num_heads / num_kv_heads, rows = QT * group + RB;
    float *qbuf = scratch, *acc = qbuf + rows * head_dim, *m = acc + rows * head_dim, *l = m + rows;
    float *kt = l + rows;
    for (int64_t hk = 0; hk < num_kv_heads; hk++) {
        if (head_dim == 64)
            prefill_head(q, q_stride, k, v, kv_stride, out, out_stride, n, ctx, hk, group, 64, scale, qbuf, acc, m,
                         l, kt);
        else
            prefill_head(q, q_stride, k, v, kv_stride, out, out_stride, n, ctx, hk, group, head_dim, scale, qbuf,
                         acc, m, l, kt);
    }
}
