// Index builders for GPT datasets: the sample index over shuffled documents and the greedy
// blending index over weighted datasets, with megatron-core's semantics.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// Sample i spans document_idx[out[i][0]] at offset out[i][1] up to document_idx[out[i+1][0]] at
// offset out[i+1][1] (plus add_extra tokens), so consecutive samples overlap by add_extra tokens.
// Returns false if document_idx names a document outside sizes.
template <typename T, typename D>
bool fill_sample_idx(const int32_t *sizes, int64_t num_sizes, const D *document_idx, int64_t num_docs,
                     int32_t seq_length, int64_t num_samples, int32_t add_extra, T *out) {
  int64_t doc_pos = 0;   // position in document_idx
  int64_t doc_offset = 0;  // tokens of that document already used
  out[0] = 0;
  out[1] = 0;
  for (int64_t s = 1; s <= num_samples; ++s) {
    int64_t remaining = static_cast<int64_t>(seq_length) + add_extra;
    while (remaining != 0) {
      const int64_t doc = static_cast<int64_t>(document_idx[doc_pos]);
      if (doc < 0 || doc >= num_sizes) return false;
      const int64_t doc_length = static_cast<int64_t>(sizes[doc]) - doc_offset;
      remaining -= doc_length;
      if (remaining <= 0) {
        // The sample ends inside this document; the next one starts add_extra tokens earlier.
        doc_offset += remaining + doc_length - add_extra;
        remaining = 0;
      } else if (doc_pos == num_docs - 1) {
        // Out of documents: only reachable for the last, partial sample.
        doc_offset = static_cast<int64_t>(sizes[doc]) - add_extra;
        break;
      } else {
        ++doc_pos;
        doc_offset = 0;
      }
    }
    out[2 * s] = static_cast<T>(doc_pos);
    out[2 * s + 1] = static_cast<T>(doc_offset);
  }
  return true;
}

template <typename T>
py::array_t<T> build_sample_idx(py::array_t<int32_t, py::array::c_style> sizes, py::array document_idx,
                                int32_t seq_length, int32_t num_epochs, int64_t tokens_per_epoch,
                                bool drop_last_partial_sequence, int32_t add_extra_token_to_sequence) {
  if (sizes.ndim() != 1 || document_idx.ndim() != 1)
    throw std::invalid_argument("sizes and document_idx must be 1-D arrays");
  if (seq_length < 1) throw std::invalid_argument("seq_length must be >= 1, got " + std::to_string(seq_length));
  if (num_epochs < 1) throw std::invalid_argument("num_epochs must be >= 1, got " + std::to_string(num_epochs));
  if (tokens_per_epoch < 1)
    throw std::invalid_argument("tokens_per_epoch must be >= 1, got " + std::to_string(tokens_per_epoch));
  if (add_extra_token_to_sequence < 0 || add_extra_token_to_sequence > 1)
    throw std::invalid_argument("add_extra_token_to_sequence must be 0 or 1");
  if (document_idx.shape(0) == 0) throw std::invalid_argument("document_idx is empty");
  if (!(document_idx.flags() & py::array::c_style)) throw std::invalid_argument("document_idx must be contiguous");

  const int64_t total = static_cast<int64_t>(num_epochs) * tokens_per_epoch - add_extra_token_to_sequence;
  const int64_t num_samples =
      drop_last_partial_sequence ? total / seq_length : (total + seq_length - 1) / seq_length;
  py::array_t<T> out({num_samples + 1, static_cast<int64_t>(2)});
  T *out_ptr = out.mutable_data();
  const int32_t *sizes_ptr = sizes.data();
  const int64_t num_sizes = sizes.shape(0);
  const int64_t num_docs = document_idx.shape(0);
  const auto kind = document_idx.dtype();
  bool ok = false;
  if (kind.is(py::dtype::of<int32_t>())) {
    const auto *docs = static_cast<const int32_t *>(document_idx.data());
    py::gil_scoped_release release;
    ok = fill_sample_idx<T, int32_t>(sizes_ptr, num_sizes, docs, num_docs, seq_length, num_samples,
                                     add_extra_token_to_sequence, out_ptr);
  } else if (kind.is(py::dtype::of<int64_t>())) {
    const auto *docs = static_cast<const int64_t *>(document_idx.data());
    py::gil_scoped_release release;
    ok = fill_sample_idx<T, int64_t>(sizes_ptr, num_sizes, docs, num_docs, seq_length, num_samples,
                                     add_extra_token_to_sequence, out_ptr);
  } else {
    throw std::invalid_argument("document_idx must be int32 or int64");
  }
  if (!ok)
    throw std::invalid_argument("document_idx holds a document outside sizes (0.." + std::to_string(num_sizes - 1) + ")");
  return out;
}

// Greedy blending: each sample goes to the dataset whose count lags its target share the most.
void build_blending_indices(py::array_t<int16_t, py::array::c_style> dataset_index,
                            py::array_t<int64_t, py::array::c_style> dataset_sample_index,
                            py::array_t<double, py::array::c_style> weights, int32_t num_datasets, int64_t size,
                            bool verbose) {
  if (num_datasets < 1 || weights.shape(0) < num_datasets)
    throw std::invalid_argument("weights must hold num_datasets (>= 1) entries");
  if (dataset_index.shape(0) < size || dataset_sample_index.shape(0) < size)
    throw std::invalid_argument("dataset_index and dataset_sample_index must hold at least size entries");
  auto index = dataset_index.mutable_unchecked<1>();
  auto sample_index = dataset_sample_index.mutable_unchecked<1>();
  const double *w = weights.data();
  std::vector<int64_t> current(num_datasets, 0);
  {
    py::gil_scoped_release release;
    for (int64_t i = 0; i < size; ++i) {
      const double position = std::max(static_cast<double>(i), 1.0);
      int32_t best = 0;
      double best_error = w[0] * position - static_cast<double>(current[0]);
      for (int32_t d = 1; d < num_datasets; ++d) {
        const double error = w[d] * position - static_cast<double>(current[d]);
        if (error > best_error) {
          best_error = error;
          best = d;
        }
      }
      index(i) = static_cast<int16_t>(best);
      sample_index(i) = current[best];
      ++current[best];
    }
  }
  if (verbose) {
    for (int32_t d = 0; d < num_datasets; ++d) {
      const double achieved = size ? static_cast<double>(current[d]) / static_cast<double>(size) : 0.0;
      py::print("dataset", d, "target weight", w[d], "achieved", achieved);
    }
  }
}

}  // namespace


PYBIND11_MODULE(_index, m) {
  m.doc() = "Index builders for GPT datasets (sample index, blending index).";
  const char *sample_doc =
      "Sample index [num_samples + 1, 2] of (position in document_idx, token offset) over the "
      "documents in document_idx order.";
  m.def("build_sample_idx_int32", &build_sample_idx<int32_t>, sample_doc, py::arg("sizes"), py::arg("document_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        py::arg("drop_last_partial_sequence") = true, py::arg("add_extra_token_to_sequence") = 1);
  m.def("build_sample_idx_int64", &build_sample_idx<int64_t>, sample_doc, py::arg("sizes"), py::arg("document_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        py::arg("drop_last_partial_sequence") = true, py::arg("add_extra_token_to_sequence") = 1);
  m.def("build_blending_indices", &build_blending_indices,
        "Fill dataset_index/dataset_sample_index in place by greedy blending of weighted datasets.",
        py::arg("dataset_index"), py::arg("dataset_sample_index"), py::arg("weights"), py::arg("num_datasets"),
        py::arg("size"), py::arg("verbose") = false);
}
