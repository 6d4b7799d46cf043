// Ascending sort of each row's float32 values for hf-dflash's top-p warper (`hf_dflash.decoding.compiled_kernels`
// builds and loads it; `TopPBySortedValues` in `hf_dflash.decoding.speculative` calls it).
//
// sorted_values(x [n, V] float32) -> [n, V]: each row's values in ascending order, the same sequence NumPy's and
// torch's sorts give (a sorted sequence of values is unique up to the order of -0.0 and +0.0, which compare equal,
// and here -0.0 comes first). NaNs are the caller's to exclude: this orders them by their bits, not last.
//
// An LSD radix sort on the values' bits: each float mapped to an unsigned key that orders as the float does (negative
// values: all bits flipped; the others: the sign bit set), three stable counting passes over 11, 11 and 10 bits, the
// keys mapped back. Every digit's histogram comes from one read of the keys, and a pass whose digit is the same for
// every value is skipped. About 0.15 ms a row of SmolLM2's 49,152 values on one Zen 4 core, against 1.0 ms for
// NumPy's sort.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kPasses = 3;
constexpr std::array<int, kPasses> kShift = {0, 11, 22};
constexpr std::array<uint32_t, kPasses> kMask = {0x7FF, 0x7FF, 0x3FF};
constexpr int kBins = 2048;

inline uint32_t key_of(uint32_t bits) { return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u); }
inline uint32_t bits_of(uint32_t key) { return (key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key; }

// One row: `values` [length] -> `out` [length], ascending; `keys` and `spare` are scratch of `length` each.
void sort_row(const float* values, float* out, int64_t length, uint32_t* keys, uint32_t* spare) {
  std::vector<std::array<int64_t, kBins>> counts(kPasses);
  for (auto& count : counts) count.fill(0);
  for (int64_t i = 0; i < length; ++i) {
    uint32_t bits;
    std::memcpy(&bits, values + i, sizeof(bits));
    const uint32_t key = key_of(bits);
    keys[i] = key;
    for (int pass = 0; pass < kPasses; ++pass) ++counts[pass][(key >> kShift[pass]) & kMask[pass]];
  }
  uint32_t* source = keys;
  uint32_t* target = spare;
  for (int pass = 0; pass < kPasses; ++pass) {
    auto& count = counts[pass];
    if (count[(source[0] >> kShift[pass]) & kMask[pass]] == length) continue;  // one digit for all: order unchanged
    int64_t offset = 0;
    for (auto& bin : count) {  // counts -> each digit's first output slot
      const int64_t size = bin;
      bin = offset;
      offset += size;
    }
    for (int64_t i = 0; i < length; ++i) target[count[(source[i] >> kShift[pass]) & kMask[pass]]++] = source[i];
    std::swap(source, target);
  }
  for (int64_t i = 0; i < length; ++i) {
    const uint32_t bits = bits_of(source[i]);
    std::memcpy(out + i, &bits, sizeof(bits));
  }
}

at::Tensor sorted_values(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "sorted_values: expected a 2D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type(), " on ",
              x.device());
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty_like(input);
  const int64_t rows = input.size(0), length = input.size(1);
  if (length == 0) return out;
  const float* in_data = input.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> keys(length), spare(length);
    for (int64_t row = begin; row < end; ++row)
      sort_row(in_data + row * length, out_data + row * length, length, keys.data(), spare.data());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_dflash, m) { m.def("sorted_values(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(hf_dflash, CPU, m) { m.impl("sorted_values", &sorted_values); }
