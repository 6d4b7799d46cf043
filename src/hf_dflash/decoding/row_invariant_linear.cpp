// Row-invariant bf16 linear for hf-dflash's exact CPU mode (`hf_dflash.decoding.compiled_kernels` builds and loads it).
//
// out[m, n] = bf16(sum over k of x[m, k] * w[n, k] (+ bias[n])), each output element summed by one AVX512-BF16
// instruction sequence: one fp32 accumulator per 16 output columns, `vdpbf16ps` over the input pairs (2k, 2k + 1) in
// order k = 0, 1, ..., then the bias in fp32 and one round to bf16. The rows and column blocks a call holds only decide
// which accumulators are live at once (tiles of up to 4 rows x 4 blocks), never the order of an element's sums, so a
// row's bits do not depend on how many rows share the call: a 1-row decoding step runs a 1-row product with the bits
// that row gets inside a verify block, where oneDNN's kernels need every call padded to one row count.
//
// The weight is packed once (`pack_row_invariant_linear`): [ceil(N / 16), K / 2, 16, 2] bf16, each block of 16 output
// columns contiguous over k, the pairs of k adjacent (what `vdpbf16ps` multiplies), columns past N zero.
//
// Built with -march=native: on a CPU without AVX512-BF16 this file registers nothing, and exact mode keeps its padded
// products (`compiled_linear()` says so).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

constexpr int64_t kColumns = 16;    // output columns per accumulator (one AVX-512 register of fp32)
constexpr int64_t kTileRows = 4;    // rows computed together
constexpr int64_t kTileBlocks = 4;  // column blocks computed together

// A tile of `rows` x `blocks` accumulators over the whole reduction, then bias, rounding and the store.
template <int64_t rows, int64_t blocks>
void tile(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t pairs, const float* bias, uint16_t* out,
          int64_t out_stride, int64_t first_column, int64_t out_features) {
  __m512 acc[rows][blocks];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) acc[r][b] = _mm512_setzero_ps();
  const int64_t block_stride = pairs * 2 * kColumns;  // bf16 values per packed column block
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh weights[blocks];
    for (int64_t b = 0; b < blocks; ++b)
      weights[b] = (__m512bh)_mm512_loadu_si512(w + b * block_stride + p * 2 * kColumns);
    for (int64_t r = 0; r < rows; ++r) {
      int32_t pair;
      __builtin_memcpy(&pair, x + r * x_stride + 2 * p, sizeof(pair));
      const __m512bh inputs = (__m512bh)_mm512_set1_epi32(pair);
      for (int64_t b = 0; b < blocks; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], inputs, weights[b]);
    }
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t column = first_column + b * kColumns;
    const int64_t valid = std::min(kColumns, out_features - column);
    const __mmask16 mask = valid >= kColumns ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    const __m512 added = bias ? _mm512_maskz_loadu_ps(mask, bias + column) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][b], added));
      _mm256_mask_storeu_epi16(out + r * out_stride + column, mask, (__m256i)rounded);
    }
  }
}

template <int64_t rows>
void row_tile(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t pairs, const float* bias, uint16_t* out,
              int64_t out_stride, int64_t first_block, int64_t blocks, int64_t out_features) {
  const int64_t block_stride = pairs * 2 * kColumns;
  const uint16_t* block_w = w + first_block * block_stride;
  const int64_t column = first_block * kColumns;
  switch (blocks) {
    case 4: return tile<rows, 4>(x, x_stride, block_w, pairs, bias, out, out_stride, column, out_features);
    case 3: return tile<rows, 3>(x, x_stride, block_w, pairs, bias, out, out_stride, column, out_features);
    case 2: return tile<rows, 2>(x, x_stride, block_w, pairs, bias, out, out_stride, column, out_features);
    default: return tile<rows, 1>(x, x_stride, block_w, pairs, bias, out, out_stride, column, out_features);
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "row_invariant_linear: x must be [M, K] bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == kColumns &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "row_invariant_linear: the weight must come from pack_row_invariant_linear");
  TORCH_CHECK(packed.size(1) * 2 == x.size(1), "row_invariant_linear: x has ", x.size(1), " features, the weight ",
              packed.size(1) * 2);
  TORCH_CHECK(packed.size(0) * kColumns >= out_features && out_features > (packed.size(0) - 1) * kColumns,
              "row_invariant_linear: out_features does not match the packed weight");
}

}  // namespace

// [N, K] bf16 (K even) -> [ceil(N / 16), K / 2, 16, 2]: block c, pair p, column j, half h holds w[16c + j, 2p + h].
at::Tensor pack_row_invariant_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_row_invariant_linear: [N, K] bf16");
  TORCH_CHECK(weight.size(1) % 2 == 0, "pack_row_invariant_linear: K must be even, got ", weight.size(1));
  const int64_t n = weight.size(0), k = weight.size(1), blocks = (n + kColumns - 1) / kColumns;
  at::Tensor padded = at::zeros({blocks * kColumns, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({blocks, kColumns, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor row_invariant_linear(const at::Tensor& x_in, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                                int64_t out_features) {
  const at::Tensor x = x_in.contiguous();
  check_inputs(x, packed, out_features);
  at::Tensor fp32_bias;
  if (bias.has_value() && bias->defined()) fp32_bias = bias->to(at::kFloat).contiguous();
  const int64_t m = x.size(0), pairs = packed.size(1), blocks = packed.size(0);
  at::Tensor out = at::empty({m, out_features}, x.options());
  const auto* x_data = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* w_data = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* out_data = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* bias_data = fp32_bias.defined() ? fp32_bias.data_ptr<float>() : nullptr;
  const int64_t k = x.size(1);
  // threads split the column-block groups: a row's element is summed in one place whatever the split
  const int64_t groups = (blocks + kTileBlocks - 1) / kTileBlocks;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group) {
      const int64_t first_block = group * kTileBlocks, count = std::min(kTileBlocks, blocks - first_block);
      for (int64_t row = 0; row < m; row += kTileRows) {
        const uint16_t* x_rows = x_data + row * k;
        uint16_t* out_rows = out_data + row * out_features;
        switch (std::min(kTileRows, m - row)) {
          case 4: row_tile<4>(x_rows, k, w_data, pairs, bias_data, out_rows, out_features, first_block, count, out_features); break;
          case 3: row_tile<3>(x_rows, k, w_data, pairs, bias_data, out_rows, out_features, first_block, count, out_features); break;
          case 2: row_tile<2>(x_rows, k, w_data, pairs, bias_data, out_rows, out_features, first_block, count, out_features); break;
          default: row_tile<1>(x_rows, k, w_data, pairs, bias_data, out_rows, out_features, first_block, count, out_features);
        }
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(hf_dflash, m) {
  m.def("pack_row_invariant_linear(Tensor weight) -> Tensor");
  m.def("row_invariant_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_dflash, CPU, m) {
  m.impl("pack_row_invariant_linear", &pack_row_invariant_linear);
  m.impl("row_invariant_linear", &row_invariant_linear);
}

#endif  // AVX512-BF16
