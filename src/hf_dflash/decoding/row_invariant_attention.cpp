// Row-invariant attention for hf-dflash's exact CPU mode (`hf_dflash.decoding.compiled_kernels` builds and loads it).
//
// Every output row is computed by the same code from its own query and its allowed keys, in cache order, whatever
// else shares the call: no blocking by the number of query rows or keys, no threads splitting a row, and no FP
// contraction (built with -ffp-contract=off), so a row's bits do not depend on the call it comes in. Keys and values
// are read in their dtype (fp32, bf16 or fp16); scores and sums are fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <future>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kParallelPairs = 8192;  // (query row, key) pairs from which a call is worth splitting over threads

// GCC/Clang vector types: one AVX-512 register, or two AVX2 / four SSE ones, with the same per-lane results.
typedef float Lanes16 __attribute__((vector_size(16 * sizeof(float))));
typedef float Lanes8 __attribute__((vector_size(8 * sizeof(float))));
typedef float Lanes4 __attribute__((vector_size(4 * sizeof(float))));

template <typename T>
inline Lanes16 load16(const T* values) {
  Lanes16 lanes;
  for (int64_t lane = 0; lane < kLanes; ++lane) lanes[lane] = static_cast<float>(values[lane]);
  return lanes;
}

template <>
inline Lanes16 load16<float>(const float* values) {
  Lanes16 lanes;
  std::memcpy(&lanes, values, sizeof(lanes));
  return lanes;
}

// q . k in one fixed order: lane l sums the products at l, l + 16, ... (a remainder past the last 16 goes to lanes
// 0, 1, ...), then lanes l and l + 8 are added, then l and l + 4, then (0 + 2) + (1 + 3).
template <typename T>
inline float dot(const float* __restrict__ q, const T* __restrict__ k, int64_t dim) {
  Lanes16 sum = {};
  const int64_t full = dim - dim % kLanes;
  for (int64_t start = 0; start < full; start += kLanes) sum += load16(q + start) * load16(k + start);
  for (int64_t d = full; d < dim; ++d) sum[d - full] += q[d] * static_cast<float>(k[d]);
  // the halves taken in registers (copies through memory stall on store forwarding)
  const Lanes8 eight = __builtin_shufflevector(sum, sum, 0, 1, 2, 3, 4, 5, 6, 7) +
                       __builtin_shufflevector(sum, sum, 8, 9, 10, 11, 12, 13, 14, 15);
  const Lanes4 four =
      __builtin_shufflevector(eight, eight, 0, 1, 2, 3) + __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
  return (four[0] + four[2]) + (four[1] + four[3]);
}

// e^x for x <= 0 (a score minus its row's maximum), to about 2 ulp: Cephes' expf polynomial, written out so the
// compiler can vectorize a loop of it (std::exp is a library call per element). Plain IEEE operations, so a value
// gets the same bits in a vector lane and in a scalar remainder.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // keeps 2^n normal; e^-87 is 1.6e-38 against the row maximum's 1
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // x - n ln 2, ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * (r * r) + r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

struct Shapes {
  int64_t batch, kv_heads, queries, group, keys, dim;
};

// Scratch space of one thread, reused from item to item.
struct Scratch {
  std::vector<int64_t> kept;
  std::vector<float> query, scores, sums, best, total;
};

constexpr int64_t kHeldGroups = 4;  // query heads of one kv head whose running values are held in registers together

// run(std::integral_constant<int64_t, G>{}, g0) for each block of G <= kHeldGroups query heads from head g0.
template <typename Run>
void in_held_groups(int64_t group, const Run& run) {
  for (int64_t g0 = 0; g0 < group; g0 += kHeldGroups) {
    switch (std::min(kHeldGroups, group - g0)) {
      case 1: run(std::integral_constant<int64_t, 1>{}, g0); break;
      case 2: run(std::integral_constant<int64_t, 2>{}, g0); break;
      case 3: run(std::integral_constant<int64_t, 3>{}, g0); break;
      default: run(std::integral_constant<int64_t, 4>{}, g0); break;
    }
  }
}

// Up to kHeldGroups query heads of one kv head: their fp32 queries [G, dim], scores [G, count] and row maxima [G].
struct Heads {
  const float* queries;
  float* scores;
  float* best;
};

// scores[g][n] = q_g . key[kept[n]] * scale (soft-capped), for n in cache order; best[g] their maximum. Each score is
// the same `dot` as ever; the maxima are held in registers.
template <int64_t G, typename T>
void head_scores(const Heads& heads, const T* __restrict__ key, const int64_t* __restrict__ kept, int64_t count,
                 int64_t dim, float scale, float softcap) {
  float best[G];
  for (int64_t g = 0; g < G; ++g) best[g] = -std::numeric_limits<float>::infinity();
  for (int64_t n = 0; n < count; ++n) {
    const T* k = key + kept[n] * dim;
    for (int64_t g = 0; g < G; ++g) {
      float score = dot(heads.queries + g * dim, k, dim) * scale;
      if (softcap > 0.f) score = std::tanh(score / softcap) * softcap;
      heads.scores[g * count + n] = score;
      best[g] = std::max(best[g], score);
    }
  }
  for (int64_t g = 0; g < G; ++g) heads.best[g] = best[g];
}

// For G query heads of one kv head: totals[g] = sum of probs[g][n] and sums[g] = sum of probs[g][n] * value[kept[n]],
// both over n in cache order, one key at a time (each element the same products and sums, in the same order, as a
// plain loop); the running sums stay in registers, 16 value lanes at a time. probs [G, count]; sums [G, dim], zeros.
template <int64_t G, typename T>
void weighted_values(const float* __restrict__ probs, int64_t count, const int64_t* __restrict__ kept,
                     const T* __restrict__ value, int64_t dim, float* __restrict__ totals, float* __restrict__ sums) {
  float total[G] = {};
  for (int64_t n = 0; n < count; ++n)
    for (int64_t g = 0; g < G; ++g) total[g] += probs[g * count + n];
  for (int64_t g = 0; g < G; ++g) totals[g] = total[g];
  const int64_t full = dim - dim % kLanes;
  for (int64_t d = 0; d < full; d += kLanes) {
    Lanes16 acc[G] = {};
    for (int64_t n = 0; n < count; ++n) {
      const Lanes16 v = load16(value + kept[n] * dim + d);
      for (int64_t g = 0; g < G; ++g) acc[g] += probs[g * count + n] * v;
    }
    for (int64_t g = 0; g < G; ++g) std::memcpy(sums + g * dim + d, &acc[g], sizeof(Lanes16));
  }
  for (int64_t n = 0; n < count; ++n) {  // the lanes past the last 16, as a plain loop
    const T* v = value + kept[n] * dim;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = full; d < dim; ++d) sums[g * dim + d] += probs[g * count + n] * static_cast<float>(v[d]);
  }
}

// One query position of one kv head: its `group` query heads attend to the keys `allowed` lets through.
// query [group, dim], key/value [keys, dim], allowed [keys]; out: `group` fp32 rows of `dim`, one after the other.
template <typename T>
void attend(const T* query, const T* key, const T* value, const bool* allowed, const Shapes& s, float scale,
            float softcap, float* out, Scratch& scratch) {
  auto& kept = scratch.kept;
  kept.clear();
  for (int64_t j = 0; j < s.keys; ++j)
    if (allowed[j]) kept.push_back(j);
  const int64_t count = static_cast<int64_t>(kept.size());
  scratch.query.resize(s.group * s.dim);
  for (int64_t x = 0; x < s.group * s.dim; ++x) scratch.query[x] = static_cast<float>(query[x]);
  auto& scores = scratch.scores;
  scores.resize(s.group * count);
  scratch.best.resize(s.group);
  in_held_groups(s.group, [&](auto held, int64_t g0) {
    const Heads heads{scratch.query.data() + g0 * s.dim, scores.data() + g0 * count, scratch.best.data() + g0};
    head_scores<decltype(held)::value>(heads, key, kept.data(), count, s.dim, scale, softcap);
  });
  for (int64_t g = 0; g < s.group; ++g) {
    float* __restrict__ row = scores.data() + g * count;
    const float top = scratch.best[g];
    for (int64_t n = 0; n < count; ++n) row[n] = exp_nonpositive(row[n] - top);  // element-wise
  }
  scratch.total.assign(s.group, 0.f);
  scratch.sums.assign(s.group * s.dim, 0.f);
  in_held_groups(s.group, [&](auto held, int64_t g0) {
    weighted_values<decltype(held)::value>(scores.data() + g0 * count, count, kept.data(), value, s.dim,
                                           scratch.total.data() + g0, scratch.sums.data() + g0 * s.dim);
  });
  for (int64_t g = 0; g < s.group; ++g) {
    const float norm = scratch.total[g] > 0.f ? scratch.total[g] : 1.f;  // a row with no key (padding) gets zeros
    for (int64_t d = 0; d < s.dim; ++d) out[g * s.dim + d] = scratch.sums[g * s.dim + d] / norm;
  }
}

// Runs `run(begin, end)` over [0, items): in one range when the work is small, else in one range per torch thread,
// ranges 1.. on torch's inter-op threads and range 0 on this one (no OpenMP here: one runtime, torch's).
template <typename Run>
void in_ranges(int64_t items, int64_t pairs, const Run& run) {
  const int64_t parts = pairs < kParallelPairs ? 1 : std::min<int64_t>(at::get_num_threads(), items);
  std::vector<std::future<void>> others;
  for (int64_t part = 1; part < parts; ++part) {
    auto task = std::make_shared<std::promise<void>>();
    others.push_back(task->get_future());
    at::launch([&run, task, begin = items * part / parts, end = items * (part + 1) / parts] {
      try {
        run(begin, end);
        task->set_value();
      } catch (...) {
        task->set_exception(std::current_exception());
      }
    });
  }
  run(0, items / parts);
  for (auto& other : others) other.get();
}

// Every item (b, kv head, query) computed whole by the thread whose range holds it.
template <typename T>
void run_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
               const Shapes& s, double scale, double softcap, at::Tensor& out, int64_t items) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  in_ranges(items, items * s.group * s.keys, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (s.kv_heads * s.queries), h = (item / s.queries) % s.kv_heads, i = item % s.queries;
      attend(qp + item * s.group * s.dim, kp + (b * s.kv_heads + h) * s.keys * s.dim,
             vp + (b * s.kv_heads + h) * s.keys * s.dim, mp + (b * s.queries + i) * s.keys, s,
             static_cast<float>(scale), static_cast<float>(softcap),
             op + ((b * s.queries + i) * s.kv_heads + h) * s.group * s.dim, scratch);
    }
  });
}

// query [b, kv_heads, q, group, d], key/value [b, kv_heads, keys, d] (one dtype: fp32, bf16 or fp16), allowed
// [b, q, keys] (bool) -> [b, q, kv_heads * group, d] (fp32)
at::Tensor row_invariant_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                   const at::Tensor& allowed, double scale, double softcap) {
  TORCH_CHECK(query.dim() == 5 && key.dim() == 4 && value.sizes() == key.sizes() && allowed.dim() == 3,
              "row_invariant_attention: unexpected shapes");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && value.scalar_type() == key.scalar_type() &&
                  allowed.scalar_type() == at::kBool,
              "row_invariant_attention: query, key and value of one dtype and a bool mask expected");
  const auto q = query.contiguous(), k = key.contiguous(), v = value.contiguous(), mask = allowed.contiguous();
  const Shapes s{q.size(0), q.size(1), q.size(2), q.size(3), k.size(2), q.size(4)};
  TORCH_CHECK(k.size(0) == s.batch && k.size(1) == s.kv_heads && k.size(3) == s.dim && mask.size(0) == s.batch &&
                  mask.size(1) == s.queries && mask.size(2) == s.keys,
              "row_invariant_attention: query, key and mask disagree");
  auto out = at::empty({s.batch, s.queries, s.kv_heads * s.group, s.dim}, q.options().dtype(at::kFloat));
  const int64_t items = s.batch * s.kv_heads * s.queries;
  AT_DISPATCH_SWITCH(k.scalar_type(), "row_invariant_attention",
    AT_DISPATCH_CASE(at::kFloat, [&] { run_typed<scalar_t>(q, k, v, mask, s, scale, softcap, out, items); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { run_typed<scalar_t>(q, k, v, mask, s, scale, softcap, out, items); })
    AT_DISPATCH_CASE(at::kHalf, [&] { run_typed<scalar_t>(q, k, v, mask, s, scale, softcap, out, items); }));
  return out;
}

}  // namespace

TORCH_LIBRARY(hf_dflash, m) {
  m.def("row_invariant_attention(Tensor query, Tensor key, Tensor value, Tensor allowed, float scale, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_dflash, CPU, m) { m.impl("row_invariant_attention", &row_invariant_attention); }
