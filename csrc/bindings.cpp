// The only file that registers ops: spec_kernels::compact_kv_ with CPU, CUDA and Meta kernels, and
// spec_kernels::linear (csrc/linear_cpu.cpp), spec_kernels::quant_linear (csrc/quant_linear_cpu.cpp) and
// spec_kernels::decoder_layers (csrc/decoder_layers_cpu.cpp) with CPU and Meta kernels, the native step runners
// spec_kernels::draft_chain, plain_steps, eagle3_draft, spec_chain and tree_step (csrc/runner_cpu.cpp) with the class
// spec_kernels.NativeModel they take (csrc/native_model.h),
// spec_kernels::verify_greedy (csrc/verify_tree_cpu.cpp: verify_tree's all-greedy CPU walk),
// spec_kernels::keep_threshold (csrc/keep_threshold_cpu.cpp: the sampling filters' threshold), and the class
// spec_kernels.SuffixTree (csrc/suffix_tree_cpu.cpp: suffix decoding's tree).
//
// Also the torch-facing half of the CUDA path (shape checks, device guard, current stream): nvcc 13 cannot compile
// torch's CUDA headers, so csrc/compact_kv.cu stays torch-free and this host-compiled file calls its raw launcher.
// CUDA parts build only with -DSPECDEC_WITH_CUDA (set by spec_kernels/_ext.py and setup.py when CUDA torch is
// present), so a CPU-only build compiles this file without any CUDA header.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "native_model.h"
#include "suffix_tree_cpu.h"

#include <string>
#include <tuple>

#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#ifdef SPECDEC_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/compact_kv.cuh"
#endif

namespace specdec {

void compact_kv_cpu(const at::Tensor& cache, const at::Tensor& cache_seqlens, const at::Tensor& accepted_nodes,
                    const at::Tensor& num_accepted, const c10::optional<at::Tensor>& block_table);
at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
std::tuple<std::string, double> linear_path(bool bf16, int64_t k);
std::string quant_int8_path();
at::Tensor quant_linear_cpu(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                            const c10::optional<at::Tensor>& bias);
at::Tensor quant_linear_meta(const at::Tensor& x, const at::Tensor& weight, int64_t qtype,
                             const c10::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor> decoder_layers_cpu(const at::Tensor& hidden, at::TensorList weights,
                                                      const at::Tensor& final_norm, at::Tensor kv_cache,
                                                      const OptTensorList& inputs, int64_t num_heads, double eps,
                                                      at::IntArrayRef capture, at::IntArrayRef windows,
                                                      double softmax_scale, double softcap, c10::string_view activation);
at::Tensor softcap_cpu(const at::Tensor& z, double cap);
at::Tensor softcap_meta(const at::Tensor& z, double cap);
at::Tensor draft_chain_cpu(const at::Tensor& root_logits, const c10::intrusive_ptr<NativeModel>& model,
                           at::Tensor kv_cache, const at::Tensor& cache_seqlens,
                           const c10::optional<at::Tensor>& block_table, int64_t gamma, bool strict);
at::Tensor plain_steps_cpu(const at::Tensor& roots, const c10::intrusive_ptr<NativeModel>& model, at::Tensor kv_cache,
                            const at::Tensor& cache_seqlens, const c10::optional<at::Tensor>& block_table,
                            int64_t steps, const c10::optional<at::Tensor>& stop_ids, const OptTensorList& sampling);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> spec_chain_cpu(
    const c10::intrusive_ptr<NativeModel>& target_model, const c10::intrusive_ptr<NativeModel>& draft_model,
    at::TensorList caches, const OptTensorList& inputs, const OptTensorList& sampling, at::IntArrayRef knobs,
    at::IntArrayRef tree, int64_t topk);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> tree_step_cpu(
    const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& cache_seqlens,
    const c10::intrusive_ptr<NativeModel>& model, at::Tensor kv_cache, const c10::optional<at::Tensor>& block_table,
    at::IntArrayRef capture);
std::tuple<at::Tensor, at::Tensor, at::Tensor> eagle3_draft_cpu(
    at::TensorList entries, const at::Tensor& feature_cache, const c10::intrusive_ptr<NativeModel>& head,
    at::Tensor kv_cache, const c10::optional<at::Tensor>& block_table, int64_t gamma, const OptTensorList& draws,
    int64_t topk);
std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_greedy_cpu(const at::Tensor& logits, const at::Tensor& tokens,
                                                                 const at::Tensor& parents);
at::Tensor rng_uniform_cpu(const at::Tensor& keys, int64_t n);
at::Tensor rng_gumbel_cpu(const at::Tensor& keys, int64_t n);
at::Tensor rng_meta(const at::Tensor& keys, int64_t n);
at::Tensor keep_threshold_cpu(const at::Tensor& z, const at::Tensor& top_k, const at::Tensor& top_p,
                              const at::Tensor& min_p);
at::Tensor keep_threshold_meta(const at::Tensor& z, const at::Tensor& top_k, const at::Tensor& top_p,
                               const at::Tensor& min_p);
std::tuple<at::Tensor, at::Tensor> decoder_layers_meta(const at::Tensor& hidden, at::TensorList weights,
                                                       const at::Tensor& final_norm, at::Tensor kv_cache,
                                                       const OptTensorList& inputs, int64_t num_heads, double eps,
                                                       at::IntArrayRef capture, at::IntArrayRef windows,
                                                       double softmax_scale, double softcap, c10::string_view activation);

namespace {

void check_index(const at::Tensor& t, const char* name, int64_t rank, const char* shape, const at::Tensor& cache) {
  TORCH_CHECK_VALUE(t.dim() == rank, "compact_kv_: ", name, " must be ", shape, ", got shape ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "compact_kv_: ", name,
                   " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == cache.device(), "compact_kv_: ", name, " is on ", t.device(),
                    " but cache is on ", cache.device(), "; put all inputs on one device");
}

// Everything that needs no values: runs in the Meta kernel too, so fake-tensor tracing reports the same errors.
// Raises ValueError / TypeError in Python, like spec_kernels.compact_kv_'s own checks.
void check_inputs(const at::Tensor& cache, const at::Tensor& cache_seqlens, const at::Tensor& accepted_nodes,
                  const at::Tensor& num_accepted, const c10::optional<at::Tensor>& block_table) {
  const bool paged = block_table.has_value();
  TORCH_CHECK_VALUE(cache.dim() >= 3, "compact_kv_: cache must be ",
                    paged ? "paged [N, num_blocks, block_size, ...]" : "[N, B, S, ...]", ", got shape ",
                    cache.sizes());
  TORCH_CHECK_VALUE(cache.is_contiguous(), "compact_kv_: cache must be contiguous (rows move as whole memcpy's), ",
                    "got strides ", cache.strides());
  check_index(cache_seqlens, "cache_seqlens", 1, "[B]", cache);
  check_index(accepted_nodes, "accepted_nodes", 2, "[B, T]", cache);
  check_index(num_accepted, "num_accepted", 1, "[B]", cache);
  const int64_t batch = cache_seqlens.size(0);
  TORCH_CHECK_VALUE(accepted_nodes.size(0) == batch, "compact_kv_: accepted_nodes has batch ",
                    accepted_nodes.size(0), " but cache_seqlens has ", batch);
  TORCH_CHECK_VALUE(num_accepted.size(0) == batch, "compact_kv_: num_accepted has batch ", num_accepted.size(0),
                    " but cache_seqlens has ", batch);
  if (paged) {
    check_index(*block_table, "block_table", 2, "[B, max_blocks]", cache);
    TORCH_CHECK_VALUE(block_table->size(0) == batch, "compact_kv_: block_table has batch ", block_table->size(0),
                      " but cache_seqlens has ", batch);
    TORCH_CHECK_VALUE(cache.size(2) > 0, "compact_kv_: paged cache has block_size 0");
  } else {
    TORCH_CHECK_VALUE(cache.size(1) == batch, "compact_kv_: cache [N, B, S, ...] has B = ", cache.size(1),
                      " but cache_seqlens has ", batch, " (pass block_table for a paged cache)");
  }
}

at::Tensor as_long(const at::Tensor& t) { return t.to(at::kLong).contiguous(); }

void compact_kv_cpu_entry(at::Tensor cache, const at::Tensor& cache_seqlens, const at::Tensor& accepted_nodes,
                          const at::Tensor& num_accepted, const c10::optional<at::Tensor>& block_table) {
  check_inputs(cache, cache_seqlens, accepted_nodes, num_accepted, block_table);
  c10::optional<at::Tensor> table;
  if (block_table.has_value()) table = int32_block_table("compact_kv_", *block_table);
  compact_kv_cpu(cache, as_long(cache_seqlens), as_long(accepted_nodes), as_long(num_accepted), table);
}

void compact_kv_meta(at::Tensor cache, const at::Tensor& cache_seqlens, const at::Tensor& accepted_nodes,
                     const at::Tensor& num_accepted, const c10::optional<at::Tensor>& block_table) {
  check_inputs(cache, cache_seqlens, accepted_nodes, num_accepted, block_table);
}

#ifdef SPECDEC_WITH_CUDA
void compact_kv_cuda_entry(at::Tensor cache, const at::Tensor& cache_seqlens, const at::Tensor& accepted_nodes,
                           const at::Tensor& num_accepted, const c10::optional<at::Tensor>& block_table) {
  check_inputs(cache, cache_seqlens, accepted_nodes, num_accepted, block_table);
  const c10::cuda::CUDAGuard guard(cache.device());
  // Values (an index past the cache, a bad block id) are not checked here: that would cost a host sync per step.
  // The kernel skips such rows instead; the CPU path and spec_kernels.compact_kv_ on CPU tensors raise.
  // .contiguous() is free for the usual contiguous inputs; int32 and int64 are both read as they are.
  const at::Tensor cache_seqlens_c = cache_seqlens.contiguous();  // [B]
  const at::Tensor nodes = accepted_nodes.contiguous();   // [B, T]
  const at::Tensor counts = num_accepted.contiguous();    // [B]
  at::Tensor table;                                       // [B, max_blocks]
  if (block_table.has_value()) table = block_table->contiguous();

  const int64_t elem = cache.element_size();
  CompactKvParams p{};
  p.cache = cache.data_ptr();
  p.cache_seqlens = cache_seqlens_c.data_ptr();
  p.accepted_nodes = nodes.data_ptr();
  p.num_accepted = counts.data_ptr();
  p.cache_seqlens_int64 = cache_seqlens_c.scalar_type() == at::kLong;
  p.accepted_int64 = nodes.scalar_type() == at::kLong;
  p.num_accepted_int64 = counts.scalar_type() == at::kLong;
  p.num_planes = cache.size(0);
  p.batch = cache_seqlens_c.size(0);
  p.max_nodes = nodes.size(1);
  p.accepted_stride = nodes.stride(0);
  p.row_bytes = elem;
  for (int64_t d = 3; d < cache.dim(); ++d) p.row_bytes *= cache.size(d);
  p.plane_stride = cache.stride(0) * elem;
  p.seq_stride = cache.stride(1) * elem;
  p.slot_stride = cache.stride(2) * elem;
  if (table.defined()) {
    p.block_table = table.data_ptr();
    p.block_table_int64 = table.scalar_type() == at::kLong;
    p.block_size = cache.size(2);
    p.num_blocks = cache.size(1);
    p.block_table_stride = table.stride(0);
    p.capacity = table.size(1) * p.block_size;
  } else {
    p.capacity = cache.size(2);
  }
  const cudaError_t err = compact_kv_cuda(p, c10::cuda::getCurrentCUDAStream(cache.device().index()));
  TORCH_CHECK(err == cudaSuccess, "compact_kv_: CUDA launch failed: ", cudaGetErrorString(err),
              " (B and N must be <= 65535; T rows of staging must fit in shared memory)");
}
#endif

}  // namespace
}  // namespace specdec

// TORCH_LIBRARY (not _FRAGMENT): this is the one C++ definition block of the namespace. Python ops registered with
// torch.library.custom_op("spec_kernels::...") open FRAGMENTs, which coexist with it in either load order
// (tests/test_compact_kv.py::test_python_custom_op_coexists checks both).
TORCH_LIBRARY(spec_kernels, m) {
  m.def(
      "compact_kv_(Tensor(a!) cache, Tensor cache_seqlens, Tensor accepted_nodes, Tensor num_accepted, "
      "Tensor? block_table=None) -> ()");
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("linear_path(bool bf16, int k) -> (str, float)", &specdec::linear_path);  // no tensors: one kernel
  m.def("quant_linear(Tensor x, Tensor weight, int qtype, Tensor? bias=None) -> Tensor");
  m.def("quant_int8_path() -> str", &specdec::quant_int8_path);  // no tensors: how int8 blocks multiply here
  m.def(
      "decoder_layers(Tensor hidden, Tensor[] weights, Tensor final_norm, Tensor(a!) kv_cache, Tensor?[] inputs, "
      "int num_heads, float eps, int[] capture=[], int[] windows=[], float softmax_scale=0., float softcap=0., "
      "str activation='silu') -> (Tensor, Tensor)");  // inputs and the variant: csrc/decoder_layers_cpu.cpp
  m.def("softcap(Tensor z, float cap) -> Tensor");  // Gemma 2's final logits: csrc/decoder_layers_cpu.cpp
  m.def("verify_greedy(Tensor logits, Tensor tokens, Tensor parents) -> (Tensor, Tensor, Tensor)");
  m.def("rng_uniform(Tensor keys, int n) -> Tensor");  // csrc/rng_cpu.cpp
  m.def("rng_gumbel(Tensor keys, int n) -> Tensor");
  m.def("keep_threshold(Tensor z, Tensor top_k, Tensor top_p, Tensor min_p) -> Tensor");  // csrc/keep_threshold_cpu.cpp
  // a model as the native step runners take it (csrc/native_model.h)
  m.class_<specdec::NativeModel>("NativeModel")
      .def(torch::init<at::Tensor, std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, int64_t, double,
                       c10::optional<at::Tensor>>())
      .def("set_head", &specdec::NativeModel::set_head)
      .def("set_variant", &specdec::NativeModel::set_variant);
  m.def(
      "draft_chain(Tensor root_logits, __torch__.torch.classes.spec_kernels.NativeModel model, Tensor(a!) kv_cache, "
      "Tensor cache_seqlens, Tensor? block_table, int gamma, bool strict=False) -> Tensor");
  m.def(
      "plain_steps(Tensor roots, __torch__.torch.classes.spec_kernels.NativeModel model, Tensor(a!) kv_cache, "
      "Tensor cache_seqlens, Tensor? block_table, int steps, Tensor? stop_ids, Tensor?[] sampling) -> Tensor");
  m.def(
      "spec_chain(__torch__.torch.classes.spec_kernels.NativeModel target, "
      "__torch__.torch.classes.spec_kernels.NativeModel draft, Tensor(a!)[] caches, Tensor?[] inputs, "
      "Tensor?[] sampling, int[] knobs, int[] tree=[], int topk=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "tree_step(Tensor tokens, Tensor parents, Tensor cache_seqlens, "
      "__torch__.torch.classes.spec_kernels.NativeModel model, Tensor(a!) kv_cache, Tensor? block_table, "
      "int[] capture=[]) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "eagle3_draft(Tensor[] entries, Tensor feature_cache, __torch__.torch.classes.spec_kernels.NativeModel head, "
      "Tensor(a!) kv_cache, Tensor? block_table, int gamma, Tensor?[] draws, int topk=0) -> (Tensor, Tensor, Tensor)");
  // suffix decoding's tree (csrc/suffix_tree_cpu.cpp): torch.classes.spec_kernels.SuffixTree(max_depth)
  m.class_<specdec::SuffixTree>("SuffixTree")
      .def(torch::init<int64_t>())
      .def("extend", &specdec::SuffixTree::extend)
      .def("remove", &specdec::SuffixTree::remove)
      .def("frequency", &specdec::SuffixTree::frequency)
      .def("num_nodes", &specdec::SuffixTree::num_nodes)
      .def("num_seqs", &specdec::SuffixTree::num_seqs)
      .def("max_depth", &specdec::SuffixTree::max_depth)
      .def("speculate", &specdec::SuffixTree::speculate);
}

TORCH_LIBRARY_IMPL(spec_kernels, CPU, m) {
  m.impl("compact_kv_", &specdec::compact_kv_cpu_entry);
  m.impl("linear", &specdec::linear_cpu);
  m.impl("quant_linear", &specdec::quant_linear_cpu);
  m.impl("decoder_layers", &specdec::decoder_layers_cpu);
  m.impl("softcap", &specdec::softcap_cpu);
  m.impl("verify_greedy", &specdec::verify_greedy_cpu);
  m.impl("draft_chain", &specdec::draft_chain_cpu);
  m.impl("plain_steps", &specdec::plain_steps_cpu);
  m.impl("spec_chain", &specdec::spec_chain_cpu);
  m.impl("tree_step", &specdec::tree_step_cpu);
  m.impl("eagle3_draft", &specdec::eagle3_draft_cpu);
  m.impl("rng_uniform", &specdec::rng_uniform_cpu);
  m.impl("rng_gumbel", &specdec::rng_gumbel_cpu);
  m.impl("keep_threshold", &specdec::keep_threshold_cpu);
}

TORCH_LIBRARY_IMPL(spec_kernels, Meta, m) {
  m.impl("compact_kv_", &specdec::compact_kv_meta);
  m.impl("rng_uniform", &specdec::rng_meta);
  m.impl("rng_gumbel", &specdec::rng_meta);
  m.impl("keep_threshold", &specdec::keep_threshold_meta);
  m.impl("linear", &specdec::linear_meta);
  m.impl("quant_linear", &specdec::quant_linear_meta);
  m.impl("decoder_layers", &specdec::decoder_layers_meta);
  m.impl("softcap", &specdec::softcap_meta);
}

#ifdef SPECDEC_WITH_CUDA
TORCH_LIBRARY_IMPL(spec_kernels, CUDA, m) { m.impl("compact_kv_", &specdec::compact_kv_cuda_entry); }
#endif

namespace specdec {
namespace {

// linear(x, weight, bias_or_None) -> Tensor: spec_kernels::linear called through the dispatcher's unboxed path.
// torch.ops' boxed call from Python costs ~1.7x a plain binding's; a forward makes 57 of them.
// Going through the dispatcher (not linear_cpu directly) keeps fake tensors, dispatch modes and the Meta kernel
// working. spec_kernels/linear/cpu.py uses torch.ops instead while torch.compile traces.
PyObject* py_linear(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 3 && THPVariable_Check(args[0]) && THPVariable_Check(args[1]) &&
                       (args[2] == Py_None || THPVariable_Check(args[2])),
                   "linear(x, weight, bias): expected (Tensor, Tensor, Tensor or None)");
  c10::optional<at::Tensor> bias;
  if (args[2] != Py_None) bias = THPVariable_Unpack(args[2]);
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("spec_kernels::linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&)>();
  at::Tensor out;
  {
    const pybind11::gil_scoped_release no_gil;
    out = op.call(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), bias);
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_linear)), METH_FASTCALL,
     "linear(x, weight, bias) -> Tensor: spec_kernels::linear without torch.ops' boxing."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace
}  // namespace specdec

// The Python module of the ahead-of-time build (setup.py, spec_kernels._C) and of the JIT build: importing it runs
// the registrations above; its one function is the fast eager entry of spec_kernels::linear. TORCH_EXTENSION_NAME is
// set by torch's build helpers.
#define SPECDEC_CAT(a, b) a##b
#define SPECDEC_PYINIT(name) SPECDEC_CAT(PyInit_, name)
#define SPECDEC_STR_(x) #x
#define SPECDEC_STR(x) SPECDEC_STR_(x)

PyMODINIT_FUNC SPECDEC_PYINIT(TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, SPECDEC_STR(TORCH_EXTENSION_NAME), nullptr, -1,
                               specdec::methods};
  return PyModule_Create(&module);
}
