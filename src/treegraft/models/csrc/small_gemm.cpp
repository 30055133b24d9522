// Float32 linear for CPUs with AVX2 + FMA: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), any M (tuned for
// the 1-64 rows of a speculative decoder's forwards; PackedLinear sends prefill-sized products to MKL).
//
// Why: a speculative decoder's forwards have 1 to ~16 rows. For them a linear is a stream over the
// weights, and PyTorch's kernels either stream well for one row only (MKL's packed GEMV) or pay
// nearly a full extra pass per extra row (oneDNN, MKL GEMM): on an AVX2-only EPYC an 8960x1536 linear
// takes 3.3 ms for 1 row and 6-8 ms for 2-4. Here the weights are packed once into groups of 8
// output columns, [N/8][K][8]. Up to 4 rows read each group once, streaming several groups at once (4
// for 1-3 rows, 3 for 4) so that enough cache misses are in flight to keep the memory bus busy. More
// rows go as balanced row blocks of at most 4 over chunks of groups and K blocks that stay in cache
// (run_many). Measured on a Zen 1 EPYC (one thread, 1536 -> 8960, median of 5, noisy machine): 1 row
// 4.2 ms (oneDNN with a prepacked weight 7.1), 4 rows 5.4 (9.1), 8 rows 9.4 (12.3), 16 rows 17.3
// (20.8), 32 rows 32.4 (31.1).
//
// One packed copy serves every row count (a second, oneDNN-packed copy for wide products doubled a
// float32 model's memory). Every output is one accumulator's FMA chain over k = 0 .. K-1 whatever M
// and the tiling, so a row's result is bit-identical at every M.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

// Lanes 0 .. n - 1 of a group's 8 columns (n >= 8: all): the last group may be ragged.
inline __m256i column_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// One tile: S groups of 8 output columns x M rows over k in [k0, k1); xt is [K][8] (the M rows
// transposed, zero-padded). `resume`: the accumulators start from y's values (the partial sums of
// k < k0 stored by the previous K block), so the FMA chain of every output is the same whatever the
// blocking. (Masked loads and stores for the ragged last group: a scalar path through a stack buffer
// made the compiler keep the accumulators in memory, half the speed; so do loops it does not unroll
// before it splits the accumulator array into registers, hence the pragmas.)
template <int M, int S, bool HOIST>
inline void tile(const float* xt, int64_t K, const float* wp, float* y, int64_t N, int64_t col0,
                 int64_t k0 = 0, int64_t k1 = -1, bool resume = false) {
  if (k1 < 0) k1 = K;
  __m256 acc[S][M];
  #pragma GCC unroll 16
  for (int s = 0; s < S; ++s) {
    const float* ys = y + col0 + s * 8;
    bool full = N - col0 - s * 8 >= 8;
    __m256i cols = column_mask(N - col0 - s * 8);
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
      acc[s][m] = !resume ? _mm256_setzero_ps() : full ? _mm256_loadu_ps(ys + m * N) : _mm256_maskload_ps(ys + m * N, cols);
  }
  for (int64_t k = k0; k < k1; ++k) {
    const float* xk = xt + k * 8;
    if constexpr (HOIST) {
      __m256 xb[M];
      #pragma GCC unroll 16
      for (int m = 0; m < M; ++m) xb[m] = _mm256_broadcast_ss(xk + m);
      #pragma GCC unroll 16
      for (int s = 0; s < S; ++s) {
        __m256 w = _mm256_loadu_ps(wp + s * K * 8 + k * 8);
        #pragma GCC unroll 16
        for (int m = 0; m < M; ++m) acc[s][m] = _mm256_fmadd_ps(xb[m], w, acc[s][m]);
      }
    } else {  // the S weight vectors, then one broadcast per row: S + 1 + S * M <= 16 registers, no spill
      __m256 w[S];
      #pragma GCC unroll 16
      for (int s = 0; s < S; ++s) w[s] = _mm256_loadu_ps(wp + s * K * 8 + k * 8);
      #pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        __m256 xm = _mm256_broadcast_ss(xk + m);
        #pragma GCC unroll 16
        for (int s = 0; s < S; ++s) acc[s][m] = _mm256_fmadd_ps(xm, w[s], acc[s][m]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int s = 0; s < S; ++s) {
    float* ys = y + col0 + s * 8;
    if (N - col0 - s * 8 >= 8) {  // (a masked store is several times slower on Zen 1: only the ragged group)
      #pragma GCC unroll 16
      for (int m = 0; m < M; ++m) _mm256_storeu_ps(ys + m * N, acc[s][m]);
    } else {
      __m256i cols = column_mask(N - col0 - s * 8);
      #pragma GCC unroll 16
      for (int m = 0; m < M; ++m) _mm256_maskstore_ps(ys + m * N, cols, acc[s][m]);
    }
  }
}

template <int M, int S, bool HOIST>
void run(const float* xt, int64_t K, const float* w, float* y, int64_t N, int64_t G) {
  int64_t chunks = G / S;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) tile<M, S, HOIST>(xt, K, w + c * S * K * 8, y, N, c * S * 8);
  });
  for (int64_t g = chunks * S; g < G; ++g) tile<M, 1, HOIST>(xt, K, w + g * K * 8, y, N, g * 8);
}

// The many-row path (M > 4), GotoBLAS-style: for each chunk of groups (in L2) and each K block, a tile's
// weight panel (KC * S * 32 bytes) stays in L1 while every row block runs over it; a row block's
// accumulators go to y between K blocks and come back (`resume`), which keeps each output's FMA chain
// in k order. Streaming whole K per row block ran at half oneDNN's speed (every weight from L2), and
// 8 rows this way take 1120 ms for the 1.5B's forward where two full-K blocks took 1552 (Zen 1 EPYC).
constexpr int64_t CHUNK_BYTES = 256 * 1024;
constexpr int64_t KC = 128;
constexpr int64_t SINGLE_BLOCK_ROWS = 4;  // up to this many rows: one block, streamed from memory

template <int M, int S>
void tiles_over_rows(const std::vector<std::vector<float>>& xts, const std::vector<int64_t>& starts, int64_t K,
                     const float* wg, float* y, int64_t N, int64_t col0, int64_t k0, int64_t k1) {
  static_assert(M > 1, "balanced blocks of M or M - 1 rows");
  for (size_t b = 0; b + 1 < starts.size(); ++b) {
    int64_t mb = starts[b + 1] - starts[b];
    float* yb = y + starts[b] * N;
    const float* xt = xts[b].data();
    bool resume = k0 > 0;
    if (mb == M) tile<M, S, false>(xt, K, wg, yb, N, col0, k0, k1, resume);
    else if (mb == M - 1) tile<M - 1, S, false>(xt, K, wg, yb, N, col0, k0, k1, resume);
    else TORCH_CHECK(false, "row blocks must be balanced");
  }
}

// Blocks of at most M rows (the others one less) over G groups: S groups a tile, the chunk's last
// groups one at a time.
template <int M, int S>
void run_many(const std::vector<std::vector<float>>& xts, const std::vector<int64_t>& starts, int64_t K, const float* w,
              float* y, int64_t N, int64_t G) {
  int64_t per_chunk = std::max<int64_t>(S, CHUNK_BYTES / (K * 32) / S * S);
  int64_t chunks = (G + per_chunk - 1) / per_chunk;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t g_end = std::min<int64_t>(G, (c + 1) * per_chunk);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t k1 = std::min<int64_t>(K, k0 + KC);
        int64_t g = c * per_chunk;
        for (; g + S <= g_end; g += S) tiles_over_rows<M, S>(xts, starts, K, w + g * K * 8, y, N, g * 8, k0, k1);
        for (; g < g_end; ++g) tiles_over_rows<M, 1>(xts, starts, K, w + g * K * 8, y, N, g * 8, k0, k1);
      }
    }
  });
}

void dispatch(int64_t m, const float* xt, int64_t K, const float* w, float* y, int64_t N, int64_t G) {
  switch (m) {
    case 1: run<1, 4, true>(xt, K, w, y, N, G); break;
    case 2: run<2, 4, true>(xt, K, w, y, N, G); break;
    case 3: run<3, 4, true>(xt, K, w, y, N, G); break;
    default: run<4, 3, false>(xt, K, w, y, N, G); break;
  }
}

}  // namespace

// W [N, K] float32 -> [ceil(N / 8), K, 8] (zero-padded columns)
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32, "pack expects a float32 [N, K] weight");
  int64_t N = w.size(0), K = w.size(1), G = (N + 7) / 8;
  auto padded = torch::zeros({G * 8, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({G, 8, K}).transpose(1, 2).contiguous();
}

// x [M, K] float32 (contiguous), packed from `pack`, N output features -> y [M, N]
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  int64_t M = x.size(0), K = x.size(1), G = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && packed.size(2) == 8, "packed weight does not match x");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  // rows m0 .. m0 + mb - 1 of x transposed to [K][8], zero-padded
  auto transposed = [&](int64_t m0, int64_t mb) {
    std::vector<float> xt(static_cast<size_t>(K) * 8, 0.0f);
    for (int64_t m = 0; m < mb; ++m)
      for (int64_t k = 0; k < K; ++k) xt[k * 8 + m] = xp[(m0 + m) * K + k];
    return xt;
  };
  if (M <= SINGLE_BLOCK_ROWS) {
    auto xt = transposed(0, M);
    dispatch(M, xt.data(), K, packed.data_ptr<float>(), y.data_ptr<float>(), N, G);
  } else {
    // balanced row blocks of at most 4 (4 rows x 3 groups = 12 accumulators; 6 x 2 measured slower):
    // 5 rows = 3 + 2, 9 = 3 + 3 + 3, 12 = 4 + 4 + 4
    int64_t blocks = (M + 3) / 4;
    std::vector<int64_t> starts(blocks + 1);
    std::vector<std::vector<float>> xts(blocks);
    for (int64_t b = 0; b <= blocks; ++b) starts[b] = (M * b) / blocks;
    at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) xts[b] = transposed(starts[b], starts[b + 1] - starts[b]);
    });
    // M > 4 rows in ceil(M / 4) blocks: the largest holds 3 (M = 5, 6) or 4 rows
    if ((M + blocks - 1) / blocks == 4) run_many<4, 3>(xts, starts, K, packed.data_ptr<float>(), y.data_ptr<float>(), N, G);
    else run_many<3, 4>(xts, starts, K, packed.data_ptr<float>(), y.data_ptr<float>(), N, G);
  }
  if (bias.has_value()) y.add_(bias.value());
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack a float32 [N, K] weight into [N/8][K][8] groups");
  m.def("linear", &linear, "small-batch float32 linear on packed weights");
}
