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
 * threads. */
#include <math.h>
#include <stdint.h>

#define MAX_V_DIM 1024

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
