/* The element-wise steps of a decoder layer on the CPU, one thread: the residual add with the RMS
 * norm after it, rotary embeddings in place, the scatter of new K/V rows into the paged cache,
 * and the MLP's silu(gate) * up. Each is one call where torch takes several ops; at one decode
 * token a torch op costs 1-2 us of dispatch whatever its size, and a layer of the default model
 * made ~50 of them (kernels/cpu_layer_ops.py has the figures). Arithmetic is fp32; the residual
 * stream is fp32, and the tensors that only feed a bf16 projection or come out of one may be
 * bf16 (uint16 bits). Built with cpu_paged_attention.c into one library.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* fp32 -> bf16 bits, rounded to nearest even as torch's `.to(torch.bfloat16)`; NaN -> 0x7fc0. */
static inline uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t b) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)b << 16};
    return c.f;
}

/* Per row t of H: x += delta (when delta is not NULL; float32, or bfloat16 bits when delta_bf16),
 * then out = x * rsqrt(mean(x^2) + eps) * w, as HF's LlamaRMSNorm in fp32, written as float32
 * or (out_bf16) rounded to bfloat16 as `.to(torch.bfloat16)` would. x and out may not overlap.
 * The flags are constants in each caller below. */
static inline __attribute__((always_inline)) void add_rms_norm(float *x, const void *delta, const float *w,
                                                               void *out, int64_t rows, int64_t H, float eps,
                                                               const int delta_bf16, const int out_bf16) {
    for (int64_t t = 0; t < rows; t++) {
        float *xr = x + t * H;
        if (delta && delta_bf16) {
            const uint16_t *dr = (const uint16_t *)delta + t * H;
            for (int64_t i = 0; i < H; i++) xr[i] += from_bf16(dr[i]);
        } else if (delta) {
            const float *dr = (const float *)delta + t * H;
            for (int64_t i = 0; i < H; i++) xr[i] += dr[i];
        }
        float ss = 0.f;
        for (int64_t i = 0; i < H; i++) ss += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + t * H;
            for (int64_t i = 0; i < H; i++) o[i] = to_bf16(xr[i] * inv * w[i]);
        } else {
            float *o = (float *)out + t * H;
            for (int64_t i = 0; i < H; i++) o[i] = xr[i] * inv * w[i];
        }
    }
}

void tandem_add_rms_norm(float *x, const void *delta, const float *w, void *out, int64_t rows, int64_t H, float eps,
                         int64_t delta_bf16, int64_t out_bf16) {
    if (delta_bf16 && out_bf16) add_rms_norm(x, delta, w, out, rows, H, eps, 1, 1);
    else if (delta_bf16) add_rms_norm(x, delta, w, out, rows, H, eps, 1, 0);
    else if (out_bf16) add_rms_norm(x, delta, w, out, rows, H, eps, 0, 1);
    else add_rms_norm(x, delta, w, out, rows, H, eps, 0, 0);
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i] over bfloat16 bits, computed in fp32 as torch's
 * `F.silu(gate.float()) * up.float()` and rounded to bf16: the fused gate/up projection's output
 * (rows `stride` elements apart) into the down projection's input [rows, I]. */
void tandem_silu_mul_bf16(const uint16_t *gu, int64_t stride, uint16_t *out, int64_t rows, int64_t I) {
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *g = gu + t * stride, *u = g + I;
        uint16_t *o = out + t * I;
        for (int64_t i = 0; i < I; i++) {
            const float a = from_bf16(g[i]);
            o[i] = to_bf16(a / (1.f + expf(-a)) * from_bf16(u[i]));
        }
    }
}

/* Rotate-half rotary embedding in place: `heads` heads of D floats per token, tokens `stride`
 * floats apart; cos/sin [T, D/2] for each token's position. */
void tandem_rope_f32(float *x, int64_t T, int64_t heads, int64_t stride, int64_t D, const float *cos,
                     const float *sin) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + t * stride + h * D, *b = a + half;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* One row of `row` floats into a cache row: copied (float32) or rounded (bfloat16 bits). */
static inline __attribute__((always_inline)) void put_row(void *dst, const float *src, int64_t row, const int bf16) {
    if (!bf16) {
        memcpy(dst, src, (size_t)row * sizeof(float));
        return;
    }
    uint16_t *d = dst;
    for (int64_t i = 0; i < row; i++) d[i] = to_bf16(src[i]);
}

/* Token t's K and V rows (`row` floats each, `*_stride` floats apart) into cache slot slots[t]
 * (slot * row elements into each cache); a slot < 0 is skipped. Returns the number of slots at
 * or past num_slots, which are not written. `bf16` is a constant in each caller. */
static inline __attribute__((always_inline)) int64_t store_kv(const float *k, int64_t k_stride, const float *v,
                                                              int64_t v_stride, char *k_cache, char *v_cache,
                                                              const int64_t *slots, int64_t T, int64_t row,
                                                              int64_t num_slots, const int bf16) {
    const int64_t row_bytes = row * (bf16 ? 2 : 4);
    int64_t bad = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        if (slot >= num_slots) {
            bad++;
            continue;
        }
        put_row(k_cache + slot * row_bytes, k + t * k_stride, row, bf16);
        put_row(v_cache + slot * row_bytes, v + t * v_stride, row, bf16);
    }
    return bad;
}

int64_t tandem_store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *k_cache,
                            float *v_cache, const int64_t *slots, int64_t T, int64_t row, int64_t num_slots) {
    return store_kv(k, k_stride, v, v_stride, (char *)k_cache, (char *)v_cache, slots, T, row, num_slots, 0);
}

/* The same into bfloat16 caches (uint16 bits). */
int64_t tandem_store_kv_bf16kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                               uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots, int64_t T, int64_t row,
                               int64_t num_slots) {
    return store_kv(k, k_stride, v, v_stride, (char *)k_cache, (char *)v_cache, slots, T, row, num_slots, 1);
}

/* cpu_paged_attention.c, built into the same library */
int64_t tandem_paged_decode_f32(const float *q, float *out, const float *k_cache, const float *v_cache,
                                const int32_t *block_tables, int64_t table_width, const int32_t *context_lens,
                                int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                int64_t block_size, float scale, float *scores);
int64_t tandem_paged_decode_bf16kv(const float *q, float *out, const uint16_t *k_cache, const uint16_t *v_cache,
                                   const int32_t *block_tables, int64_t table_width, const int32_t *context_lens,
                                   int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, float scale, float *scores);

/* The attention half of a decode-only step, from the qkv projection's output to the o
 * projection's input, in one call: B rows of qkv [(Hq + 2 Hkv) * D] (bf16 bits when qkv_bf16,
 * else float32; `qkv_stride` elements apart) are split into fp32 q, k, v (work), q and k rotated
 * (cos/sin [B, D/2]), k and v scattered into cache slots[b] (float32 caches, or bf16 when
 * kv_bf16), then each row's q attends over its sequence's cached context (the paged decode
 * kernel) into out [B, Hq * D] (bf16 bits when out_bf16, else float32).
 * work: floats for B * (Hq + 2 Hkv) * D + B * Hq * D + Hq * width * block_size.
 * Returns 0; -1 when a slot is at or past num_slots (nothing attended); else the decode kernel's
 * count of context lengths outside [1, width * block_size]. */
int64_t tandem_decode_attention(const void *qkv, int64_t qkv_stride, int64_t qkv_bf16, const float *cos,
                                const float *sin, void *k_cache, void *v_cache, int64_t kv_bf16, int64_t num_slots,
                                const int64_t *slots, const int32_t *tables, int64_t width, const int32_t *lens,
                                int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size, float scale,
                                float *work, void *out, int64_t out_bf16) {
    const int64_t nq = Hq * D, nk = Hkv * D, row = nq + 2 * nk;
    float *q = work, *k = q + B * nq, *v = k + B * nk, *attn = v + B * nk, *scores = attn + B * nq;
    for (int64_t b = 0; b < B; b++) {
        float *dst[3] = {q + b * nq, k + b * nk, v + b * nk};
        const int64_t len[3] = {nq, nk, nk}, off[3] = {0, nq, nq + nk};
        for (int p = 0; p < 3; p++) {
            if (qkv_bf16) {
                const uint16_t *src = (const uint16_t *)qkv + b * qkv_stride + off[p];
                for (int64_t i = 0; i < len[p]; i++) dst[p][i] = from_bf16(src[i]);
            } else {
                memcpy(dst[p], (const float *)qkv + b * qkv_stride + off[p], (size_t)len[p] * sizeof(float));
            }
        }
    }
    tandem_rope_f32(q, B, Hq, nq, D, cos, sin);
    tandem_rope_f32(k, B, Hkv, nk, D, cos, sin);
    if (store_kv(k, nk, v, nk, k_cache, v_cache, slots, B, nk, num_slots, kv_bf16 != 0)) return -1;
    float *o = out_bf16 ? attn : (float *)out;
    const int64_t bad = kv_bf16 ? tandem_paged_decode_bf16kv(q, o, k_cache, v_cache, tables, width, lens, B, Hq, Hkv, D,
                                                             block_size, scale, scores)
                                : tandem_paged_decode_f32(q, o, k_cache, v_cache, tables, width, lens, B, Hq, Hkv, D,
                                                          block_size, scale, scores);
    if (out_bf16)
        for (int64_t i = 0; i < B * nq; i++) ((uint16_t *)out)[i] = to_bf16(attn[i]);
    return bad;
}
