// The Python module: every kernel of ops.h by its own name, the decoder's description (decoder.h)
// as classes Python fills in, and what the build has (has_avx512, has_avx512_bf16, has_amx_bf16, has_amx_int8, has_avx512_vnni), which
// nanopaged/cpu/choose.py and quantized_linear.py read to decide what runs.
#include <pybind11/stl.h>
#include "decoder.h"
#include "ops.h"
#include "vec16.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel lets go of the GIL while it runs, so Python on another thread (the engine scheduling
  // the next step: nanopaged/engine/overlap.py) goes on beside it; a Python callback takes it back.
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm of each row, as Hugging Face's LlamaRMSNorm");
  m.def("add_rms_norm", &add_rms_norm, nogil, "x += y in place (the residual), then RMSNorm of x");
  m.def("rotary_and_store", &rotary_and_store, nogil, "rotate q and k in place (Qwen3: norm each head first), store k and v");
  m.def("silu_and_mul", &silu_and_mul, nogil, "SiLU(gate) * up");
  m.def("argmax_rows", &argmax_rows, nogil, "the index of each row's largest value, as torch.argmax(x, dim=-1)");
  m.def("gated_delta_step", &gated_delta_step, nogil, "one token of the gated delta rule per request, in place on its page");
  m.def("ssd_step", &ssd_step, nogil, "one token of Mamba-2's recurrence per request, in place on its page");
  m.def("conv_step", &conv_step, nogil, "one token of a short causal convolution per request, then SiLU, in place");
  m.def("paged_attention", &paged_attention, nogil, "every row of a step attending through its block table, causally",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("scale"), py::arg("share_prefixes") = true);
  m.def("shared_prefix_groups", &shared_prefix_groups, nogil, "the rows paged_attention reads together, and the blocks "
        "they share");
  m.def("store_kv", &store_kv, nogil, "each token's K and V into its slot, in the kernels' order within a block");
  m.def("pack_bf16_weight", &pack_bf16_weight, nogil, "a bfloat16 weight in the layout linear_bf16 reads");
  m.def("linear_bf16_silu_mul", &linear_bf16_silu_mul, nogil, "SiLU(gate) * up of a packed gate_up projection, in one pass");
  m.def("linear_bf16", &linear_bf16, nogil, "x W^T + b on AVX512-BF16's dot-product instruction");
  m.attr("has_avx512_bf16") = bool(NP_HAS_AVX512_BF16);
  m.def("pack_amx_weight", &pack_amx_weight, nogil, "a bfloat16 weight in the layout linear_amx's tiles read");
  m.def("linear_amx", &linear_amx, nogil, "x W^T + b on AMX's bfloat16 tiles, each row alone");
  m.def("pack_amx_int8", &pack_amx_int8, nogil, "8-bit codes and a scale per output feature, for linear_amx_int8");
  m.def("linear_amx_int8", &linear_amx_int8, nogil, "W8A8 on AMX's int8 tiles: rows quantized per token, one integer sum");
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
  m.attr("has_amx_bf16") = true;
#else
  m.attr("has_amx_bf16") = false;
#endif
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__)
  m.attr("has_amx_int8") = true;
#else
  m.attr("has_amx_int8") = false;
#endif
  m.def("pack_quantized", &pack_quantized, nogil, "4- or 8-bit codes with their block scales, in linear_quantized's layout");
  m.def("linear_quantized", &linear_quantized, nogil, "x W^T for W in 4 or 8 bits, x quantized to 8 bits per block");
#if defined(__AVX512VNNI__)
  m.attr("has_avx512_vnni") = true;
#else
  m.attr("has_avx512_vnni") = false;
#endif
#if defined(__AVX512F__)
  m.attr("has_avx512") = true;
#else
  m.attr("has_avx512") = false;
#endif
  namespace py = pybind11;
  // module_local: the tests load a second build of these files (without AVX-512) beside the first
  py::enum_<LinearKind>(m, "LinearKind", py::module_local())
      .value("DPBF16", LinearKind::DPBF16, "nanopaged's bfloat16 kernel (linear_bf16)")
      .value("AMX", LinearKind::AMX, "nanopaged's AMX kernel (linear_amx)")
      .value("QUANTIZED", LinearKind::QUANTIZED, "linear_quantized, at every row count")
      .value("AMX_INT8", LinearKind::AMX_INT8, "linear_amx_int8 (W8A8), at every row count")
      .value("CALLBACK", LinearKind::CALLBACK, "`fn`, a Python callable, called back");
  py::class_<Linear, std::shared_ptr<Linear>>(m, "Linear", py::module_local())
      .def(py::init<>())
      .def_readwrite("kind", &Linear::kind).def_readwrite("out_features", &Linear::out_features)
      .def_readwrite("packed", &Linear::packed).def_readwrite("bias", &Linear::bias)
      .def_readwrite("group", &Linear::group).def_readwrite("bits", &Linear::bits)
      .def_readwrite("fn", &Linear::fn).def_readwrite("lora", &Linear::lora)
      .def("__call__", &Linear::operator(), nogil, py::arg("x"), py::arg("groups") = LoraGroups{});
  py::class_<LoraSlots, std::shared_ptr<LoraSlots>>(m, "LoraSlots", py::module_local())
      .def(py::init<int64_t>()).def("set", &LoraSlots::set, "put an adapter's packed A and B's into a slot")
      .def("add", [](const LoraSlots& s, torch::Tensor y, const torch::Tensor& x, const LoraGroups& g) { s.add(y, x, g); });
  py::class_<Layer>(m, "Layer", py::module_local())
      .def(py::init<>())
      .def_readwrite("input_norm", &Layer::input_norm).def_readwrite("post_norm", &Layer::post_norm)
      .def_readwrite("q_norm", &Layer::q_norm).def_readwrite("k_norm", &Layer::k_norm)
      .def_readwrite("qkv", &Layer::qkv).def_readwrite("o", &Layer::o)
      .def_readwrite("gate_up", &Layer::gate_up).def_readwrite("down", &Layer::down)
      .def_readwrite("moe", &Layer::moe);
  py::class_<Experts>(m, "Experts", py::module_local())
      .def(py::init<>())
      .def_readwrite("gate_up", &Experts::gate_up).def_readwrite("down", &Experts::down)
      .def("__call__", &Experts::operator(), nogil, py::arg("x"), py::arg("chosen"), py::arg("weights"));
  py::class_<Decoder>(m, "Decoder", py::module_local())
      .def(py::init<>())
      .def_readwrite("layers", &Decoder::layers).def_readwrite("heads", &Decoder::heads)
      .def_readwrite("kv_heads", &Decoder::kv_heads).def_readwrite("head_dim", &Decoder::head_dim)
      .def_readwrite("eps", &Decoder::eps).def_readwrite("qk_eps", &Decoder::qk_eps)
      .def_readwrite("scale", &Decoder::scale).def_readwrite("lora_groups", &Decoder::lora_groups);
  m.def("decoder_forward", &decoder_forward, nogil, "every decoder layer of one step, in C++");
}
