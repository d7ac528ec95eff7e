/* Fast CPU path of qtransform fake quantization (loaded by fastpath.py through ctypes).
 *
 * One pass per block: amax, scale, then every element with exactly the fp32 operations of the
 * torch reference path (qtransform/formats/{mx,nvfp4,intgroup,elements}.py), so the results are
 * bit-identical. Must be compiled without -ffast-math and with -ffp-contract=off: a fused
 * multiply-add or a reassociation would change roundings. Plain C, no torch headers.
 */
#include <float.h>
#include <stdint.h>
#include <string.h>

enum { FAM_MX = 0, FAM_NVFP4 = 1, FAM_INT = 2 };
enum { NV_DEFAULT = 0, NV_CT = 1, NV_ONE_LEVEL = 2 };
enum { RULE_FLOOR = 0, RULE_RCEIL = 1, RULE_CEIL = 2, RULE_EVEN = 3 };

typedef struct {
    int32_t family, variant, scale_rule, rna; /* rna: 0 = ties to even, 1 = ties away */
    int32_t is_int, mbits, emin, emax;        /* element: integer grid?, float fields */
    float max_normal, step, inv_step, qmax;   /* int grids: step and 1/step (powers of two) */
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
static inline float round_mag(float a, grid_t g) {
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
     * only onto the next integer, so truncation gives ties-away */
    float r = g.rna ? (float)(int32_t)(t + 0.5f) : (t + 8388608.0f) - 8388608.0f;
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
                             int64_t n, float mul, float post, grid_t g) {
    for (int64_t i = 0; i < n; i++) {
        float y = x[i] * mul;
        o[i] = copysign_bits(round_mag(fabs_bits(y), g), y) * post;
    }
    if (sat)
        for (int64_t i = 0; i < n; i++) sat[i] = fabs_bits(x[i] * mul) > g.max_normal;
}

/* y = x / div (non power-of-two scales divide, as the reference does) */
static inline void apply_div(const float *restrict x, float *restrict o, uint8_t *restrict sat,
                             int64_t n, float div, float post, grid_t g) {
    for (int64_t i = 0; i < n; i++) {
        float y = x[i] / div;
        o[i] = copysign_bits(round_mag(fabs_bits(y), g), y) * post;
    }
    if (sat)
        for (int64_t i = 0; i < n; i++) sat[i] = fabs_bits(x[i] / div) > g.max_normal;
}

/* compressed-tensors order: y = x / scale, clamp to +-6, an exact zero loses its sign, and any
 * NaN that the fp32 formula produces (0/0, 0*inf) comes out as the canonical NaN */
static inline void apply_ct(const float *restrict x, float *restrict o, uint8_t *restrict sat,
                            int64_t n, float scale, grid_t g) {
    for (int64_t i = 0; i < n; i++) {
        float y = x[i] / scale;
        float q = y != y ? 0.0f : round_mag(fabs_bits(y), g);
        float v = (y < 0.0f ? -q : q) * scale;
        o[i] = (y != y || v != v) ? u2f(QNAN) : v;
    }
    if (sat)
        for (int64_t i = 0; i < n; i++) sat[i] = fabs_bits(x[i] / scale) > 6.0f;
}

static inline float e4m3_rne(float v) {
    const grid_t e4m3 = {0, 0, 3, -6, 448.0f, 1.0f, 1.0f};
    return round_mag(v, e4m3);
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
        uint32_t b = f2u(amax) + (1u << (22 - p->mbits));
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
        float g = 2688.0f / amax_t;
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
enum { PLAN_MUL = 0, PLAN_DIV = 1, PLAN_CT = 2, PLAN_NAN = 3 };
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
        if (ts->nan) return nan_plan;
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

static inline void apply_plan(const float *x, float *o, uint8_t *sat, int64_t n, plan_t pl,
                              grid_t g) {
    if (pl.kind == PLAN_MUL && n == 32) apply_mul(x, o, sat, 32, pl.a, pl.post, g);
    else if (pl.kind == PLAN_MUL && n == 16) apply_mul(x, o, sat, 16, pl.a, pl.post, g);
    else if (pl.kind == PLAN_MUL) apply_mul(x, o, sat, n, pl.a, pl.post, g);
    else if (pl.kind == PLAN_DIV) apply_div(x, o, sat, n, pl.a, pl.post, g);
    else if (pl.kind == PLAN_CT) apply_ct(x, o, sat, n, pl.a, g);
    else fill_nan(o, sat, n);
}

/* Tiles j0..j1 of one tile row (nr rows); IS_INT and RNA are compile-time constants in each
 * instantiation so the element loops carry no branches. Blocks go in chunks: all amaxes, then
 * all plans (independent iterations, so the per-block divisions overlap), then the elements
 * (the chunk is still in cache). */
#define CHUNK 32
#define DEFINE_RUN(NAME, IS_INT, RNA)                                                          \
    static void NAME(const float *x, float *o, uint8_t *sat, int64_t cols, int64_t nr,         \
                     int64_t tile_c, int64_t j0, int64_t j1, const qf_params *p,               \
                     const tensor_scale *ts) {                                                 \
        grid_t g = grid_of(p);                                                                 \
        g.is_int = IS_INT;                                                                     \
        g.rna = RNA;                                                                           \
        uint32_t am[CHUNK];                                                                    \
        plan_t pl[CHUNK];                                                                      \
        for (int64_t jc = j0; jc < j1; jc += CHUNK) {                                          \
            int64_t nj = j1 - jc < CHUNK ? j1 - jc : CHUNK;                                    \
            for (int64_t k = 0; k < nj; k++) {                                                 \
                int64_t c0 = (jc + k) * tile_c, n = cols - c0 < tile_c ? cols - c0 : tile_c;   \
                uint32_t m = 0;                                                                \
                for (int64_t r = 0; r < nr; r++) {                                             \
                    uint32_t v = amax_bits_of(x + r * cols + c0, n);                           \
                    m = v > m ? v : m;                                                         \
                }                                                                              \
                am[k] = m;                                                                     \
            }                                                                                  \
            for (int64_t k = 0; k < nj; k++) pl[k] = plan_block(am[k], p, ts);                 \
            for (int64_t k = 0; k < nj; k++) {                                                 \
                int64_t c0 = (jc + k) * tile_c, n = cols - c0 < tile_c ? cols - c0 : tile_c;   \
                for (int64_t r = 0; r < nr; r++) {                                             \
                    int64_t off = r * cols + c0;                                               \
                    uint8_t *s = sat ? sat + off : 0;                                          \
                    apply_plan(x + off, o + off, s, n, pl[k], g);                              \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }
DEFINE_RUN(run_float_rne, 0, 0)
DEFINE_RUN(run_float_rna, 0, 1)
DEFINE_RUN(run_int_rne, 1, 0)
DEFINE_RUN(run_int_rna, 1, 1)

/* x, out (and sat, optional): `batch` contiguous row-major matrices of rows x cols; blocks are
 * tiles of tile_r x tile_c (1D blocks: tile_r = 1), zero-padded at the ragged edges. */
int qf_quantize(const float *x, float *out, uint8_t *sat, int64_t batch, int64_t rows,
                int64_t cols, int64_t tile_r, int64_t tile_c, const qf_params *p, int nthreads) {
    int64_t ntr = (rows + tile_r - 1) / tile_r, ntc = (cols + tile_c - 1) / tile_c;
    int64_t total = batch * rows * cols;
    if (total == 0) return 0;
    tensor_scale ts = {1.0f, 1.0f, 0.0f, 0};
    if (p->family == FAM_NVFP4 && p->variant != NV_ONE_LEVEL) {
        uint32_t m = 0;
#pragma omp parallel for num_threads(nthreads) reduction(max : m) schedule(static)
        for (int64_t c = 0; c < (total + 65535) / 65536; c++) {
            int64_t lo = c * 65536, hi = lo + 65536 < total ? lo + 65536 : total;
            uint32_t v = amax_bits_of(x + lo, hi - lo);
            m = v > m ? v : m;
        }
        ts = nv_tensor(u2f(m), p);
    }
    /* a task is a run of up to `span` tiles in one tile row: few tasks per thread is enough
     * for balance, and no per-block index arithmetic */
    int64_t rowsets = batch * ntr, want = 8 * (int64_t)nthreads;
    int64_t splits = rowsets >= want ? 1 : (want + rowsets - 1) / rowsets;
    int64_t span = (ntc + splits - 1) / splits;
    splits = (ntc + span - 1) / span;
    void (*run)(const float *, float *, uint8_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                const qf_params *, const tensor_scale *) =
        p->is_int ? (p->rna ? run_int_rna : run_int_rne) : (p->rna ? run_float_rna : run_float_rne);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < rowsets * splits; t++) {
        int64_t rs = t / splits, j0 = (t % splits) * span;
        int64_t j1 = j0 + span < ntc ? j0 + span : ntc;
        int64_t b = rs / ntr, r0 = (rs % ntr) * tile_r;
        int64_t nr = rows - r0 < tile_r ? rows - r0 : tile_r;
        int64_t off = b * rows * cols + r0 * cols;
        run(x + off, out + off, sat ? sat + off : 0, cols, nr, tile_c, j0, j1, p, &ts);
    }
    return 0;
}
