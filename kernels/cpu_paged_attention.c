/* Paged decode attention on the CPU, fp32 arithmetic: one query token per sequence over its cached
 * K/V (float32, or bfloat16 in a bf16 engine), read in place from the blocks (no gather into a
 * contiguous copy first).
 *
 * Layout as kernels/reference.py: caches [num_blocks, block_size, Hkv, D] contiguous, so one
 * token's K (or V) row for every kv head is Hkv * D elements in a row, and a block's tokens
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
#include <string.h>

/* A cache element as fp32: caches are float32, or bfloat16 (a CPU engine in bf16), whose bits
 * are fp32's upper half. `bf16` is a constant in each caller, so each variant compiles alone. */
static inline __attribute__((always_inline)) float kv_at(const void *p, int64_t i, const int bf16) {
    if (bf16) {
        union { uint32_t u; float f; } c = {.u = (uint32_t)((const uint16_t *)p)[i] << 16};
        return c.f;
    }
    return ((const float *)p)[i];
}

static inline void prefetch_bytes(const void *p, int64_t bytes, int locality) {
    for (int64_t off = 0; off < bytes; off += 64) {
        if (locality == 3) __builtin_prefetch((const char *)p + off, 0, 3);
        else __builtin_prefetch((const char *)p + off, 0, 1);
    }
}

/* Where context position t of a sequence sits in the cache: its slot (block * block_size + offset). */
static inline int64_t slot_at(const int32_t *table, int64_t t, int64_t block_size) {
    return (int64_t)table[t / block_size] * block_size + t % block_size;
}

/* Blocks are scattered, so the hardware prefetcher loses the stream at every block boundary
 * (16 chats, random block order: 3x slower than the same blocks in order). Each token's row
 * asks for the row one block ahead (its first `bytes`, from `cache`), which is then in flight
 * while this block is read (the default model's 30 layers, 16 chats of 225 tokens over
 * scattered blocks: 28 -> 13 ms). */
static inline void prefetch_ahead(const char *cache, const int32_t *table, int64_t t, int64_t len,
                                  int64_t block_size, int64_t row_bytes, int64_t bytes) {
    const int64_t ahead = t + block_size;
    if (ahead < len) prefetch_bytes(cache + slot_at(table, ahead, block_size) * row_bytes, bytes, 3);
}

/* Each of `rows` rows of `len` scores into its softmax, in place (max-subtracted). */
static inline void softmax_rows(float *scores, int64_t rows, int64_t len) {
    for (int64_t h = 0; h < rows; h++) {
        float *sh = scores + h * len, m = sh[0], sum = 0.f;
        for (int64_t t = 1; t < len; t++) m = sh[t] > m ? sh[t] : m;
        for (int64_t t = 0; t < len; t++) {
            sh[t] = expf(sh[t] - m);
            sum += sh[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; t++) sh[t] *= inv;
    }
}

/* Decode attention for head_dim 64 (the default model's, and Llama's): per sequence and kv head,
 * each K row is read once for the G query heads that share it, their dot products reduced 16
 * tokens at a time (`sum16`), then each V row once into G outputs held in registers. The loop
 * above instead reads a row once per query head, with a horizontal sum per (token, head): on
 * the 2-core EPYC, 9 heads over 3 kv heads, 300 tokens, K/V in cache: 23.5 -> 12.6 us for one
 * sequence, 106 -> 50 us for five. K/V read from memory (256 MB through the caches before each
 * call, as a step's weights go) take the loop and this the same time, ~56 and ~151 us in bf16:
 * the blocks' latency bounds it then, and prefetching every block at once did not help. */
typedef float f16v __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint32_t u16v __attribute__((vector_size(64)));

/* 16 cache elements from element i of a row, as fp32 */
static inline __attribute__((always_inline)) f16v row16(const char *p, int64_t i, const int bf16) {
    if (bf16) return (f16v)(__builtin_convertvector(*(const h16v *)((const uint16_t *)p + i), u16v) << 16);
    return *(const f16v *)((const float *)p + i);
}

/* x[j]'s lanes summed into lane bitrev4(j) of the result: four rounds of pairing halves, 15 adds
 * where one horizontal sum per vector takes ~8 instructions */
static inline __attribute__((always_inline)) f16v sum16(const f16v *x) {
    const i16v l1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, h1 = l1 + 8;
    const i16v l2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}, h2 = l2 + 4;
    const i16v l3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}, h3 = l3 + 2;
    const i16v l4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}, h4 = l4 + 1;
    f16v y[8], z[4], w[2];
    for (int k = 0; k < 8; k++) y[k] = __builtin_shuffle(x[2 * k], x[2 * k + 1], l1) + __builtin_shuffle(x[2 * k], x[2 * k + 1], h1);
    for (int k = 0; k < 4; k++) z[k] = __builtin_shuffle(y[2 * k], y[2 * k + 1], l2) + __builtin_shuffle(y[2 * k], y[2 * k + 1], h2);
    for (int k = 0; k < 2; k++) w[k] = __builtin_shuffle(z[2 * k], z[2 * k + 1], l3) + __builtin_shuffle(z[2 * k], z[2 * k + 1], h3);
    return __builtin_shuffle(w[0], w[1], l4) + __builtin_shuffle(w[0], w[1], h4);
}

#define MAX_GROUP 8
static const int BITREV4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

/* One sequence: for each kv head, its K rows read once for the G query heads that share them
 * (partial dot products reduced 16 tokens at a time), then its V rows once, into G outputs held
 * in registers. scores: [G * Hkv][len]. */
static inline __attribute__((always_inline)) void decode_seq_d64(
        const float *qb, float *ob, const char *kc, const char *vc, const int32_t *table, int64_t len,
        int64_t num_kv_heads, int64_t block_size, float scale, float *scores, const int64_t G, const int bf16) {
    const int64_t D = 64, esz = bf16 ? 2 : 4, row_bytes = num_kv_heads * D * esz, slice = D * esz;
    for (int64_t g = 0; g < num_kv_heads; g++) {
        f16v qv[MAX_GROUP][4], part[MAX_GROUP][16];
        for (int64_t h = 0; h < G; h++)
            for (int j = 0; j < 4; j++) qv[h][j] = *(const f16v *)(qb + ((g * G + h) * D + 16 * j)) * scale;
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
            const int64_t n = len - t0 < 16 ? len - t0 : 16;
            for (int64_t i = 0; i < 16; i++) {
                const int s = BITREV4[i];
                if (i >= n) {
                    for (int64_t h = 0; h < G; h++) part[h][s] = (f16v){};
                    continue;
                }
                const int64_t t = t0 + i;
                const char *k = kc + slot_at(table, t, block_size) * row_bytes + g * slice;
                prefetch_ahead(kc + g * slice, table, t, len, block_size, row_bytes, slice);
                const f16v k0 = row16(k, 0, bf16), k1 = row16(k, 16, bf16), k2 = row16(k, 32, bf16), k3 = row16(k, 48, bf16);
                for (int64_t h = 0; h < G; h++)
                    part[h][s] = qv[h][0] * k0 + qv[h][1] * k1 + qv[h][2] * k2 + qv[h][3] * k3;
            }
            for (int64_t h = 0; h < G; h++) {
                const f16v r = sum16(part[h]);
                float *dst = scores + (g * G + h) * len + t0;
                if (n == 16) *(f16v *)dst = r;
                else for (int64_t i = 0; i < n; i++) dst[i] = r[i];
            }
        }
    }
    softmax_rows(scores, G * num_kv_heads, len);
    for (int64_t g = 0; g < num_kv_heads; g++) {
        f16v o[MAX_GROUP][4];
        for (int64_t h = 0; h < G; h++)
            for (int j = 0; j < 4; j++) o[h][j] = (f16v){};
        for (int64_t t = 0; t < len; t++) {
            const char *v = vc + slot_at(table, t, block_size) * row_bytes + g * slice;
            prefetch_ahead(vc + g * slice, table, t, len, block_size, row_bytes, slice);
            const f16v v0 = row16(v, 0, bf16), v1 = row16(v, 16, bf16), v2 = row16(v, 32, bf16), v3 = row16(v, 48, bf16);
            for (int64_t h = 0; h < G; h++) {
                const float p = scores[(g * G + h) * len + t];
                o[h][0] += p * v0;
                o[h][1] += p * v1;
                o[h][2] += p * v2;
                o[h][3] += p * v3;
            }
        }
        for (int64_t h = 0; h < G; h++)
            for (int j = 0; j < 4; j++) *(f16v *)(ob + (g * G + h) * D + 16 * j) = o[h][j];
    }
}

static inline __attribute__((always_inline)) void decode_seq_d64_any(
        const float *qb, float *ob, const char *kc, const char *vc, const int32_t *table, int64_t len,
        int64_t num_kv_heads, int64_t block_size, float scale, float *scores, int64_t G, const int bf16) {
    switch (G) { /* the group as a constant: the loops over it unroll, its vectors stay in registers */
    case 1: decode_seq_d64(qb, ob, kc, vc, table, len, num_kv_heads, block_size, scale, scores, 1, bf16); break;
    case 2: decode_seq_d64(qb, ob, kc, vc, table, len, num_kv_heads, block_size, scale, scores, 2, bf16); break;
    case 3: decode_seq_d64(qb, ob, kc, vc, table, len, num_kv_heads, block_size, scale, scores, 3, bf16); break;
    case 4: decode_seq_d64(qb, ob, kc, vc, table, len, num_kv_heads, block_size, scale, scores, 4, bf16); break;
    default: decode_seq_d64(qb, ob, kc, vc, table, len, num_kv_heads, block_size, scale, scores, G, bf16); break;
    }
}

static inline __attribute__((always_inline)) int64_t paged_decode(
        const float *q, float *out, const void *k_cache, const void *v_cache, const int32_t *block_tables,
        int64_t table_width, const int32_t *context_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
        int64_t head_dim, int64_t block_size, float scale, float *scores, const int bf16) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* elements per token in a cache */
    const int64_t row_bytes = row * (bf16 ? 2 : 4);
    const char *kc = (const char *)k_cache, *vc = (const char *)v_cache;
    int64_t bad = 0;
    for (int64_t b = 0; b < batch; b++) {
        const float *qb = q + b * num_heads * head_dim;
        float *ob = out + b * num_heads * head_dim;
        const int32_t *table = block_tables + b * table_width;
        const int64_t len = context_lens[b];
        if (len < 1 || len > table_width * block_size) {
            bad++;
            continue;
        }
        if (head_dim == 64 && group <= MAX_GROUP) {
            decode_seq_d64_any(qb, ob, kc, vc, table, len, num_kv_heads, block_size, scale, scores, group, bf16);
            continue;
        }

        for (int64_t t = 0; t < len; t++) {
            const int64_t at = slot_at(table, t, block_size) * row_bytes;
            const void *k = kc + at;
            prefetch_ahead(kc, table, t, len, block_size, row_bytes, row_bytes);
            prefetch_bytes(vc + at, row_bytes, 1); /* for the V pass: 16 chats, 13.1 -> 12.1 ms */
            for (int64_t h = 0; h < num_heads; h++) {
                const int64_t kh = (h / group) * head_dim;
                const float *qh = qb + h * head_dim;
                float s = 0.f;
                for (int64_t d = 0; d < head_dim; d++) s += qh[d] * kv_at(k, kh + d, bf16);
                scores[h * len + t] = s * scale;
            }
        }
        softmax_rows(scores, num_heads, len);
        for (int64_t i = 0; i < num_heads * head_dim; i++) ob[i] = 0.f;
        for (int64_t t = 0; t < len; t++) {
            const void *v = vc + slot_at(table, t, block_size) * row_bytes;
            prefetch_ahead(vc, table, t, len, block_size, row_bytes, row_bytes);
            for (int64_t h = 0; h < num_heads; h++) {
                const int64_t vh = (h / group) * head_dim;
                const float p = scores[h * len + t];
                float *oh = ob + h * head_dim;
                for (int64_t d = 0; d < head_dim; d++) oh[d] += p * kv_at(v, vh + d, bf16);
            }
        }
    }
    return bad;
}

/* Returns how many sequences have a context length outside [1, table_width * block_size]: those
 * are skipped (their output rows are not written). scores: num_heads * table_width * block_size. */
int64_t tandem_paged_decode_f32(const float *q, float *out, const float *k_cache, const float *v_cache,
                                const int32_t *block_tables, int64_t table_width, const int32_t *context_lens,
                                int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, float scale, float *scores) {
    return paged_decode(q, out, k_cache, v_cache, block_tables, table_width, context_lens, batch, num_heads,
                        num_kv_heads, head_dim, block_size, scale, scores, 0);
}

/* The same over bfloat16 caches (uint16 bits), fp32 queries, output and arithmetic: the KV
 * bytes a step reads are halved, which is what bounds decode attention over long contexts. */
int64_t tandem_paged_decode_bf16kv(const float *q, float *out, const uint16_t *k_cache, const uint16_t *v_cache,
                                   const int32_t *block_tables, int64_t table_width, const int32_t *context_lens,
                                   int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, float scale, float *scores) {
    return paged_decode(q, out, k_cache, v_cache, block_tables, table_width, context_lens, batch, num_heads,
                        num_kv_heads, head_dim, block_size, scale, scores, 1);
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

/* Query row r's scores for one key tile (sr[KT]; keys t < seen are visible) become probabilities
 * against its running max m[r], its running sum l[r] is updated and its accumulator acc[D]
 * rescaled: the online softmax step both prefill kernels take. */
static inline __attribute__((always_inline)) void online_softmax_row(float *sr, int64_t seen, float *m, float *l,
                                                                     float *acc, int64_t D) {
    float mt = *m;
    for (int64_t t = 0; t < KT; t++) {
        sr[t] = t < seen ? sr[t] : MASKED;
        mt = sr[t] > mt ? sr[t] : mt;
    }
    const float alpha = expf(*m - mt);
    float sum = 0.f;
    for (int64_t t = 0; t < KT; t++) { sr[t] = expf(sr[t] - mt); sum += sr[t]; }
    *l = *l * alpha + sum;
    *m = mt;
    for (int64_t d = 0; d < D; d++) acc[d] *= alpha;
}

/* A query tile's `rows` accumulators (query i0 + r / group, head hk * group + r % group) divided
 * by their sums into out. */
static inline __attribute__((always_inline)) void finish_rows(float *out, int64_t out_stride, int64_t i0, int64_t rows,
                                                              int64_t group, int64_t hk, int64_t D, const float *acc,
                                                              const float *l) {
    for (int64_t r = 0; r < rows; r++) {
        float *dst = out + (i0 + r / group) * out_stride + (hk * group + r % group) * D;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; d++) dst[d] = acc[r * D + d] * inv;
    }
}

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
                    online_softmax_row(sr, seen, m + r, l + r, acc + r * D, D);
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
        finish_rows(out, out_stride, i0, rows, group, hk, D, acc, l);
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

/* The same causal attention with its two products in bf16 (AVX512-BF16's `vdpbf16ps`: pairs of
 * bf16 products summed into fp32 lanes, twice the multiplies of an fp32 FMA per instruction), for
 * a CPU engine in bf16 whose K/V are bf16 already: queries rounded to bf16 (scaled first), the
 * softmax in fp32 and its probabilities rounded to bf16 for P.V, accumulators fp32 (as GPU
 * flash attention in bf16). D = 64. K is laid out [D/2][t] in pairs of dims, V [t/2][D] in pairs
 * of tokens, so each vector holds 16 lanes of pairs. Returns -1 (nothing done) where the compiler
 * targets no AVX512-BF16; scratch as for the fp32 kernel (the K and V copies take its K's room). */
#if defined(__AVX512BF16__)
#include <immintrin.h>

/* 32 fp32 -> 16 pairs of bf16 (element 2i low, 2i + 1 high), rounded to nearest even */
static inline __m512i pairs32(const float *x) {
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
}

static void prefill_head_bf16(const float *q, int64_t q_stride, const float *k, const float *v, int64_t kv_stride,
                              float *out, int64_t out_stride, int64_t n, int64_t ctx, int64_t hk, int64_t group,
                              float scale, uint32_t *qbuf, float *acc, float *m, float *l, uint32_t *kt,
                              uint32_t *vt) {
    enum { D = 64, DP = 32 };
    const int64_t width = (ctx + KT - 1) / KT * KT + 16; /* as the fp32 kernel: see there */
    uint32_t pair[DP] __attribute__((aligned(64)));
    for (int64_t t = 0; t < width; t++) { /* kt[dp][t]: dims 2dp, 2dp + 1 of key t */
        if (t < ctx) {
            const float *kr = k + t * kv_stride + hk * D;
            _mm512_store_si512(pair, pairs32(kr));
            _mm512_store_si512(pair + 16, pairs32(kr + 32));
        } else {
            memset(pair, 0, sizeof pair);
        }
        for (int64_t dp = 0; dp < DP; dp++) kt[dp * width + t] = pair[dp];
    }
    for (int64_t tp = 0; tp < width / 2; tp++) { /* vt[tp][d]: dim d of keys 2tp, 2tp + 1 */
        for (int64_t c = 0; c < D; c += 16) {
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            if (2 * tp < ctx)
                lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(v + 2 * tp * kv_stride + hk * D + c)));
            if (2 * tp + 1 < ctx)
                hi = _mm512_cvtepu16_epi32(
                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(v + (2 * tp + 1) * kv_stride + hk * D + c)));
            _mm512_storeu_si512(vt + tp * D + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
    for (int64_t i0 = 0; i0 < n; i0 += QT) {
        const int64_t qn = n - i0 < QT ? n - i0 : QT, rows = qn * group;
        const int64_t padded = (rows + RB - 1) / RB * RB; /* pad rows repeat the last one */
        for (int64_t r = 0; r < padded; r++) {
            const int64_t rr = r < rows ? r : rows - 1;
            const float *src = q + (i0 + rr / group) * q_stride + (hk * group + rr % group) * D;
            float scaled[D] __attribute__((aligned(64)));
            for (int64_t d = 0; d < D; d++) { scaled[d] = src[d] * scale; acc[r * D + d] = 0.f; }
            _mm512_storeu_si512(qbuf + r * DP, pairs32(scaled));
            _mm512_storeu_si512(qbuf + r * DP + 16, pairs32(scaled + 32));
            m[r] = MASKED;
            l[r] = 0.f;
        }
        const int64_t first = ctx - n + i0, keys = first + qn; /* positions first.. ; keys [0, keys) */
        for (int64_t t0 = 0; t0 < keys; t0 += KT) {
            const int64_t tn = keys - t0 < KT ? keys - t0 : KT;
            for (int64_t r0 = 0; r0 < padded; r0 += RB) {
                __m512 sc[RB][KT / 16];
                for (int64_t a = 0; a < RB; a++)
                    for (int64_t j = 0; j < KT / 16; j++) sc[a][j] = _mm512_setzero_ps();
                for (int64_t dp = 0; dp < DP; dp++) {
                    __m512bh kv[KT / 16];
                    for (int64_t j = 0; j < KT / 16; j++) kv[j] = (__m512bh)_mm512_loadu_si512(kt + dp * width + t0 + 16 * j);
                    PIN4(kv);
                    for (int64_t a = 0; a < RB; a++) {
                        const __m512bh qd = (__m512bh)_mm512_set1_epi32((int)qbuf[(r0 + a) * DP + dp]);
                        for (int64_t j = 0; j < KT / 16; j++) sc[a][j] = _mm512_dpbf16_ps(sc[a][j], kv[j], qd);
                    }
                }
                float pr[RB][KT] __attribute__((aligned(64)));
                uint32_t pp[RB][KT / 2] __attribute__((aligned(64)));
                int64_t upto = 0;
                for (int64_t a = 0; a < RB; a++) {
                    const int64_t r = r0 + a, rr = r < rows ? r : rows - 1;
                    float *sr = pr[a];
                    for (int64_t j = 0; j < KT / 16; j++) _mm512_store_ps(sr + 16 * j, sc[a][j]);
                    const int64_t visible = first + rr / group + 1 - t0; /* keys t < visible are seen */
                    const int64_t seen = visible < tn ? visible : tn;
                    upto = seen > upto ? seen : upto;
                    online_softmax_row(sr, seen, m + r, l + r, acc + r * D, D);
                    _mm512_store_si512(pp[a], pairs32(sr));
                    _mm512_store_si512(pp[a] + 16, pairs32(sr + 32));
                }
                __m512 o[RB][D / 16];
                for (int64_t a = 0; a < RB; a++)
                    for (int64_t j = 0; j < D / 16; j++) o[a][j] = _mm512_loadu_ps(acc + (r0 + a) * D + 16 * j);
                for (int64_t tp = 0; tp < (upto + 1) / 2; tp++) { /* past `upto` every p is 0 */
                    __m512bh vr[D / 16];
                    for (int64_t j = 0; j < D / 16; j++) vr[j] = (__m512bh)_mm512_loadu_si512(vt + (t0 / 2 + tp) * D + 16 * j);
                    PIN4(vr);
                    for (int64_t a = 0; a < RB; a++) {
                        const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pp[a][tp]);
                        for (int64_t j = 0; j < D / 16; j++) o[a][j] = _mm512_dpbf16_ps(o[a][j], vr[j], p);
                    }
                }
                for (int64_t a = 0; a < RB; a++)
                    for (int64_t j = 0; j < D / 16; j++) _mm512_storeu_ps(acc + (r0 + a) * D + 16 * j, o[a][j]);
            }
        }
        finish_rows(out, out_stride, i0, rows, group, hk, D, acc, l);
    }
}
#endif

int64_t tandem_prefill_attention_bf16(const float *q, int64_t q_stride, const float *k, const float *v,
                                      int64_t kv_stride, float *out, int64_t out_stride, int64_t n, int64_t ctx,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                                      float *scratch) {
#if defined(__AVX512BF16__)
    if (head_dim != 64) return -1;
    const int64_t group = num_heads / num_kv_heads, rows = QT * group + RB;
    const int64_t width = (ctx + KT - 1) / KT * KT + 16;
    uint32_t *qbuf = (uint32_t *)scratch;
    float *acc = scratch + rows * head_dim, *m = acc + rows * head_dim, *l = m + rows;
    uint32_t *kt = (uint32_t *)(l + rows), *vt = kt + width * head_dim / 2;
    for (int64_t hk = 0; hk < num_kv_heads; hk++)
        prefill_head_bf16(q, q_stride, k, v, kv_stride, out, out_stride, n, ctx, hk, group, scale, qbuf, acc, m, l,
                          kt, vt);
    return 0;
#else
    (void)q; (void)q_stride; (void)k; (void)v; (void)kv_stride; (void)out; (void)out_stride; (void)n; (void)ctx;
    (void)num_heads; (void)num_kv_heads; (void)head_dim; (void)scale; (void)scratch;
    return -1;
#endif
}
