// Small-batch linears for CPUs with AVX-512 BF16 and VNNI: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), any M
// (the kernels are tuned for the 1-16 rows of a speculative decoder's forwards).
//
// Why: a decoding step, a draft-tree verification and a drafter call are streams over the weights
// with 1 to ~16 rows. oneDNN's prepacked bf16 GEMM streams well for one row but pays compute it does
// not overlap with the stream for more (1.5B target, one thread, Zen 5 EPYC: 8 rows 1.49x and 16 rows
// 2.0x a one-row forward). Here each group of 16 output columns is read once for up to 8 rows, with
// all accumulators in registers; wider products go as row blocks of 8 over the same chunk of weight
// groups (the later blocks read it from L2).
//
// Two weight formats:
//  * bf16: W rounded to bfloat16, packed [G][K/2][16][2] (16 columns x one bf16 pair per 64-byte line):
//    one vdpbf16ps per row per line, the row's bf16 pair broadcast. Numerics of a bf16 linear (bf16
//    products, float32 accumulation), and every row is computed in the same order whatever M is, so a
//    tree verification row equals the one-token forward of the same prefix bit for bit.
//  * int8 (drafters): W as int8 per output column (symmetric, scale = max|w| / 127), packed
//    [G][K/4][16][4]; each row of x is quantized to int8 with its own scale (so a row's result never
//    depends on the other rows), shifted to uint8 for vpdpbusd (u8 x s8 -> s32, exact), and the shift
//    is taken back with the columns' weight sums: y = (acc - 128 * colsum) * sx[m] * sw[n].
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t COLS = 16;  // output columns per group (one zmm of float32 / int32 accumulators)
constexpr int ROW_BLOCK = 8;  // rows whose accumulators stay in registers together
// Software prefetch distance in 64-byte lines per weight stream: the more rows a tile computes per
// line, the longer the lead the stream needs (measured on a Zen 5 EPYC, DRAM-resident weights: 8 rows
// 13% faster with 32 lines than 16, 1-4 rows 2-5% slower).
template <int M>
constexpr int64_t prefetch_lines() { return M <= 4 ? 16 : 32; }
constexpr int64_t CHUNK_BYTES = 384 * 1024;  // weight bytes per chunk of groups (stays in L2 for later row blocks)

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline void store_tile(const __m512* acc, int rows, float* y, int64_t N, int64_t col0, const float* scale_n,
                       const float* row_scale, const float* bias) {
  int64_t ncols = std::min<int64_t>(COLS, N - col0);
  __mmask16 mask = ncols == COLS ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << ncols) - 1);
  __m512 sn = scale_n ? _mm512_maskz_loadu_ps(mask, scale_n + col0) : _mm512_set1_ps(1.0f);
  __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col0) : _mm512_setzero_ps();
  for (int m = 0; m < rows; ++m) {
    // one explicit fused step per element (built with -ffp-contract=off, so every row rounds alike)
    __m512 v = scale_n ? _mm512_fmadd_ps(_mm512_mul_ps(acc[m], sn), _mm512_set1_ps(row_scale[m]), b)
                       : _mm512_add_ps(acc[m], b);
    _mm512_mask_storeu_ps(y + m * N + col0, mask, v);
  }
}

// One tile: S consecutive groups of 16 output columns x M rows (M <= 8), all accumulators in
// registers. Both weight formats store one 64-byte line per group and step k (bf16: 16 columns x one
// pair; int8: 16 columns x one quad), and x holds one uint32 per row and step (a bf16 pair or four
// shifted int8), broadcast to every column: only the product instruction and the epilogue differ (Op).
struct Bf16Op {
  using Acc = __m512;
  const float* bias;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc dot(Acc acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
  void store(const Acc* acc, int rows, float* y, int64_t N, int64_t col0, int64_t) const {
    store_tile(acc, rows, y, N, col0, nullptr, nullptr, bias);
  }
};

struct Int8Op {
  using Acc = __m512i;
  const float* bias;
  const int32_t* colsum;  // per column, padded to G * 16
  const float* wscale;    // per column
  const float* xscale;    // per row of x
  static Acc zero() { return _mm512_setzero_si512(); }
  static Acc dot(Acc acc, __m512i w, __m512i x) { return _mm512_dpbusd_epi32(acc, x, w); }
  void store(const Acc* acc, int rows, float* y, int64_t N, int64_t col0, int64_t row0) const {
    __m512i shift = _mm512_slli_epi32(_mm512_loadu_si512(colsum + col0), 7);  // 128 * colsum
    __m512 out[ROW_BLOCK];
    for (int m = 0; m < rows; ++m) out[m] = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m], shift));
    store_tile(out, rows, y, N, col0, wscale, xscale + row0, bias);
  }
};

// x: M rows of Kp uint32; w: S consecutive groups of Kp 64-byte lines; y and row0 at the tile's first row.
template <class Op, int M, int S>
inline void tile(const Op& op, const uint32_t* x, int64_t Kp, const char* w, float* y, int64_t N, int64_t col0,
                 int64_t row0) {
  typename Op::Acc acc[S][M];
  #pragma GCC unroll 8
  for (int s = 0; s < S; ++s)
    #pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[s][m] = Op::zero();
  for (int64_t k = 0; k < Kp; ++k) {
    __m512i ws[S];
    #pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      _mm_prefetch(w + (s * Kp + k + prefetch_lines<M>()) * 64, _MM_HINT_T0);
      ws[s] = _mm512_loadu_si512(w + (s * Kp + k) * 64);
    }
    #pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      __m512i xb = _mm512_set1_epi32(static_cast<int>(x[m * Kp + k]));
      #pragma GCC unroll 8
      for (int s = 0; s < S; ++s) acc[s][m] = Op::dot(acc[s][m], ws[s], xb);
    }
  }
  #pragma GCC unroll 8
  for (int s = 0; s < S; ++s) op.store(acc[s], M, y, N, col0 + s * COLS, row0);
}

template <class Op, int S>
inline void block(const Op& op, int rows, const uint32_t* x, int64_t Kp, const char* w, float* y, int64_t N,
                  int64_t col0, int64_t row0) {
  switch (rows) {
    case 1: tile<Op, 1, S>(op, x, Kp, w, y, N, col0, row0); break;
    case 2: tile<Op, 2, S>(op, x, Kp, w, y, N, col0, row0); break;
    case 3: tile<Op, 3, S>(op, x, Kp, w, y, N, col0, row0); break;
    case 4: tile<Op, 4, S>(op, x, Kp, w, y, N, col0, row0); break;
    case 5: tile<Op, 5, S>(op, x, Kp, w, y, N, col0, row0); break;
    case 6: tile<Op, 6, S>(op, x, Kp, w, y, N, col0, row0); break;
    case 7: tile<Op, 7, S>(op, x, Kp, w, y, N, col0, row0); break;
    default: tile<Op, 8, S>(op, x, Kp, w, y, N, col0, row0); break;
  }
}

// Groups per tile: several weight streams in flight for few rows (memory-level parallelism), fewer
// for more rows (the accumulators of S x rows must fit the 32 vector registers with the S weights).
inline int groups_per_tile(int rows) { return rows <= 6 ? 4 : 3; }

// Run `tile(rows, first_row, groups, g0)` over every chunk of groups and every row block, chunk-major
// (each chunk of weights comes from memory once, later row blocks read it from L2).
template <typename Tile>
void for_each_tile(int64_t M, int64_t G, int64_t group_bytes, Tile tile) {
  // balanced row blocks of at most 8 (12 rows = 6 + 6, not 8 + 4: both blocks keep 4 weight streams)
  int64_t blocks = ceil_div(M, ROW_BLOCK);
  int64_t block_rows = ceil_div(M, blocks);
  int64_t S = groups_per_tile(static_cast<int>(block_rows));
  int64_t per_chunk = blocks > 1 ? std::max<int64_t>(S, (CHUNK_BYTES / group_bytes) / S * S) : S;
  int64_t chunks = ceil_div(G, per_chunk);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t g_end = std::min<int64_t>(G, (c + 1) * per_chunk);
      for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
        int rows = static_cast<int>(std::min<int64_t>(block_rows, M - m0));
        int s = groups_per_tile(rows);
        int64_t g = c * per_chunk;
        for (; g + s <= g_end; g += s) tile(rows, m0, s, g);
        for (; g < g_end; ++g) tile(rows, m0, 1, g);
      }
    }
  });
}

// y [M, N] = the product of x (M rows of Kp uint32) and the packed weights w (G groups of Kp lines).
template <class Op>
void run(const Op& op, const uint32_t* x, int64_t M, int64_t Kp, const char* w, int64_t G, float* y, int64_t N) {
  for_each_tile(M, G, Kp * 64, [&](int rows, int64_t m0, int s, int64_t g) {
    const uint32_t* xr = x + m0 * Kp;
    const char* wg = w + g * Kp * 64;
    float* yr = y + m0 * N;
    if (s == 4) block<Op, 4>(op, rows, xr, Kp, wg, yr, N, g * COLS, m0);
    else if (s == 3) block<Op, 3>(op, rows, xr, Kp, wg, yr, N, g * COLS, m0);
    else block<Op, 1>(op, rows, xr, Kp, wg, yr, N, g * COLS, m0);
  });
}

// The bias as float32 (``holder`` keeps a converted copy alive), or nullptr.
const float* float_bias(const c10::optional<torch::Tensor>& bias, torch::Tensor& holder) {
  if (!bias.has_value()) return nullptr;
  holder = bias.value().to(torch::kFloat32).contiguous();
  return holder.data_ptr<float>();
}

}  // namespace

// ---------------------------------------------------------------- bf16 API
// W [N, K] (any float dtype) -> bf16 bits [G, K2, 16, 2] as int16 (zero-padded columns and K)
torch::Tensor pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack_bf16 expects a [N, K] weight");
  int64_t N = w.size(0), K = w.size(1), G = ceil_div(N, COLS), K2 = ceil_div(K, 2);
  auto padded = torch::zeros({G * COLS, K2 * 2}, w.options().dtype(torch::kBFloat16));
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({G, COLS, K2, 2}).permute({0, 2, 1, 3}).contiguous().view(torch::kInt16);
}

// x [M, K] float32 (contiguous) -> y [M, N] float32
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == COLS && packed.size(3) == 2, "packed weight must come from pack_bf16");
  int64_t M = x.size(0), K = x.size(1), G = packed.size(0), K2 = packed.size(1);
  TORCH_CHECK(K2 == ceil_div(K, 2) && G * COLS >= N, "packed weight does not match x / N");
  // x as bf16 pairs, [M][K2] (round to nearest even, as a bf16 linear rounds its input)
  std::vector<uint32_t> xp(static_cast<size_t>(M * K2));
  const float* xs = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xs + m * K;
    uint32_t* out = xp.data() + m * K2;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + k + 16), _mm512_loadu_ps(row + k));
      _mm512_storeu_si512(out + k / 2, (__m512i)b);
    }
    for (; k < K; k += 2) {
      float pair[2] = {row[k], k + 1 < K ? row[k + 1] : 0.0f};
      __m512bh b = _mm512_cvtne2ps_pbh(_mm512_setzero_ps(), _mm512_maskz_loadu_ps(0x3, pair));
      out[k / 2] = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm512_castsi512_si128((__m512i)b)));
    }
  }
  torch::Tensor bias_f;
  auto y = torch::empty({M, N}, x.options());
  run(Bf16Op{float_bias(bias, bias_f)}, xp.data(), M, K2, reinterpret_cast<const char*>(packed.data_ptr<int16_t>()), G,
      y.data_ptr<float>(), N);
  return y;
}

// ---------------------------------------------------------------- int8 API
// W [N, K] float -> (int8 [G, K4, 16, 4], column scales float32 [G * 16], column sums int32 [G * 16])
std::vector<torch::Tensor> pack_int8(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack_int8 expects a [N, K] weight");
  auto wf = w.to(torch::kFloat32).contiguous();
  int64_t N = wf.size(0), K = wf.size(1), G = ceil_div(N, COLS), K4 = ceil_div(K, 4);
  auto scale = torch::ones({G * COLS}, wf.options());
  auto q = torch::zeros({G * COLS, K4 * 4}, wf.options().dtype(torch::kInt8));
  auto colsum = torch::zeros({G * COLS}, wf.options().dtype(torch::kInt32));
  const float* src = wf.data_ptr<float>();
  float* sc = scale.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  int32_t* cs = colsum.data_ptr<int32_t>();
  for (int64_t n = 0; n < N; ++n) {
    const float* row = src + n * K;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
    float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    sc[n] = s;
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      int v = static_cast<int>(std::nearbyint(row[k] / s));
      v = std::min(127, std::max(-127, v));
      qp[n * K4 * 4 + k] = static_cast<int8_t>(v);
      sum += v;
    }
    cs[n] = sum;
  }
  auto packed = q.view({G, COLS, K4, 4}).permute({0, 2, 1, 3}).contiguous();
  return {packed, scale, colsum};
}

// x [M, K] float32 (contiguous) -> y [M, N] float32; each row quantized to int8 with its own scale
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor wscale, torch::Tensor colsum, int64_t N,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == COLS && packed.size(3) == 4 && packed.scalar_type() == torch::kInt8,
              "packed weight must come from pack_int8");
  int64_t M = x.size(0), K = x.size(1), G = packed.size(0), K4 = packed.size(1);
  TORCH_CHECK(K4 == ceil_div(K, 4) && G * COLS >= N, "packed weight does not match x / N");
  std::vector<uint32_t> xq(static_cast<size_t>(M * K4));
  std::vector<float> xs(static_cast<size_t>(M));
  const float* src = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* row = src + m * K;
    __m512 vmax = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
    float amax = _mm512_reduce_max_ps(vmax);
    for (; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
    float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    xs[m] = s;
    __m512 inv = _mm512_set1_ps(1.0f / s);
    uint8_t* out = reinterpret_cast<uint8_t*>(xq.data() + m * K4);
    k = 0;
    for (; k + 16 <= K; k += 16) {
      __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + k), inv));  // round to nearest even
      v = _mm512_add_epi32(_mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127)),
                           _mm512_set1_epi32(128));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(v));
    }
    for (; k < K4 * 4; ++k) {
      int v = k < K ? static_cast<int>(std::nearbyint(row[k] / s)) : 0;
      out[k] = static_cast<uint8_t>(std::min(127, std::max(-127, v)) + 128);
    }
  }
  torch::Tensor bias_f;
  auto y = torch::empty({M, N}, x.options());
  Int8Op op{float_bias(bias, bias_f), colsum.data_ptr<int32_t>(), wscale.data_ptr<float>(), xs.data()};
  run(op, xq.data(), M, K4, reinterpret_cast<const char*>(packed.data_ptr<int8_t>()), G, y.data_ptr<float>(), N);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_bf16", &pack_bf16, "pack a [N, K] weight into bf16 [N/16][K/2][16][2] groups");
  m.def("linear_bf16", &linear_bf16, "small-batch bf16 linear on packed weights (float32 in and out)");
  m.def("pack_int8", &pack_int8, "pack a [N, K] weight into int8 [N/16][K/4][16][4] groups, scales, column sums");
  m.def("linear_int8", &linear_int8, "small-batch int8 linear, rows quantized per row (float32 in and out)");
}
