/* The index of each row's largest logit (greedy sampling), as torch.argmax gives it: the first index of
 * the maximum, or of the first NaN where a row has one. PyTorch's CPU argmax carries an index through
 * a scalar loop (Gemma 3's 262,144 logits: ~350 us a row on this kind of CPU, 64 rows of SmolLM2's
 * 49,152: ~2-4 ms a step), where the maximum alone is a vector reduction at memory speed. So: one
 * vector pass for the maximum (and whether any lane is NaN), then a scan for its first index, which
 * stops at the first match. Rows are shared over the threads; a single row over them, in parts. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

/* The largest value of v[0, n), or NaN if v has one. */
static float max_or_nan(const float *v, int64_t n) {
    __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
        best = _mm256_max_ps(best, x);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    float lanes[8], out = -INFINITY;
    _mm256_storeu_ps(lanes, best);
    for (int l = 0; l < 8; l++) out = lanes[l] > out ? lanes[l] : out;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (; i < n; i++) {
        any_nan |= isnan(v[i]);
        out = v[i] > out ? v[i] : out;
    }
    return any_nan ? NAN : out;
}

/* The first i in [0, n) with v[i] == target (target NaN: the first NaN); n if none. */
static int64_t first_index(const float *v, int64_t n, float target) {
    const int want_nan = isnan(target);
    const __m256 t = _mm256_set1_ps(target);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
        const int hits = _mm256_movemask_ps(want_nan ? _mm256_cmp_ps(x, x, _CMP_UNORD_Q) : _mm256_cmp_ps(x, t, _CMP_EQ_OQ));
        if (hits) return i + __builtin_ctz((unsigned)hits);
    }
    for (; i < n; i++)
        if (want_nan ? isnan(v[i]) : v[i] == target) return i;
    return n;
}

static int64_t row_argmax(const float *v, int64_t n) { return first_index(v, n, max_or_nan(v, n)); }

/* One row over every thread: each takes a part's maximum, then the first part holding the overall one
 * finds its index. */
static int64_t split_row_argmax(const float *v, int64_t n) {
    float part_max[256];
    int64_t parts = 1;
#pragma omp parallel
    {
#pragma omp single
        parts = omp_get_num_threads() < 256 ? omp_get_num_threads() : 256;
        const int64_t p = omp_get_thread_num(), per = (n + parts - 1) / parts;
        if (p < parts) {
            const int64_t from = p * per < n ? p * per : n, to = from + per < n ? from + per : n;
            part_max[p] = to > from ? max_or_nan(v + from, to - from) : -INFINITY;
        }
    }
    const int64_t per = (n + parts - 1) / parts;
    float best = -INFINITY;
    int64_t first = 0;
    for (int64_t p = 0; p < parts; p++) {
        if (isnan(part_max[p])) return p * per + first_index(v + p * per, n - p * per, NAN);
        if (part_max[p] > best || p == 0) best = part_max[p], first = p;
    }
    return first * per + first_index(v + first * per, n - first * per, best);
}

void greedy_argmax(const float *logits, int64_t *out, int64_t rows, int64_t n) {
    if (rows == 1) {
        out[0] = split_row_argmax(logits, n);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(logits + r * n, n);
}
