// A decode step's attention read from the paged cache where it lies, for bench/cpu_attention.py.
//
// One query token per sequence (row s of `query` is sequence s's), fp32 throughout. For each
// sequence and KV head, every position p of the context is found through the block table
// (block tables[s][p / B], slot p % B) and read in place: no gather, no padding, no mask. The
// scores of the KV head's G query heads go to a buffer, are softmaxed, and weight the values.
// The jobs (sequence, KV head) are shared among torch's threads. A measurement, not a part of
// the package: chapter 5.2 says what it showed.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor layer, torch::Tensor tables,
                           torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dtype() == torch::kFloat32 && layer.dtype() == torch::kFloat32,
              "fp32 query and cache only");
  TORCH_CHECK(query.is_contiguous() && layer.is_contiguous(), "contiguous query and cache only");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && seq_lens.dtype() == torch::kInt64,
              "int64 block tables and lengths only");
  const int64_t num_seqs = seq_lens.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t block = layer.size(2), width = layer.size(3), kv_heads = width / dim;
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(query.size(0) == num_seqs, "one query row per sequence");
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* cache = layer.data_ptr<float>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* lengths = seq_lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const int64_t table_stride = tables.stride(0), block_stride = layer.stride(0);
  const int64_t half_stride = layer.stride(1);  // keys, then values, in each block
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t s = job / kv_heads, g = job % kv_heads, length = lengths[s];
      const float* rows = q + (s * heads + g * group) * dim;
      auto position = [&](int64_t p) {  // where position p's key of KV head g lies
        return cache + table[s * table_stride + p / block] * block_stride + (p % block) * width
               + g * dim;
      };
      scores.assign(group * length, 0.f);
      for (int64_t p = 0; p < length; ++p) {
        const float* key = position(p);
        for (int64_t h = 0; h < group; ++h) {
          float dot = 0.f;
          for (int64_t d = 0; d < dim; ++d) dot += rows[h * dim + d] * key[d];
          scores[h * length + p] = dot * static_cast<float>(scale);
        }
      }
      for (int64_t h = 0; h < group; ++h) {  // softmax of each query head's row of scores
        float* row = scores.data() + h * length;
        const float top = *std::max_element(row, row + length);
        float sum = 0.f;
        for (int64_t p = 0; p < length; ++p) sum += (row[p] = std::exp(row[p] - top));
        for (int64_t p = 0; p < length; ++p) row[p] /= sum;
      }
      float* answer = o + (s * heads + g * group) * dim;
      std::fill(answer, answer + group * dim, 0.f);
      for (int64_t p = 0; p < length; ++p) {
        const float* value = position(p) + half_stride;
        for (int64_t h = 0; h < group; ++h) {
          const float weight = scores[h * length + p];
          for (int64_t d = 0; d < dim; ++d) answer[h * dim + d] += weight * value[d];
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention read in place from the paged cache");
}
