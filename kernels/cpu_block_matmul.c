/* y = x @ W^T in float32, with W held as blocks of 32 weights along its input dimension, the
 * way GGUF's Q4_1 and Q8_0 store them (kernels/block_weights.py):
 *   4-bit: q in [0, 15], two to a byte (byte j of a block: q[j] | q[j + 16] << 4), w = d * q + m
 *   8-bit: q in [-127, 127], one to a byte, w = d * q
 * with d and m float32, one of each per block. d * q is exact in float32 (d comes from an fp16,
 * q has at most 8 bits), so each weight is dequantized to exactly the float32 value the
 * checkpoint's conversion produced; the product then runs in float32 FMAs, like any fp32 GEMM
 * with its own summation order.
 *
 * Three weight rows are dequantized at a time into a buffer that stays in L1, then multiplied
 * against x several rows at a time. With AVX2: four rows, twelve accumulators, the three weight
 * vectors and one of x fill its sixteen registers, so a step of the loop is 7 loads for 12 FMAs.
 * With AVX-512: eight rows, 24 accumulators of 16 floats in its 32 registers, 11 loads for 24
 * FMAs of twice the width. Weights are read once per call whatever the number of rows: a decode
 * step reads 0.75 bytes a weight (4-bit) instead of 4. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)

static inline void deq4_row(const uint8_t *qs, const float *d, const float *m, int64_t K, float *w) {
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < K / 32; b++) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(qs + b * 16));
        __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        __m512 vd = _mm512_set1_ps(d[b]), vm = _mm512_set1_ps(m[b]);
        _mm512_storeu_ps(w + b * 32, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vd, vm));
        _mm512_storeu_ps(w + b * 32 + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vd, vm));
    }
}

static inline void deq8_row(const int8_t *qs, const float *d, int64_t K, float *w) {
    for (int64_t b = 0; b < K / 32; b++) {
        __m512 vd = _mm512_set1_ps(d[b]);
        for (int j = 0; j < 2; j++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(qs + b * 32 + 16 * j));
            _mm512_storeu_ps(w + b * 32 + 16 * j, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), vd));
        }
    }
}

/* the vectors the shared tiles below are written in: 16 floats, 32 registers (KEEP: any of them) */
#define SIMD_BLOCKS 1
typedef __m512 vec;
#define LANES 16
#define TILE_ROWS 8
#define vload _mm512_loadu_ps
#define vzero _mm512_setzero_ps
#define vfma _mm512_fmadd_ps
#define vadd _mm512_add_ps
#define vsum _mm512_reduce_add_ps
#define KEEP(v) __asm__("" : "+v"(v))

#elif defined(__AVX2__) && defined(__FMA__)

static inline void deq4_row(const uint8_t *qs, const float *d, const float *m, int64_t K, float *w) {
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < K / 32; b++) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(qs + b * 16));
        __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        __m256 vd = _mm256_set1_ps(d[b]), vm = _mm256_set1_ps(m[b]);
        float *o = w + b * 32;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vd, vm));
        _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vd, vm));
        _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vd, vm));
        _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vd, vm));
    }
}

static inline void deq8_row(const int8_t *qs, const float *d, int64_t K, float *w) {
    for (int64_t b = 0; b < K / 32; b++) {
        __m256 vd = _mm256_set1_ps(d[b]);
        for (int j = 0; j < 4; j++) {
            __m128i v = _mm_loadl_epi64((const __m128i *)(qs + b * 32 + 8 * j));
            _mm256_storeu_ps(w + b * 32 + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), vd));
        }
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 8 floats, 16 registers */
#define SIMD_BLOCKS 1
typedef __m256 vec;
#define LANES 8
#define TILE_ROWS 4
#define vload _mm256_loadu_ps
#define vzero _mm256_setzero_ps
#define vfma _mm256_fmadd_ps
#define vadd _mm256_add_ps
#define vsum hsum
#define KEEP(v) __asm__("" : "+x"(v))

#endif

#ifdef SIMD_BLOCKS

/* KEEP(v): v stays in a register. Without it GCC folds a load into every FMA that reads the
 * vector, and the loop waits on loads (10 for 8 FMAs) instead of FMAs: 16 rows of the default
 * model's projections took ~20% longer that way on the AVX2 EPYC. */

/* y[i * ldy + j] = x[i] . w[j] for i < R, j < W (x rows and w rows K floats apart; K a multiple
 * of 32). W <= 3, R <= TILE_ROWS; inlined with constant W and R, so acc lives in registers. */
static inline __attribute__((always_inline)) void tile(const int W, const int R, const float *x, int64_t K,
                                                       const float *w, float *y, int64_t ldy) {
    vec acc[TILE_ROWS][3];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < W; j++) acc[i][j] = vzero();
    for (int64_t k = 0; k < K; k += LANES) {
        vec w0 = vload(w + k), w1 = w0, w2 = w0;
        KEEP(w0);
        if (W > 1) { w1 = vload(w + K + k); KEEP(w1); }
        if (W > 2) { w2 = vload(w + 2 * K + k); KEEP(w2); }
        for (int i = 0; i < R; i++) {
            vec t = vload(x + i * K + k);
            KEEP(t);
            acc[i][0] = vfma(w0, t, acc[i][0]);
            if (W > 1) acc[i][1] = vfma(w1, t, acc[i][1]);
            if (W > 2) acc[i][2] = vfma(w2, t, acc[i][2]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < W; j++) y[i * ldy + j] = vsum(acc[i][j]);
}

/* tile's one row of x (a decode step of one stream): two accumulators a weight row, over
 * alternate halves of each 2 x LANES floats, so the FMAs' latency is not the bound */
static inline __attribute__((always_inline)) void tile1(const int W, const float *x, int64_t K, const float *w,
                                                        float *y) {
    vec acc[2][3];
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < W; j++) acc[h][j] = vzero();
    for (int64_t k = 0; k < K; k += 2 * LANES)
        for (int h = 0; h < 2; h++) {
            vec t = vload(x + k + LANES * h);
            KEEP(t);
            for (int j = 0; j < W; j++) acc[h][j] = vfma(vload(w + j * K + k + LANES * h), t, acc[h][j]);
        }
    for (int j = 0; j < W; j++) y[j] = vsum(vadd(acc[0][j], acc[1][j]));
}

/* y[r, j] = x[r] . w_j for every row r of x [M, K] and the W weight rows w_j = w + j * K: TILE_ROWS
 * rows at a time, then the rest in one tile (cases past TILE_ROWS - 1 are never reached) */
#define TILE_REST(W, R) case R: if (R < TILE_ROWS) tile(W, R < TILE_ROWS ? R : 1, x + r * K, K, w, y + r * ldy, ldy); break;
#define ROWS_OF(W)                                                                                      \
    static void rows##W(const float *x, int64_t M, int64_t K, const float *w, float *y, int64_t ldy) {  \
        int64_t r = 0;                                                                                  \
        for (; r + TILE_ROWS <= M; r += TILE_ROWS) tile(W, TILE_ROWS, x + r * K, K, w, y + r * ldy, ldy); \
        switch (M - r) {                                                                                \
        TILE_REST(W, 7) TILE_REST(W, 6) TILE_REST(W, 5) TILE_REST(W, 4) TILE_REST(W, 3) TILE_REST(W, 2) \
        case 1: tile1(W, x + r * K, K, w, y + r * ldy); break;                                          \
        }                                                                                               \
    }
ROWS_OF(1)
ROWS_OF(2)
ROWS_OF(3)

static void dot_rows(const float *x, int64_t M, int64_t K, const float *w, int W, float *y, int64_t ldy) {
    if (W == 3) rows3(x, M, K, w, y, ldy);
    else if (W == 2) rows2(x, M, K, w, y, ldy);
    else rows1(x, M, K, w, y, ldy);
}

#else  /* portable: the same arithmetic, left to the compiler */

static inline void deq4_row(const uint8_t *qs, const float *d, const float *m, int64_t K, float *w) {
    for (int64_t b = 0; b < K / 32; b++)
        for (int j = 0; j < 16; j++) {
            uint8_t v = qs[b * 16 + j];
            w[b * 32 + j] = d[b] * (float)(v & 15) + m[b];
            w[b * 32 + j + 16] = d[b] * (float)(v >> 4) + m[b];
        }
}

static inline void deq8_row(const int8_t *qs, const float *d, int64_t K, float *w) {
    for (int64_t k = 0; k < K; k++) w[k] = d[k / 32] * (float)qs[k];
}

static void dot_rows(const float *x, int64_t M, int64_t K, const float *w, int W, float *y, int64_t ldy) {
    for (int64_t r = 0; r < M; r++)
        for (int j = 0; j < W; j++) {
            float a = 0.f;
            for (int64_t k = 0; k < K; k++) a += x[r * K + k] * w[j * K + k];
            y[r * ldy + j] = a;
        }
}

#endif

/* weight row n of a block matrix (4-bit: qs [N, K / 2], d and m [N, K / 32]; 8-bit: qs [N, K],
 * d [N, K / 32], m unused) → w [K] float32 */
static inline void deq_row(int64_t bits, const void *qs, const float *d, const float *m, int64_t n, int64_t K,
                           float *w) {
    int64_t blocks = K / 32;
    if (bits == 4)
        deq4_row((const uint8_t *)qs + n * (K / 2), d + n * blocks, m + n * blocks, K, w);
    else
        deq8_row((const int8_t *)qs + n * K, d + n * blocks, K, w);
}

/* y = x @ W^T: x [M, K] float32 contiguous, y [M, N] float32 contiguous; K a multiple of 32 */
void tandem_block_matmul(int64_t bits, const float *x, int64_t M, int64_t K, const void *qs, const float *d,
                         const float *m, int64_t N, float *y) {
    float w[3 * K] __attribute__((aligned(64)));
    for (int64_t n = 0; n < N; n += 3) {
        int W = N - n < 3 ? (int)(N - n) : 3;
        for (int j = 0; j < W; j++) deq_row(bits, qs, d, m, n + j, K, w + j * K);
        dot_rows(x, M, K, w, W, y + n, N);
    }
}

/* the float32 weights [N, K] themselves (a check against the checkpoint's) */
void tandem_block_dequant(int64_t bits, const void *qs, const float *d, const float *m, int64_t N, int64_t K,
                          float *w) {
    for (int64_t n = 0; n < N; n++) deq_row(bits, qs, d, m, n, K, w + n * K);
}

/* f rounded to the nearest fp16 value, ties to even, as a float; *ok = 0 past fp16's range
 * (no NaN or inf tests: the library is built with -ffast-math) */
static inline float to_half(float f, int *ok) {
#ifdef __F16C__
    float r = _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
    float r = f;
    if (f != 0.f) {
        int e;
        frexpf(fabsf(f), &e);  /* |f| in [2^(e-1), 2^e) */
        float step = ldexpf(1.f, e < -13 ? -24 : e - 11);  /* 11 significant bits; subnormals 2^-24 apart */
        r = nearbyintf(f / step) * step;
    }
#endif
    if (!(fabsf(f) <= 65504.f) || !(fabsf(r) <= 65504.f)) *ok = 0;
    return r;
}

/* W float32 [N, K] → its blocks (the layout above) when every weight is exactly d * q + m
 * (4 bits) or d * q (8 bits) with d and m fp16 values; returns 1, else 0 at the first block
 * that is not (so most weights that are not blocks are refused after one block). */
int64_t tandem_block_find(int64_t bits, const float *w, int64_t N, int64_t K, void *qs, float *d, float *m) {
    int64_t blocks = K / 32;
    const float qmin = bits == 4 ? 0.f : -127.f, qmax = bits == 4 ? 15.f : 127.f;
    for (int64_t i = 0; i < N * blocks; i++) {
        const float *x = w + i * 32;
        float lo = x[0], hi = x[0], big = 0.f;
        uint32_t special = 0;  /* an inf or NaN: its exponent bits all set */
        for (int j = 0; j < 32; j++) {
            uint32_t u;
            memcpy(&u, x + j, 4);
            special |= (u & 0x7f800000u) == 0x7f800000u;
            lo = x[j] < lo ? x[j] : lo;
            hi = x[j] > hi ? x[j] : hi;
            big = fabsf(x[j]) > big ? fabsf(x[j]) : big;
        }
        if (special) return 0;
        int ok = 1;
        float scale = to_half(bits == 4 ? (hi - lo) / 15.f : big / 127.f, &ok), min = bits == 4 ? lo : 0.f;
        if (!ok || (bits == 4 && (to_half(min, &ok) != min || !ok))) return 0;
        float inv = scale == 0.f ? 0.f : 1.f / scale;
        float q[32];
        int bad = 0;
        for (int j = 0; j < 32; j++) {  /* no early exit: vectorized */
            float t = rintf((x[j] - min) * inv);
            bad |= (t < qmin) | (t > qmax) | (scale * t + min != x[j]);
            q[j] = t;
        }
        if (bad) return 0;
        d[i] = scale;
        if (bits == 4) {
            m[i] = min;
            for (int j = 0; j < 16; j++) ((uint8_t *)qs)[i * 16 + j] = (uint8_t)((int)q[j] | (int)q[j + 16] << 4);
        } else {
            for (int j = 0; j < 32; j++) ((int8_t *)qs)[i * 32 + j] = (int8_t)(int)q[j];
        }
    }
    return 1;
}
