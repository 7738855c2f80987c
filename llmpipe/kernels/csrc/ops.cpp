// The torch ops llmpipe::* over the C kernels in this folder (built into one extension by ../build.py).
//
// Each wrapper checks what its C entry point assumes (CPU, dtype, contiguity, shapes), so a wrong
// input is a RuntimeError naming it rather than a read past a buffer, allocates the outputs and
// calls the kernel. The schemas mark what an op writes in place (`Tensor(a!)`); the fake (meta)
// implementations torch.compile traces with are Python, in llmpipe/kernels/fake.py.
//
// Every op takes a batch of any size, none included: the row kernels (at most MAX_ROWS rows a call)
// run over slices of MAX_ROWS rows, and an empty batch returns an empty result without calling C.
//
// A new kernel: its C declaration in `kernels`, a wrapper, and a def + impl line below.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

#include "abi.h"

namespace kernels {
extern "C" {
// lowbit_linear.c
void int4_linear(const float *x, const uint8_t *codes, const float *scale, const float *offset, float *y, int64_t M,
                 int64_t N, int64_t K, int64_t group);
void int8_linear(const float *x, const int8_t *codes, const float *scale, float *y, int64_t M, int64_t N, int64_t K,
                 int64_t group);
void int4_dequantize(const uint8_t *codes, const float *scale, const float *offset, float *w, int64_t N, int64_t K,
                     int64_t group);
void int8_dequantize(const int8_t *codes, const float *scale, float *w, int64_t N, int64_t K, int64_t group);
void q5_0_linear(const float *x, const uint8_t *blocks, float *y, int64_t M, int64_t N, int64_t K);
void q5_0_unpack(const uint8_t *blocks, int8_t *codes, float *scale, int64_t N, int64_t K);
// lowbit_dot.c
int has_vnni(void);
int ggml_has_amx(void);
// ggml_dot.c
int ggml_type_supported(int64_t type);
int64_t ggml_row_bytes_of(int64_t type, int64_t K);
void ggml_segments_dot(const float *x, const int64_t *table, int64_t n, float *y, int64_t M, int64_t N, int64_t K,
                       int64_t bits, int64_t isa);
void ggml_linear_dot(const float *x, const uint8_t *blocks, float *y, int64_t M, int64_t N, int64_t K, int64_t type,
                     int64_t bits, int64_t isa);
void int4_linear_dot(const float *x, const uint8_t *codes, const float *scale, const float *offset, float *y,
                     int64_t M, int64_t N, int64_t K, int64_t group, int64_t bits, int64_t isa);
void int8_linear_dot(const float *x, const int8_t *codes, const float *scale, float *y, int64_t M, int64_t N,
                     int64_t K, int64_t group, int64_t bits, int64_t isa);
void q5_0_linear_dot(const float *x, const uint8_t *blocks, float *y, int64_t M, int64_t N, int64_t K, int64_t bits,
                     int64_t isa);
// lowbit_gemm.c
void int4_gemm_dot(const float *x, const uint8_t *panels, float *y, int64_t M, int64_t N, int64_t K, int64_t bits,
                   int64_t isa);
void int8_gemm_dot(const float *x, const uint8_t *panels, float *y, int64_t M, int64_t N, int64_t K, int64_t bits,
                   int64_t isa);
// greedy_argmax.c
void greedy_argmax(const float *logits, int64_t *out, int64_t rows, int64_t n);
// gated_delta.c
void gated_delta_step(const float *q, const float *k, const float *v, const float *g, const float *beta, float *state,
                      const int64_t *slots, float *out, int64_t batch, int64_t heads, int64_t dk, int64_t dv);
void gated_delta_decode(const float *proj, int64_t proj_stride, const float *conv_w, const float *conv_b,
                        const float *A_log, const float *dt_bias, const float *norm_w, float eps, float *conv_pool,
                        float *ssm_pool, const int64_t *slots, float *mixed, float *out, int64_t batch, int64_t Hk,
                        int64_t Hv, int64_t dk, int64_t dv, int64_t kernel, int64_t tiled);
// small_batch_linear.c
void small_batch_linear(const float *x, const float *W, float *y, int64_t M, int64_t N, int64_t K);
// paged_attention.c
void paged_decode_attention(const float *q, const void *cache, const uint16_t *scales, const int64_t *block_tables,
                            const int64_t *lens, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                            int64_t num_blocks, int64_t block_size, int64_t table_width, float scale, int64_t window,
                            const float *sinks);
void rope_heads(float *heads, const float *cos, const float *sin, int64_t T, int64_t row_heads, int64_t rotated,
                int64_t D);
void rope_write_decode_attention(float *qkv, const float *cos, const float *sin, float *cache, const int64_t *slots,
                                 const int64_t *block_tables, const int64_t *lens, float *out, int64_t B, int64_t H,
                                 int64_t KVH, int64_t D, int64_t num_blocks, int64_t block_size, int64_t table_width,
                                 float scale, int64_t window, const float *sinks);
// decode_step.c (layers: LayerDesc[num_layers], int64 words as layers/decode_step.py lays them out)
void decode_step(float *x, const void *layers, int64_t num_layers, int64_t B, int64_t hidden, int64_t H, int64_t KVH,
                 int64_t D, float eps, float scale, const float *cos, const float *sin,
                 const int64_t *slots, const int64_t *tables, int64_t table_width, const int64_t *lens,
                 int64_t num_blocks, int64_t block_size, const float *final_norm);
}
}  // namespace kernels

namespace {

constexpr int64_t CHUNK = 32;  // lowbit K and group sizes are multiples of this
constexpr int64_t HALF_CHUNK = 16;
constexpr int64_t Q5_0_BLOCK_BYTES = 22;  // lowbit_q5_rows.h: GGUF's Q5_0 block of CHUNK weights
constexpr int64_t PANEL = 8;  // lowbit_panels.h: a panel's rows, and its bytes per 32 inputs
constexpr int64_t INT4_PANEL_BYTES = 128 + 2 * PANEL * 4, INT8_PANEL_BYTES = 256 + 2 * PANEL * 4;  // or, for INT8, groups of half a chunk (GGUF Q6_K's sub-blocks)
// decode_step.c's LayerDesc words (LAYER_WORDS, LAYER_ROPE_WORD, LAYER_TABLE_WORD) and MAX_ROWS: abi.h.

constexpr int64_t ANY_RANK = -1;

// A CPU tensor of this dtype and rank whose elements the C code may read as one flat array.
void check(const char *op, const char *name, const at::Tensor &t, at::ScalarType dtype, int64_t rank) {
    TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got one on ", t.device());
    TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK(rank == ANY_RANK || t.dim() == rank, op, ": ", name, " must have ", rank, " dimensions, got shape ",
                t.sizes());
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.strides(), " for shape ",
                t.sizes());
}

void check_size(const char *op, const char *name, const at::Tensor &t, int64_t dim, int64_t size) {
    TORCH_CHECK(t.size(dim) == size, op, ": ", name, " must have size ", size, " in dimension ", dim,
                ", got shape ", t.sizes());
}

struct Shape {
    int64_t M, N, K;
};

// codes [N, K / codes_per_byte]; scale (and offset) [N, ceil(K / group)]; K and group multiples of CHUNK
// (INT8: or groups of HALF_CHUNK). Returns N.
int64_t check_codes(const char *op, int64_t K, const at::Tensor &codes, at::ScalarType code_type,
                    int64_t codes_per_byte, const at::Tensor &scale, const at::Tensor *offset, int64_t group) {
    check(op, "codes", codes, code_type, 2);
    check(op, "scale", scale, at::kFloat, 2);
    const int64_t N = codes.size(0);
    const bool half_groups = codes_per_byte == 1 && group == HALF_CHUNK;  // INT8 only: two scales a chunk
    TORCH_CHECK(K % CHUNK == 0 && group > 0 && (group % CHUNK == 0 || half_groups), op, ": K (", K,
                ") and group (", group, ") must be positive multiples of ", CHUNK,
                codes_per_byte == 1 ? " (or a group of 16)" : "");
    check_size(op, "codes", codes, 1, K / codes_per_byte);
    const int64_t groups = (K + group - 1) / group;
    check_size(op, "scale", scale, 0, N);
    check_size(op, "scale", scale, 1, groups);
    if (offset != nullptr) {
        check(op, "offset", *offset, at::kFloat, 2);
        check_size(op, "offset", *offset, 0, N);
        check_size(op, "offset", *offset, 1, groups);
    }
    return N;
}

// x [M, K] float32 (any M), and check_codes' weight.
Shape check_lowbit(const char *op, const at::Tensor &x, const at::Tensor &codes, at::ScalarType code_type,
                   int64_t codes_per_byte, const at::Tensor &scale, const at::Tensor *offset, int64_t group) {
    check(op, "x", x, at::kFloat, 2);
    return Shape{x.size(0), check_codes(op, x.size(1), codes, code_type, codes_per_byte, scale, offset, group), x.size(1)};
}

at::Tensor float_empty(int64_t rows, int64_t cols) { return at::empty({rows, cols}, at::dtype(at::kFloat)); }

// y [M, N] = x [M, K] @ W.T by a row kernel taking at most MAX_ROWS rows a call: kernel(x rows, y rows, count)
// per slice of MAX_ROWS rows (none for M = 0).
template <typename RowKernel>
at::Tensor by_row_slices(const at::Tensor &x, int64_t N, RowKernel kernel) {
    const int64_t M = x.size(0), K = x.size(1);
    at::Tensor y = float_empty(M, N);
    const float *xs = x.const_data_ptr<float>();
    float *ys = y.mutable_data_ptr<float>();
    for (int64_t m = 0; m < M; m += MAX_ROWS) kernel(xs + m * K, ys + m * N, std::min<int64_t>(MAX_ROWS, M - m));
    return y;
}

// The float weight [N, K] of INT4 codes [N, K / 2] (code * scale + offset) or INT8 codes [N, K] (code * scale).
at::Tensor int4_dequantize(const at::Tensor &codes, const at::Tensor &scale, const at::Tensor &offset, int64_t group) {
    const int64_t K = 2 * codes.size(-1), N = check_codes("int4_dequantize", K, codes, at::kByte, 2, scale, &offset, group);
    at::Tensor w = float_empty(N, K);
    kernels::int4_dequantize(codes.const_data_ptr<uint8_t>(), scale.const_data_ptr<float>(),
                             offset.const_data_ptr<float>(), w.mutable_data_ptr<float>(), N, K, group);
    return w;
}

at::Tensor int8_dequantize(const at::Tensor &codes, const at::Tensor &scale, int64_t group) {
    const int64_t K = codes.size(-1), N = check_codes("int8_dequantize", K, codes, at::kChar, 1, scale, nullptr, group);
    at::Tensor w = float_empty(N, K);
    kernels::int8_dequantize(codes.const_data_ptr<int8_t>(), scale.const_data_ptr<float>(), w.mutable_data_ptr<float>(),
                             N, K, group);
    return w;
}

at::Tensor int4_linear(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale,
                       const at::Tensor &offset, int64_t group) {
    const Shape s = check_lowbit("int4_linear", x, codes, at::kByte, 2, scale, &offset, group);
    return by_row_slices(x, s.N, [&](const float *xs, float *ys, int64_t rows) {
        kernels::int4_linear(xs, codes.const_data_ptr<uint8_t>(), scale.const_data_ptr<float>(),
                             offset.const_data_ptr<float>(), ys, rows, s.N, s.K, group);
    });
}

at::Tensor int8_linear(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale, int64_t group) {
    const Shape s = check_lowbit("int8_linear", x, codes, at::kChar, 1, scale, nullptr, group);
    return by_row_slices(x, s.N, [&](const float *xs, float *ys, int64_t rows) {
        kernels::int8_linear(xs, codes.const_data_ptr<int8_t>(), scale.const_data_ptr<float>(), ys, rows, s.N, s.K,
                             group);
    });
}

// GGUF Q5_0 blocks [N, K / CHUNK * Q5_0_BLOCK_BYTES] uint8; returns K.
int64_t check_q5_0(const char *op, const at::Tensor &blocks) {
    check(op, "blocks", blocks, at::kByte, 2);
    TORCH_CHECK(blocks.size(1) > 0 && blocks.size(1) % Q5_0_BLOCK_BYTES == 0, op, ": blocks must hold whole ",
                Q5_0_BLOCK_BYTES, "-byte Q5_0 blocks per row, got shape ", blocks.sizes());
    return blocks.size(1) / Q5_0_BLOCK_BYTES * CHUNK;
}

// x [M, K] float32 (any M) against check_q5_0's blocks.
Shape check_q5_0_linear(const char *op, const at::Tensor &x, const at::Tensor &blocks) {
    const int64_t K = check_q5_0(op, blocks);
    check(op, "x", x, at::kFloat, 2);
    check_size(op, "x", x, 1, K);
    return Shape{x.size(0), blocks.size(0), K};
}

at::Tensor q5_0_linear(const at::Tensor &x, const at::Tensor &blocks) {
    const Shape s = check_q5_0_linear("q5_0_linear", x, blocks);
    return by_row_slices(x, s.N, [&](const float *xs, float *ys, int64_t rows) {
        kernels::q5_0_linear(xs, blocks.const_data_ptr<uint8_t>(), ys, rows, s.N, s.K);
    });
}

// The INT8 form of Q5_0 blocks: codes q - 16 int8 [N, K] and scales float32 [N, K / CHUNK].
std::tuple<at::Tensor, at::Tensor> q5_0_unpack(const at::Tensor &blocks) {
    const int64_t K = check_q5_0("q5_0_unpack", blocks), N = blocks.size(0);
    at::Tensor codes = at::empty({N, K}, at::dtype(at::kChar)), scale = float_empty(N, K / CHUNK);
    kernels::q5_0_unpack(blocks.const_data_ptr<uint8_t>(), codes.mutable_data_ptr<int8_t>(),
                         scale.mutable_data_ptr<float>(), N, K);
    return {codes, scale};
}

void check_bits(const char *op, int64_t bits) {
    TORCH_CHECK(bits == 8 || bits == 16, op, ": bits must be 8 or 16, got ", bits);
}

at::Tensor int4_linear_dot(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale,
                           const at::Tensor &offset, int64_t group, int64_t bits, int64_t isa) {
    const Shape s = check_lowbit("int4_linear_dot", x, codes, at::kByte, 2, scale, &offset, group);
    check_bits("int4_linear_dot", bits);
    return by_row_slices(x, s.N, [&](const float *xs, float *ys, int64_t rows) {
        kernels::int4_linear_dot(xs, codes.const_data_ptr<uint8_t>(), scale.const_data_ptr<float>(),
                                 offset.const_data_ptr<float>(), ys, rows, s.N, s.K, group, bits, isa);
    });
}

at::Tensor int8_linear_dot(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &scale, int64_t group,
                           int64_t bits, int64_t isa) {
    const Shape s = check_lowbit("int8_linear_dot", x, codes, at::kChar, 1, scale, nullptr, group);
    check_bits("int8_linear_dot", bits);
    return by_row_slices(x, s.N, [&](const float *xs, float *ys, int64_t rows) {
        kernels::int8_linear_dot(xs, codes.const_data_ptr<int8_t>(), scale.const_data_ptr<float>(), ys, rows, s.N, s.K,
                                 group, bits, isa);
    });
}

at::Tensor q5_0_linear_dot(const at::Tensor &x, const at::Tensor &blocks, int64_t bits, int64_t isa) {
    const Shape s = check_q5_0_linear("q5_0_linear_dot", x, blocks);
    check_bits("q5_0_linear_dot", bits);
    return by_row_slices(x, s.N, [&](const float *xs, float *ys, int64_t rows) {
        kernels::q5_0_linear_dot(xs, blocks.const_data_ptr<uint8_t>(), ys, rows, s.N, s.K, bits, isa);
    });
}

int64_t has_vnni() { return kernels::has_vnni(); }
int64_t has_amx() { return kernels::ggml_has_amx(); }

// x [M, K] float32 (any M) @ a weight held as ggml blocks of `type` [N, bytes per row] uint8 (ggml_rows.h).
at::Tensor ggml_linear_dot(const at::Tensor &x, const at::Tensor &blocks, int64_t type, int64_t bits, int64_t isa) {
    const char *op = "ggml_linear_dot";
    TORCH_CHECK(kernels::ggml_type_supported(type), op, ": ggml type ", type, " has no kernel");
    check(op, "x", x, at::kFloat, 2);
    check(op, "blocks", blocks, at::kByte, 2);
    check_bits(op, bits);
    const int64_t M = x.size(0), N = blocks.size(0), K = x.size(1);
    TORCH_CHECK(K > 0 && blocks.size(1) == kernels::ggml_row_bytes_of(type, K), op, ": blocks ", blocks.sizes(),
                " do not hold rows of ", K, " weights of ggml type ", type);
    at::Tensor y = float_empty(M, N);
    if (M > 0 && N > 0)
        kernels::ggml_linear_dot(x.const_data_ptr<float>(), blocks.const_data_ptr<uint8_t>(), y.mutable_data_ptr<float>(),
                                 M, N, K, type, bits, isa);
    return y;
}

// x [M, K] float32 (any M) @ a weight whose rows are segments of ggml blocks: table int64 [n, 3] (type, rows,
// address of that many rows of blocks) — GGMLLinear's, whose buffers hold the addresses' bytes.
at::Tensor ggml_segments_dot(const at::Tensor &x, const at::Tensor &table, int64_t N, int64_t bits, int64_t isa) {
    const char *op = "ggml_segments_dot";
    check(op, "x", x, at::kFloat, 2);
    check(op, "table", table, at::kLong, 2);
    check_bits(op, bits);
    TORCH_CHECK(table.size(1) == 3 && table.size(0) > 0, op, ": table must be [segments, 3], got ", table.sizes());
    const int64_t M = x.size(0), K = x.size(1), *t = table.const_data_ptr<int64_t>();
    int64_t rows = 0;
    for (int64_t i = 0; i < table.size(0); i++) {
        TORCH_CHECK(kernels::ggml_type_supported(t[3 * i]), op, ": ggml type ", t[3 * i], " has no kernel");
        TORCH_CHECK(K > 0 && kernels::ggml_row_bytes_of(t[3 * i], K) > 0, op, ": ", K, " inputs are not whole blocks of type ",
                    t[3 * i]);
        TORCH_CHECK(t[3 * i + 1] > 0 && t[3 * i + 2] != 0, op, ": segment ", i, " has no rows");
        rows += t[3 * i + 1];
    }
    TORCH_CHECK(rows == N, op, ": the segments hold ", rows, " rows, not ", N);
    at::Tensor y = float_empty(M, N);
    if (M > 0) kernels::ggml_segments_dot(x.const_data_ptr<float>(), t, table.size(0), y.mutable_data_ptr<float>(), M, N, K, bits, isa);
    return y;
}

// x [M, K] float32 (any M) @ a weight [N, K] held as panels [ceil(N / PANEL), K / CHUNK, block_bytes].
at::Tensor gemm_dot(const char *op, const at::Tensor &x, const at::Tensor &panels, int64_t N, int64_t bits,
                    int64_t block_bytes) {
    check(op, "x", x, at::kFloat, 2);
    check(op, "panels", panels, at::kByte, 3);
    check_bits(op, bits);
    const int64_t M = x.size(0), K = x.size(1);
    TORCH_CHECK(K % CHUNK == 0, op, ": K must be a multiple of ", CHUNK, ", got ", K);
    TORCH_CHECK(N >= 1, op, ": N must be positive, got ", N);
    check_size(op, "panels", panels, 0, (N + PANEL - 1) / PANEL);
    check_size(op, "panels", panels, 1, K / CHUNK);
    check_size(op, "panels", panels, 2, block_bytes);
    return float_empty(M, N);
}

at::Tensor int4_gemm_dot(const at::Tensor &x, const at::Tensor &panels, int64_t N, int64_t bits, int64_t isa) {
    at::Tensor y = gemm_dot("int4_gemm_dot", x, panels, N, bits, INT4_PANEL_BYTES);
    if (x.size(0) > 0)
        kernels::int4_gemm_dot(x.const_data_ptr<float>(), panels.const_data_ptr<uint8_t>(), y.mutable_data_ptr<float>(),
                           x.size(0), N, x.size(1), bits, isa);
    return y;
}

at::Tensor int8_gemm_dot(const at::Tensor &x, const at::Tensor &panels, int64_t N, int64_t bits, int64_t isa) {
    at::Tensor y = gemm_dot("int8_gemm_dot", x, panels, N, bits, INT8_PANEL_BYTES);
    if (x.size(0) > 0)
        kernels::int8_gemm_dot(x.const_data_ptr<float>(), panels.const_data_ptr<uint8_t>(), y.mutable_data_ptr<float>(),
                           x.size(0), N, x.size(1), bits, isa);
    return y;
}

// x [M, K] (any M and strides: copied when not contiguous) @ weight [N, K].T, K % 16 == 0.
at::Tensor small_batch_linear(const at::Tensor &x_in, const at::Tensor &weight) {
    const char *op = "small_batch_linear";
    const at::Tensor x = x_in.contiguous();
    check(op, "x", x, at::kFloat, 2);
    check(op, "weight", weight, at::kFloat, 2);
    const int64_t N = weight.size(0), K = x.size(1);
    TORCH_CHECK(K % 16 == 0, op, ": K must be a multiple of 16, got ", K);
    check_size(op, "weight", weight, 1, K);
    return by_row_slices(x, N, [&](const float *xs, float *ys, int64_t rows) {
        kernels::small_batch_linear(xs, weight.const_data_ptr<float>(), ys, rows, N, K);
    });
}

// Each row's argmax of logits [rows, vocab] float32, as torch.argmax(dim=-1): int64 [rows].
at::Tensor greedy_argmax(const at::Tensor &logits) {
    const char *op = "greedy_argmax";
    check(op, "logits", logits, at::kFloat, 2);
    TORCH_CHECK(logits.size(1) >= 1, op, ": logits must be [rows, vocab >= 1], got ", logits.sizes());
    at::Tensor out = at::empty({logits.size(0)}, at::dtype(at::kLong));
    if (logits.size(0) > 0)
        kernels::greedy_argmax(logits.const_data_ptr<float>(), out.mutable_data_ptr<int64_t>(), logits.size(0),
                           logits.size(1));
    return out;
}

// One Gated DeltaNet decode token per row on the pool's states, in place: q, k [B, H, dk], v [B, H, dv], g, beta
// [B, H] float32; state [slots, H, dk, dv] float32; slots int64 [B], distinct. Returns out [B, H, dv].
// The slots' ids, each checked to lie in a pool of `pool` states.
const int64_t *pool_slots(const char *op, const at::Tensor &slots, int64_t pool) {
    const int64_t *slot = slots.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < slots.size(0); b++)
        TORCH_CHECK(slot[b] >= 0 && slot[b] < pool, op, ": slot ", slot[b], " is outside the pool's ", pool);
    return slot;
}

at::Tensor gated_delta_step(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &g,
                            const at::Tensor &beta, const at::Tensor &state, const at::Tensor &slots) {
    const char *op = "gated_delta_step";
    check(op, "q", q, at::kFloat, 3);
    check(op, "k", k, at::kFloat, 3);
    check(op, "v", v, at::kFloat, 3);
    check(op, "g", g, at::kFloat, 2);
    check(op, "beta", beta, at::kFloat, 2);
    check(op, "state", state, at::kFloat, 4);
    check(op, "slots", slots, at::kLong, 1);
    const int64_t B = q.size(0), H = q.size(1), dk = q.size(2), dv = v.size(2);
    TORCH_CHECK(k.sizes() == q.sizes(), op, ": k must be shaped like q ", q.sizes(), ", got ", k.sizes());
    TORCH_CHECK(v.size(0) == B && v.size(1) == H, op, ": v must be [", B, ", ", H, ", dv], got ", v.sizes());
    TORCH_CHECK(g.size(0) == B && g.size(1) == H && beta.sizes() == g.sizes(), op, ": g and beta must be [", B, ", ",
                H, "]");
    TORCH_CHECK(state.size(1) == H && state.size(2) == dk && state.size(3) == dv, op, ": state must be [slots, ", H,
                ", ", dk, ", ", dv, "], got ", state.sizes());
    TORCH_CHECK(dv <= 1024, op, ": v_dim must be at most 1024, got ", dv);
    check_size(op, "slots", slots, 0, B);
    const int64_t *slot = pool_slots(op, slots, state.size(0));
    at::Tensor out = at::empty({B, H, dv}, at::dtype(at::kFloat));
    if (B > 0)
        kernels::gated_delta_step(q.const_data_ptr<float>(), k.const_data_ptr<float>(), v.const_data_ptr<float>(),
                                  g.const_data_ptr<float>(), beta.const_data_ptr<float>(),
                                  state.mutable_data_ptr<float>(), slot, out.mutable_data_ptr<float>(), B, H, dk, dv);
    return out;
}

// proj [B, qkv | z | b | a] → [B, Hv * dv]: the Gated DeltaNet mixer of B decode rows, states in place.
at::Tensor gated_delta_decode(const at::Tensor &proj, const at::Tensor &conv_weight,
                              const std::optional<at::Tensor> &conv_bias, const at::Tensor &A_log,
                              const at::Tensor &dt_bias, const at::Tensor &norm_weight, const at::Tensor &conv_state,
                              const at::Tensor &ssm, const at::Tensor &slots, int64_t k_heads, double eps,
                              bool tiled) {
    const char *op = "gated_delta_decode";
    check(op, "proj", proj, at::kFloat, 2);
    check(op, "conv_weight", conv_weight, at::kFloat, 2);
    check(op, "A_log", A_log, at::kFloat, 1);
    check(op, "dt_bias", dt_bias, at::kFloat, 1);
    check(op, "norm_weight", norm_weight, at::kFloat, 1);
    check(op, "conv_state", conv_state, at::kFloat, 3);
    check(op, "ssm", ssm, at::kFloat, 4);
    check(op, "slots", slots, at::kLong, 1);
    const int64_t B = proj.size(0), C = conv_weight.size(0), kernel = conv_weight.size(1);
    const int64_t Hv = ssm.size(1), dk = ssm.size(2), dv = ssm.size(3), Hk = k_heads;
    TORCH_CHECK(Hk > 0 && Hv % Hk == 0, op, ": value heads (", Hv, ") must be a multiple of key heads (", Hk, ")");
    TORCH_CHECK(C == 2 * Hk * dk + Hv * dv, op, ": conv_weight has ", C, " channels, q, k and v need ",
                2 * Hk * dk + Hv * dv);
    TORCH_CHECK(proj.size(1) == C + Hv * dv + 2 * Hv, op, ": proj rows must hold qkv, z, b and a (",
                C + Hv * dv + 2 * Hv, "), got ", proj.size(1));
    TORCH_CHECK(kernel >= 1 && dv <= 1024, op, ": kernel must be at least 1 and v_dim at most 1024");
    check_size(op, "A_log", A_log, 0, Hv);
    check_size(op, "dt_bias", dt_bias, 0, Hv);
    check_size(op, "norm_weight", norm_weight, 0, dv);
    check_size(op, "conv_state", conv_state, 1, C);
    check_size(op, "conv_state", conv_state, 2, kernel - 1);
    TORCH_CHECK(conv_state.size(0) == ssm.size(0), op, ": conv_state and ssm must hold as many slots");
    check_size(op, "slots", slots, 0, B);
    const float *bias = nullptr;
    if (conv_bias.has_value()) {
        check(op, "conv_bias", *conv_bias, at::kFloat, 1);
        check_size(op, "conv_bias", *conv_bias, 0, C);
        bias = conv_bias->const_data_ptr<float>();
    }
    const int64_t *slot = pool_slots(op, slots, ssm.size(0));
    at::Tensor out = at::empty({B, Hv * dv}, at::dtype(at::kFloat));
    at::Tensor mixed = at::empty({B, C}, at::dtype(at::kFloat));
    if (B > 0)
        kernels::gated_delta_decode(proj.const_data_ptr<float>(), proj.size(1), conv_weight.const_data_ptr<float>(),
                                    bias, A_log.const_data_ptr<float>(), dt_bias.const_data_ptr<float>(),
                                    norm_weight.const_data_ptr<float>(), static_cast<float>(eps),
                                    conv_state.mutable_data_ptr<float>(), ssm.mutable_data_ptr<float>(), slot,
                                    mixed.mutable_data_ptr<float>(), out.mutable_data_ptr<float>(), B, Hk, Hv, dk, dv,
                                    kernel, tiled ? 1 : 0);
    return out;
}

struct Cache {
    int64_t num_blocks, block_size, kv_heads, head_dim;
};

// kv_cache [2, blocks, block_size, KVH, D] float32 with D % 8 == 0; `heads` query heads sharing the KV heads.
Cache check_cache(const char *op, const at::Tensor &kv_cache, int64_t heads, at::ScalarType dtype = at::kFloat) {
    check(op, "kv_cache", kv_cache, dtype, 5);
    check_size(op, "kv_cache", kv_cache, 0, 2);
    const Cache c{kv_cache.size(1), kv_cache.size(2), kv_cache.size(3), kv_cache.size(4)};
    TORCH_CHECK(c.head_dim % 8 == 0, op, ": the head dim must be a multiple of 8, got ", c.head_dim);
    TORCH_CHECK(c.kv_heads > 0 && heads % c.kv_heads == 0, op, ": ", heads,
                " query heads must be a multiple of the cache's ", c.kv_heads, " KV heads");
    return c;
}

// Per sequence of a batch of `batch`: block_tables [batch, W] and lens [batch], int64.
void check_tables(const char *op, const at::Tensor &block_tables, const at::Tensor &lens, int64_t batch) {
    check(op, "block_tables", block_tables, at::kLong, 2);
    check(op, "lens", lens, at::kLong, 1);
    check_size(op, "block_tables", block_tables, 0, batch);
    check_size(op, "lens", lens, 0, batch);
}

// cos or sin: batch × head_dim float32 values (any shape, e.g. [B, 1, D]).
void check_rotary(const char *op, const char *name, const at::Tensor &t, int64_t batch, int64_t head_dim) {
    check(op, name, t, at::kFloat, ANY_RANK);
    TORCH_CHECK(t.numel() == batch * head_dim, op, ": ", name, " must hold ", batch, " x ", head_dim,
                " values, got shape ", t.sizes());
}

// sinks: float32 [heads], contiguous, or none.
const float *check_sinks(const char *op, const std::optional<at::Tensor> &sinks, int64_t heads) {
    if (!sinks) return nullptr;
    check(op, "sinks", *sinks, at::kFloat, 1);
    check_size(op, "sinks", *sinks, 0, heads);
    return sinks->const_data_ptr<float>();
}

// q [B, H, D] (copied when not contiguous); tables and lens converted to contiguous int64 as needed.
// kv_cache float32, or int8 codes with kv_scales [2, blocks, block_size, KV heads, 1] their float16 scales.
at::Tensor paged_decode_attention(const at::Tensor &q_in, const at::Tensor &kv_cache, const at::Tensor &block_tables,
                                  const at::Tensor &lens_in, double scale, std::optional<int64_t> window,
                                  const std::optional<at::Tensor> &kv_scales, const std::optional<at::Tensor> &sinks) {
    const char *op = "paged_decode_attention";
    const at::Tensor q = q_in.contiguous();
    const at::Tensor tables = block_tables.to(at::kLong).contiguous(), lens = lens_in.to(at::kLong).contiguous();
    check(op, "q", q, at::kFloat, 3);
    const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
    const Cache c = check_cache(op, kv_cache, heads, kv_scales ? at::kChar : at::kFloat);
    if (kv_scales) {
        check(op, "kv_scales", *kv_scales, at::kHalf, 5);
        TORCH_CHECK(kv_scales->sizes().slice(0, 4) == kv_cache.sizes().slice(0, 4) && kv_scales->size(4) == 1, op,
                    ": kv_scales must be [2, blocks, block size, KV heads, 1] for kv_cache ", kv_cache.sizes(),
                    ", got ", kv_scales->sizes());
    }
    check_size(op, "q", q, 2, c.head_dim);
    check_tables(op, tables, lens, batch);
    const float *sink_logits = check_sinks(op, sinks, heads);
    at::Tensor out = float_empty(batch, heads * head_dim);
    if (batch == 0) return out;
    const auto *scales = kv_scales ? static_cast<const uint16_t *>(kv_scales->const_data_ptr()) : nullptr;
    kernels::paged_decode_attention(q.const_data_ptr<float>(), kv_cache.const_data_ptr(), scales,
                                    tables.const_data_ptr<int64_t>(), lens.const_data_ptr<int64_t>(),
                                    out.mutable_data_ptr<float>(), batch, heads, c.kv_heads, head_dim, c.num_blocks,
                                    c.block_size, tables.size(1), static_cast<float>(scale), window.value_or(0),
                                    sink_logits);
    return out;
}

// heads [T, heads, D]: its first `rotated` heads turned by RoPE in place, with cos / sin [T, 1, D].
void rope_heads(const at::Tensor &heads, const at::Tensor &cos, const at::Tensor &sin, int64_t rotated) {
    const char *op = "rope_heads";
    check(op, "heads", heads, at::kFloat, 3);
    const int64_t rows = heads.size(0), head_dim = heads.size(2);
    check_rotary(op, "cos", cos, rows, head_dim);
    check_rotary(op, "sin", sin, rows, head_dim);
    TORCH_CHECK(0 <= rotated && rotated <= heads.size(1), op, ": rotated must be in [0, ", heads.size(1), "], got ",
                rotated);
    if (rows == 0 || rotated == 0) return;
    kernels::rope_heads(heads.mutable_data_ptr<float>(), cos.const_data_ptr<float>(), sin.const_data_ptr<float>(),
                        rows, heads.size(1), rotated, head_dim);
}

// heads [B, H + 2 KVH, D] (rotated in place), K/V written to kv_cache at slots [B].
at::Tensor rope_write_decode_attention(const at::Tensor &heads, const at::Tensor &cos, const at::Tensor &sin,
                                       const at::Tensor &kv_cache, const at::Tensor &slots,
                                       const at::Tensor &block_tables, const at::Tensor &lens, int64_t num_heads,
                                       double scale, std::optional<int64_t> window,
                                       const std::optional<at::Tensor> &sinks) {
    const char *op = "rope_write_decode_attention";
    check(op, "heads", heads, at::kFloat, 3);
    const int64_t batch = heads.size(0), head_dim = heads.size(2);
    const Cache c = check_cache(op, kv_cache, num_heads);
    check_size(op, "heads", heads, 1, num_heads + 2 * c.kv_heads);
    check_size(op, "heads", heads, 2, c.head_dim);
    check_rotary(op, "cos", cos, batch, head_dim);
    check_rotary(op, "sin", sin, batch, head_dim);
    check(op, "slots", slots, at::kLong, 1);
    check_size(op, "slots", slots, 0, batch);
    check_tables(op, block_tables, lens, batch);
    const float *sink_logits = check_sinks(op, sinks, num_heads);
    at::Tensor out = float_empty(batch, num_heads * head_dim);
    if (batch == 0) return out;
    kernels::rope_write_decode_attention(
        heads.mutable_data_ptr<float>(), cos.const_data_ptr<float>(), sin.const_data_ptr<float>(),
        kv_cache.mutable_data_ptr<float>(), slots.const_data_ptr<int64_t>(), block_tables.const_data_ptr<int64_t>(),
        lens.const_data_ptr<int64_t>(), out.mutable_data_ptr<float>(), batch, num_heads, c.kv_heads, head_dim,
        c.num_blocks, c.block_size, block_tables.size(1), static_cast<float>(scale), window.value_or(0), sink_logits);
    return out;
}

// x [B, hidden] updated in place; kv_pool (float32, or int8 codes with kv_scales their float16 scales)
// is written through the cache addresses in `descriptors` [layers, LAYER_WORDS] (passed so that the
// schema says so). cos, sin [R, B, head dim]; slots [S, B],
// tables [S, B, W], lens [S, B]: each layer names its RoPE table and its block-table set. sizes: hidden,
// heads, KV heads, head dim, blocks, block size. final_norm [hidden] (optional): x leaves normed by it.
void decode_step(const at::Tensor &x, const at::Tensor &kv_pool, const std::optional<at::Tensor> &kv_scales,
                 const at::Tensor &descriptors,
                 const at::Tensor &cos, const at::Tensor &sin, const at::Tensor &slots, const at::Tensor &tables,
                 const at::Tensor &lens, at::IntArrayRef sizes, double eps, double scale,
                 const std::optional<at::Tensor> &final_norm) {
    const char *op = "decode_step";
    TORCH_CHECK(sizes.size() == 6, op, ": sizes must be [hidden, heads, KV heads, head dim, blocks, block size], got ",
                sizes);
    const int64_t hidden = sizes[0], heads = sizes[1], kv_heads = sizes[2], head_dim = sizes[3];
    check(op, "x", x, at::kFloat, 2);
    const int64_t batch = x.size(0);
    check_size(op, "x", x, 1, hidden);
    TORCH_CHECK(hidden % 8 == 0 && head_dim % 8 == 0, op, ": hidden (", hidden, ") and head dim (", head_dim,
                ") must be multiples of 8");
    TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, op, ": ", heads, " heads must be a multiple of ", kv_heads,
                " KV heads");
    const bool int8_cache = kv_pool.scalar_type() == at::kChar;
    TORCH_CHECK(kv_pool.device().is_cpu() && (int8_cache || kv_pool.scalar_type() == at::kFloat), op,
                ": kv_pool must be a float32 or int8 CPU tensor");
    TORCH_CHECK(int8_cache == kv_scales.has_value(), op, ": kv_scales go with an int8 kv_pool, and only with it");
    TORCH_CHECK(!int8_cache || (kv_scales->device().is_cpu() && kv_scales->scalar_type() == at::kHalf), op,
                ": kv_scales must be a float16 CPU tensor");
    check(op, "descriptors", descriptors, at::kLong, 2);
    TORCH_CHECK(descriptors.size(0) >= 1, op, ": descriptors must describe at least one layer");
    check_size(op, "descriptors", descriptors, 1, LAYER_WORDS);
    check(op, "cos", cos, at::kFloat, 3);
    check(op, "sin", sin, at::kFloat, 3);
    TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(1) == batch && cos.size(2) == head_dim, op,
                ": cos and sin must be [tables, ", batch, ", ", head_dim, "], got ", cos.sizes(), " and ", sin.sizes());
    check(op, "slots", slots, at::kLong, 2);
    check(op, "block_tables", tables, at::kLong, 3);
    check(op, "lens", lens, at::kLong, 2);
    const int64_t sets = slots.size(0);
    TORCH_CHECK(slots.size(1) == batch && tables.size(0) == sets && tables.size(1) == batch && lens.size(0) == sets &&
                lens.size(1) == batch, op, ": slots [S, B], block_tables [S, B, W] and lens [S, B] must agree, got ",
                slots.sizes(), ", ", tables.sizes(), ", ", lens.sizes(), " for B = ", batch);
    if (final_norm) {
        check(op, "final_norm", *final_norm, at::kFloat, 1);
        check_size(op, "final_norm", *final_norm, 0, hidden);
    }
    const int64_t *words = descriptors.const_data_ptr<int64_t>();
    for (int64_t l = 0; l < descriptors.size(0); l++) {
        const int64_t rope = words[l * LAYER_WORDS + LAYER_ROPE_WORD], set = words[l * LAYER_WORDS + LAYER_TABLE_WORD];
        TORCH_CHECK(rope >= 0 && rope < cos.size(0) && set >= 0 && set < sets, op, ": layer ", l, " names RoPE table ",
                    rope, " of ", cos.size(0), " and block-table set ", set, " of ", sets);
        TORCH_CHECK((words[(l + 1) * LAYER_WORDS - 1] != 0) == int8_cache, op, ": layer ", l,
                    int8_cache ? " has no cache scales for its int8 cache" : " has cache scales for a float32 cache");
    }
    if (batch == 0) return;  // after every check: an empty batch of bad arguments is still refused
    kernels::decode_step(x.mutable_data_ptr<float>(), words, descriptors.size(0), batch, hidden, heads, kv_heads,
                         head_dim, static_cast<float>(eps), static_cast<float>(scale), cos.const_data_ptr<float>(),
                         sin.const_data_ptr<float>(), slots.const_data_ptr<int64_t>(), tables.const_data_ptr<int64_t>(),
                         tables.size(2), lens.const_data_ptr<int64_t>(), sizes[4], sizes[5],
                         final_norm ? final_norm->const_data_ptr<float>() : nullptr);
}

}  // namespace

TORCH_LIBRARY(llmpipe, m) {
    m.set_python_module("llmpipe.kernels.fake");
    m.def("int4_linear(Tensor x, Tensor codes, Tensor scale, Tensor offset, int group) -> Tensor");
    m.def("int8_linear(Tensor x, Tensor codes, Tensor scale, int group) -> Tensor");
    m.def("int4_dequantize(Tensor codes, Tensor scale, Tensor offset, int group) -> Tensor");
    m.def("int8_dequantize(Tensor codes, Tensor scale, int group) -> Tensor");
    m.def("int4_linear_dot(Tensor x, Tensor codes, Tensor scale, Tensor offset, int group, int bits=8, int isa=1) -> Tensor");
    m.def("int8_linear_dot(Tensor x, Tensor codes, Tensor scale, int group, int bits=8, int isa=1) -> Tensor");
    m.def("q5_0_linear(Tensor x, Tensor blocks) -> Tensor");
    m.def("q5_0_linear_dot(Tensor x, Tensor blocks, int bits=8, int isa=1) -> Tensor");
    m.def("q5_0_unpack(Tensor blocks) -> (Tensor, Tensor)");
    m.def("int4_gemm_dot(Tensor x, Tensor panels, int N, int bits=8, int isa=1) -> Tensor");
    m.def("int8_gemm_dot(Tensor x, Tensor panels, int N, int bits=8, int isa=1) -> Tensor");
    m.def("ggml_linear_dot(Tensor x, Tensor blocks, int type, int bits=16, int isa=2) -> Tensor");
    m.def("ggml_segments_dot(Tensor x, Tensor table, int N, int bits=16, int isa=2) -> Tensor");
    m.def("has_vnni() -> int", &has_vnni);  // no tensors to dispatch on: one kernel for every backend
    m.def("has_amx() -> int", &has_amx);
    m.def("greedy_argmax(Tensor logits) -> Tensor");
    m.def("gated_delta_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, Tensor slots) -> Tensor");
    m.def("gated_delta_decode(Tensor proj, Tensor conv_weight, Tensor? conv_bias, Tensor A_log, Tensor dt_bias, "
          "Tensor norm_weight, Tensor(a!) conv_state, Tensor(b!) ssm, Tensor slots, int k_heads, float eps, "
          "bool tiled) -> Tensor");
    m.def("small_batch_linear(Tensor x, Tensor weight) -> Tensor");
    m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor lens, float scale, "
          "int? window, Tensor? kv_scales=None, Tensor? sinks=None) -> Tensor");
    m.def("rope_heads(Tensor(a!) heads, Tensor cos, Tensor sin, int rotated) -> ()");
    m.def("rope_write_decode_attention(Tensor(a!) heads, Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor slots, "
          "Tensor block_tables, Tensor lens, int num_heads, float scale, int? window, Tensor? sinks=None) -> Tensor");
    m.def("decode_step(Tensor(a!) x, Tensor(b!) kv_pool, Tensor(c!)? kv_scales, Tensor descriptors, Tensor cos, "
          "Tensor sin, Tensor slots, Tensor tables, Tensor lens, int[] sizes, float eps, float scale, "
          "Tensor? final_norm=None) -> ()");
}

TORCH_LIBRARY_IMPL(llmpipe, CPU, m) {
    m.impl("int4_linear", &int4_linear);
    m.impl("int8_linear", &int8_linear);
    m.impl("int4_dequantize", &int4_dequantize);
    m.impl("int8_dequantize", &int8_dequantize);
    m.impl("int4_linear_dot", &int4_linear_dot);
    m.impl("int8_linear_dot", &int8_linear_dot);
    m.impl("q5_0_linear", &q5_0_linear);
    m.impl("q5_0_linear_dot", &q5_0_linear_dot);
    m.impl("q5_0_unpack", &q5_0_unpack);
    m.impl("int4_gemm_dot", &int4_gemm_dot);
    m.impl("int8_gemm_dot", &int8_gemm_dot);
    m.impl("ggml_linear_dot", &ggml_linear_dot);
    m.impl("ggml_segments_dot", &ggml_segments_dot);
    m.impl("greedy_argmax", &greedy_argmax);
    m.impl("gated_delta_step", &gated_delta_step);
    m.impl("gated_delta_decode", &gated_delta_decode);
    m.impl("small_batch_linear", &small_batch_linear);
    m.impl("paged_decode_attention", &paged_decode_attention);
    m.impl("rope_heads", &rope_heads);
    m.impl("rope_write_decode_attention", &rope_write_decode_attention);
    m.impl("decode_step", &decode_step);
}
