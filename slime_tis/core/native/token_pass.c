/*
 * Fused CPU token passes of the correction core (loaded by slime_tis/core/native/__init__.py).
 *
 * Plain C with GCC/Clang vector extensions (AVX intrinsics where available), single-threaded, no
 * Python or torch headers: built on first use with the system C compiler and called through ctypes
 * on contiguous CPU tensors. The torch implementation in slime_tis/core/ratios.py is the reference;
 * tests/test_core_native.py checks that both agree.
 *
 * Layout: sequence s owns tokens [cu[s], cu[s+1]) of a packed batch of n_tokens tokens. Offsets are
 * clamped to [previous offset, n_tokens], so a malformed cu never reads outside the inputs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define N_COLUMNS 8 /* log_ratio, lp_rollout, valid, nonfinite, veto, e, e^2, e - lc: ratios.ROW_* */
#define LANES 8
#define FLUSH 64 /* vector steps between float -> double flushes (512 tokens) */
#define MAX_EXTRA 8

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint8_t vb __attribute__((vector_size(LANES)));

static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }
static inline vi finite_v(vf x) { return ((vi)x & 0x7f800000) != 0x7f800000; } /* false for NaN, +-inf */
#if defined(__AVX__)
#include <immintrin.h>
/* One instruction each (the generic forms below take two or three); operands are never NaN here. */
static inline vf select_v(vi mask, vf a, vf b) { return (vf)_mm256_blendv_ps((__m256)b, (__m256)a, (__m256)mask); }
static inline vf min_v(vf a, vf b) { return (vf)_mm256_min_ps((__m256)a, (__m256)b); }
static inline vf max_v(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
static inline int all_zero(vi mask) { return _mm256_testz_si256((__m256i)mask, (__m256i)mask); }
#else
static inline vf select_v(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline vf min_v(vf a, vf b) { return select_v(a < b, a, b); }
static inline vf max_v(vf a, vf b) { return select_v(a > b, a, b); }
static inline int all_zero(vi mask) {
    int32_t any = 0;
    for (int j = 0; j < LANES; ++j) any |= mask[j];
    return any == 0;
}
#endif

/* expm1(r) for |r| <= ln2 / 2 by its Taylor series to r^7 (truncation < 2e-8 relative):
 * r + r^2 (1/2 + r/6 + r^2/24 + r^3/120 + r^4/720 + r^5/5040), Estrin's scheme. */
static inline vf expm1_reduced(vf r) {
    const vf r2 = r * r;
    const vf r4 = r2 * r2;
    const vf q01 = splat(1.0f / 6.0f) * r + splat(0.5f);
    const vf q23 = splat(1.0f / 120.0f) * r + splat(1.0f / 24.0f);
    const vf q45 = splat(1.0f / 5040.0f) * r + splat(1.0f / 720.0f);
    return (q01 + r2 * q23 + r4 * q45) * r2 + r;
}

/* expm1(x) in float32 for |x| <= 88 (larger x gives +inf, smaller gives -1).
 * x = k ln2 + r with k = round(x / ln2), |r| <= ln2 / 2; expm1(x) = 2^k expm1(r) + (2^k - 1), which
 * is exactly expm1(r) for k = 0 (1 * p + 0), so there is no cancellation near 0. When every lane has
 * |x| < 0.34 (k = 0, r = x: the usual case, train/rollout log-ratios are small) the reduction is
 * skipped; the result is bit-identical. */
static inline vf expm1_v(vf x) {
    if (all_zero((x > splat(0.34f)) | (x < splat(-0.34f)))) return expm1_reduced(x);
    const vf big = splat(12582912.0f); /* 1.5 * 2^23: (y + big) - big rounds y to the nearest integer */
    const vf k = (x * splat(1.44269504f) + big) - big;
    const vf r = (x - k * splat(0.693145752f)) - k * splat(1.42860677e-6f);
    const vf p = expm1_reduced(r);
    const vi kc = __builtin_convertvector(max_v(min_v(k, splat(127.0f)), splat(-127.0f)), vi);
    const vf two = (vf)((kc + 127) << 23); /* 2^k, and 0 for k = -127 (x < -88: expm1 = -1) */
    return select_v(x > splat(88.7f), splat(INFINITY), two * p + (two - splat(1.0f)));
}

typedef struct {
    int64_t n_tokens;
    const int64_t *cu;
    const float *lp_train, *lp_rollout;
    const uint8_t *valid;
    int64_t n_extra;
    const float *extras[MAX_EXTRA];
    int32_t has_veto, has_moments;
    float log_veto, bound;
    double *out;
} SumsArgs;

static inline int64_t clamp_offset(int64_t offset, int64_t lo, int64_t hi) {
    return offset < lo ? lo : (offset > hi ? hi : offset);
}

/* Per-lane partial sums of one block: float columns and integer counts. */
typedef struct {
    vf log_ratio, lp_rollout, e, e2, k3;
    vi valid, nonfinite, veto; /* minus the counts: a true comparison is -1 */
} Block;

static inline vf where_v(vi mask, vf x) { return (vf)(mask & (vi)x); } /* x where mask, else +0 */

/* One vector step: accumulate LANES tokens (already in registers) into the block sums. */
static inline void accumulate(const SumsArgs *a, vf lt, vf lr, vi valid, vi extra_finite, Block *acc) {
    const vf l = lt - lr;
    const vi finite = finite_v(l);
    const vf lf = where_v(valid & finite, l);
    acc->log_ratio += lf;
    acc->lp_rollout += where_v(valid & finite_v(lr), lr);
    acc->valid += valid;
    acc->nonfinite += valid & ~(finite & extra_finite);
    if (a->has_veto) acc->veto += valid & (lf < splat(a->log_veto));
    if (a->has_moments) {
        const vf lc = max_v(min_v(lf, splat(a->bound)), splat(-a->bound));
        const vf e = expm1_v(lc);
        acc->e += e;
        acc->e2 += e * e;
        acc->k3 += e - lc;
    }
}

typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));
typedef double vd4 __attribute__((vector_size(4 * sizeof(double))));
typedef int32_t vi4 __attribute__((vector_size(4 * sizeof(int32_t))));

static inline double lane_sum_f(vf x) { /* the LANES floats summed in double */
    vf4 lo, hi;
    memcpy(&lo, &x, sizeof lo);
    memcpy(&hi, (const char *)&x + sizeof lo, sizeof hi);
    const vd4 sum = __builtin_convertvector(lo, vd4) + __builtin_convertvector(hi, vd4);
    return (sum[0] + sum[1]) + (sum[2] + sum[3]);
}

static inline double lane_count(vi x) { /* minus the sum of the LANES int32 (comparison results are -1) */
    vi4 lo, hi;
    memcpy(&lo, &x, sizeof lo);
    memcpy(&hi, (const char *)&x + sizeof lo, sizeof hi);
    const vi4 sum = lo + hi;
    return -(double)((sum[0] + sum[1]) + (sum[2] + sum[3]));
}

/* The LANES tokens from t: whole-vector loads wherever LANES tokens remain in the batch (lanes at or
 * past `end` belong to the next sequence and are masked out of `valid`), element copies only for the
 * batch's last tokens. Masked lanes contribute nothing: every column is selected by `valid`. */
static inline void load_step(const SumsArgs *a, int64_t t, int64_t end, vf *lt, vf *lr, vi *valid,
                             vi *extra_finite) {
    static const vi lane_index = {0, 1, 2, 3, 4, 5, 6, 7};
    vb v8;
    *extra_finite = (vi){-1, -1, -1, -1, -1, -1, -1, -1};
    if (t + LANES <= a->n_tokens) {
        memcpy(lt, a->lp_train + t, sizeof *lt);
        memcpy(lr, a->lp_rollout + t, sizeof *lr);
        memcpy(&v8, a->valid + t, LANES);
        for (int64_t j = 0; j < a->n_extra; ++j) {
            vf x;
            memcpy(&x, a->extras[j] + t, sizeof x);
            *extra_finite &= finite_v(x);
        }
    } else {
        const int64_t n = end - t; /* < LANES: end <= n_tokens */
        float b1[LANES] = {0}, b2[LANES] = {0};
        uint8_t b3[LANES] = {0};
        memcpy(b1, a->lp_train + t, (size_t)n * sizeof(float));
        memcpy(b2, a->lp_rollout + t, (size_t)n * sizeof(float));
        memcpy(b3, a->valid + t, (size_t)n);
        memcpy(lt, b1, sizeof *lt);
        memcpy(lr, b2, sizeof *lr);
        memcpy(&v8, b3, LANES);
        for (int64_t j = 0; j < a->n_extra; ++j) {
            float bx[LANES] = {0};
            vf x;
            memcpy(bx, a->extras[j] + t, (size_t)n * sizeof(float));
            memcpy(&x, bx, sizeof x);
            *extra_finite &= finite_v(x);
        }
    }
    *valid = __builtin_convertvector(v8, vi) != 0;
    if (end - t < LANES) *valid &= lane_index < (int32_t)(end - t);
}

static void sums_all(const SumsArgs *a, int64_t n_seq) {
    int64_t start = clamp_offset(a->cu[0], 0, a->n_tokens);
    for (int64_t s = 0; s < n_seq; ++s) {
        const int64_t end = clamp_offset(a->cu[s + 1], start, a->n_tokens);
        double total[N_COLUMNS] = {0};
        int64_t t = start;
        while (t < end) {
            Block acc;
            memset(&acc, 0, sizeof acc);
            for (int step = 0; step < FLUSH && t < end; ++step, t += LANES) {
                vf lt, lr;
                vi valid, extra_finite;
                load_step(a, t, end, &lt, &lr, &valid, &extra_finite);
                accumulate(a, lt, lr, valid, extra_finite, &acc);
            }
            total[0] += lane_sum_f(acc.log_ratio);
            total[1] += lane_sum_f(acc.lp_rollout);
            total[2] += lane_count(acc.valid);
            total[3] += lane_count(acc.nonfinite);
            total[4] += lane_count(acc.veto);
            total[5] += lane_sum_f(acc.e);
            total[6] += lane_sum_f(acc.e2);
            total[7] += lane_sum_f(acc.k3);
        }
        memcpy(a->out + s * N_COLUMNS, total, sizeof total);
        start = end;
    }
}

/* Per-sequence sums over valid tokens into out[n_seq][N_COLUMNS] (double), per token with
 * l = lp_train - lp_rollout (float32) and v = valid:
 *   col 0  l           where v and l is finite, else 0 (call it l')
 *   col 1  lp_rollout  where v and lp_rollout is finite, else 0
 *   col 2  v
 *   col 3  v and (l or an extra) not finite
 *   col 4  l' < log_veto                                              (0 unless has_veto)
 *   col 5-7  e = expm1(lc), e^2, e - lc with lc = clamp(l', -bound, bound)  (0 unless bound > 0)
 * Sums are float32 within blocks of 512 tokens from the sequence's start, float64 across blocks.
 * Returns 0, or -1 if n_extra > MAX_EXTRA. */
int slime_tis_sequence_sums(int64_t n_seq, int64_t n_tokens, const int64_t *cu, const float *lp_train,
                            const float *lp_rollout, const uint8_t *valid, int64_t n_extra,
                            const float *const *extras, int32_t has_veto, float log_veto, float bound,
                            double *out) {
    if (n_extra > MAX_EXTRA) return -1;
    SumsArgs a = {n_tokens, cu, lp_train, lp_rollout, valid, n_extra, {0}, has_veto, bound > 0.0f,
                  log_veto, bound, out};
    for (int64_t j = 0; j < n_extra; ++j) a.extras[j] = extras[j];
    if (n_seq > 0) sums_all(&a, n_seq);
    return 0;
}

/* Per-sequence values broadcast to their valid tokens (t in sequence s; other tokens get 0):
 *   out_value[t] = valid[t] ? value[s] : 0,  out_keep[t] = valid[t] && keep[s]. */
void slime_tis_expand(int64_t n_seq, int64_t n_tokens, const int64_t *cu, const uint8_t *valid, const float *value,
                      const uint8_t *keep, float *out_value, uint8_t *out_keep) {
    int64_t start = n_seq > 0 ? clamp_offset(cu[0], 0, n_tokens) : n_tokens;
    memset(out_value, 0, (size_t)start * sizeof(float));
    memset(out_keep, 0, (size_t)start);
    for (int64_t s = 0; s < n_seq; ++s) {
        const int64_t end = clamp_offset(cu[s + 1], start, n_tokens);
        const float m = value[s];
        const uint8_t k = keep[s] != 0;
        for (int64_t t = start; t < end; ++t) {
            const uint8_t v = valid[t] != 0;
            out_value[t] = v ? m : 0.0f;
            out_keep[t] = v & k;
        }
        start = end;
    }
    memset(out_value + start, 0, (size_t)(n_tokens - start) * sizeof(float));
    memset(out_keep + start, 0, (size_t)(n_tokens - start));
}
