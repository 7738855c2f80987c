/* One decode token of Gated DeltaNet (Qwen3.5's linear attention) for a batch of sequences, on their states where
 * they live in the pool: each (sequence, value head) state S [k_dim, v_dim] float32 is read from memory once and
 * written back once, in place (layers/gated_delta.py's gated_delta_step is the same arithmetic in PyTorch, which
 * has to gather the states out of the pool and scatter them back: three more passes over them).
 *
 *   reads:  kS = S^T k, qS = S^T q                         (one pass over S)
 *   delta = beta (v - exp(g) kS)
 *   out   = exp(g) qS + (q.k) delta                        (= S'^T q, without reading S' back)
 *   S'    = exp(g) S + k delta^T                           (a second pass, over S while it sits in L2)
 *
 * q and k come l2-normalized, q scaled, one head per value head. (Sequence, head) pairs are shared over the
 * threads.
 *
 * gated_delta_decode is the whole mixer of a decode row between its two projections, in one call: the causal conv
 * stepped on its state in the pool, q and k normalized, the gates, the step above and the gated RMSNorm (the
 * model's PyTorch path, models/qwen3_5/model.py, is the reference). */
#include <math.h>
#include <stdint.h>

#define MAX_V_DIM 1024
#define L2NORM_EPS 1e-6f    /* layers/gated_delta.py's: fixed, not the config's */
#define SOFTPLUS_LINEAR 20.0f /* torch's softplus threshold: above it, x itself */
#define CONV_CHANNELS 256   /* channels one thread convolves at a time */

static void head_step(const float *q, const float *k, const float *v, float g, float beta, float *S, float *out,
                      int64_t dk, int64_t dv) {
    float kS[MAX_V_DIM], qS[MAX_V_DIM], delta[MAX_V_DIM];
    for (int64_t j = 0; j < dv; j++) kS[j] = qS[j] = 0.0f;
    float qk = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        const float ki = k[i], qi = q[i], *row = S + i * dv;
        qk += qi * ki;
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) {
            kS[j] += ki * row[j];
            qS[j] += qi * row[j];
        }
    }
    const float decay = expf(g);
#pragma omp simd
    for (int64_t j = 0; j < dv; j++) {
        delta[j] = beta * (v[j] - decay * kS[j]);
        out[j] = decay * qS[j] + qk * delta[j];
    }
    for (int64_t i = 0; i < dk; i++) {
        const float ki = k[i];
        float *row = S + i * dv;
#pragma omp simd
        for (int64_t j = 0; j < dv; j++) row[j] = decay * row[j] + ki * delta[j];
    }
}

/* q, k [batch, heads, dk]; v, out [batch, heads, dv]; g, beta [batch, heads]; state [slots, heads, dk, dv];
 * slots[b]: row b's state (distinct rows, distinct slots); dv <= MAX_V_DIM. */
void gated_delta_step(const float *q, const float *k, const float *v, const float *g, const float *beta, float *state,
                      const int64_t *slots, float *out, int64_t batch, int64_t heads, int64_t dk, int64_t dv) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t row = b * heads + h;
            head_step(q + row * dk, k + row * dk, v + row * dv, g[row], beta[row],
                      state + (slots[b] * heads + h) * dk * dv, out + row * dv, dk, dv);
        }
}

/* One row's conv over channels [c0, c1): y = silu(w · [state, x] + bias), the state shifted left by x. */
static void conv_channels(const float *x, const float *w, const float *bias, float *state, float *y, int64_t c0,
                          int64_t c1, int64_t kernel) {
    const int64_t held = kernel - 1;
    for (int64_t c = c0; c < c1; c++) {
        float *s = state + c * held;
        const float *wc = w + c * kernel;
        float acc = bias ? bias[c] : 0.0f;
        for (int64_t j = 0; j < held; j++) acc += wc[j] * s[j];
        acc += wc[held] * x[c];
        for (int64_t j = 0; j + 1 < held; j++) s[j] = s[j + 1];
        if (held > 0) s[held - 1] = x[c];
        y[c] = acc / (1.0f + expf(-acc));
    }
}

/* x / sqrt(|x|^2 + eps), times `scale`, in place. */
static void l2_normalize(float *x, int64_t n, float scale) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float factor = scale / sqrtf(sum + L2NORM_EPS);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] *= factor;
}

/* weight * rmsnorm(o) * silu(z) over one head's dv channels. */
static void gated_norm(const float *o, const float *z, const float *weight, float eps, float *out, int64_t dv) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < dv; j++) sum += o[j] * o[j];
    const float inv = 1.0f / sqrtf(sum / (float)dv + eps);
    for (int64_t j = 0; j < dv; j++) out[j] = weight[j] * (o[j] * inv) * (z[j] / (1.0f + expf(-z[j])));
}

static float softplus(float x) { return x > SOFTPLUS_LINEAR ? x : log1pf(expf(x)); }

/* proj [batch, proj_stride]: each decode row's input projection, qkv [C] | z [Hv dv] | b [Hv] | a [Hv], with
 * C = 2 Hk dk + Hv dv; conv_w [C, kernel], conv_b [C] or NULL; A_log, dt_bias [Hv]; norm_w [dv];
 * conv_pool [slots, C, kernel - 1] and ssm_pool [slots, Hv, dk, dv], row b's states at slots[b] (distinct), both
 * updated in place; mixed [batch, C] scratch; out [batch, Hv dv]. Key head i serves value heads i r ... i r + r - 1
 * (r = Hv / Hk), or i, i + Hk, i + 2 Hk, ... where `tiled` (layers/gated_delta.py's expand_heads). */
void gated_delta_decode(const float *proj, int64_t proj_stride, const float *conv_w, const float *conv_b,
                        const float *A_log, const float *dt_bias, const float *norm_w, float eps, float *conv_pool,
                        float *ssm_pool, const int64_t *slots, float *mixed, float *out, int64_t batch, int64_t Hk,
                        int64_t Hv, int64_t dk, int64_t dv, int64_t kernel, int64_t tiled) {
    const int64_t key = Hk * dk, C = 2 * key + Hv * dv, blocks = (C + CONV_CHANNELS - 1) / CONV_CHANNELS;
    const float q_scale = 1.0f / sqrtf((float)dk);
#pragma omp parallel
    {
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t blk = 0; blk < blocks; blk++) {
                const int64_t c0 = blk * CONV_CHANNELS, c1 = c0 + CONV_CHANNELS < C ? c0 + CONV_CHANNELS : C;
                conv_channels(proj + b * proj_stride, conv_w, conv_b, conv_pool + slots[b] * C * (kernel - 1),
                              mixed + b * C, c0, c1, kernel);
            }
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t head = 0; head < 2 * Hk; head++)  /* q's key heads, then k's */
                l2_normalize(mixed + b * C + head * dk, dk, head < Hk ? q_scale : 1.0f);
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t h = 0; h < Hv; h++) {
                const int64_t kh = tiled ? h % Hk : h / (Hv / Hk);
                const float *row = proj + b * proj_stride, *gates = row + C + Hv * dv, *m = mixed + b * C;
                const float g = -expf(A_log[h]) * softplus(gates[Hv + h] + dt_bias[h]);
                const float beta = 1.0f / (1.0f + expf(-gates[h]));
                float o[MAX_V_DIM];
                head_step(m + kh * dk, m + key + kh * dk, m + 2 * key + h * dv, g, beta,
                          ssm_pool + (slots[b] * Hv + h) * dk * dv, o, dk, dv);
                gated_norm(o, row + C + h * dv, norm_w, eps, out + (b * Hv + h) * dv, dv);
            }
    }
}
