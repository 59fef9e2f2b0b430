// tools/megamoe/megamoe_bind.cpp -- a Python module (_C) with DeepGEMM's SM90 FP8 MegaMoE alone, built from
// DeepGEMM's own host code (csrc/apis/sm90_mega.hpp and what it includes) against the installed torch.
// Source: deepseek-ai/DeepGEMM refs/pull/323/head 8ddf7f9 (2026-07-02, "SM90 FP8 MegaMoE swapAB"), the
// newest stored tree with the SM90 kernel; that tree binds its API through tvm-ffi (its pybind
// register_apis are compiled out), so this file binds the few entry points the benchmark calls. A tool for
// `bench moe --anchor megamoe` only: never part of the symmring package.
#include <pybind11/pybind11.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/python.h>

// The include order of that tree's tvm_ffi_api.cpp (utils/system.hpp's get_env and the JIT classes come first).
#include "apis/attention.hpp"
#include "apis/einsum.hpp"
#include "apis/hyperconnection.hpp"
#include "apis/gemm.hpp"
#include "apis/layout.hpp"
#include "apis/mega.hpp"
#include "apis/sm90_mega.hpp"
#include "apis/runtime.hpp"

PYBIND11_MODULE(_C, m) {
    m.doc() = "DeepGEMM SM90 FP8 MegaMoE (symmring anchor build)";
    // What deep_gemm's own init does: the JIT's include root (a folder holding include/deep_gemm, cute, cutlass)
    // and the CUDA toolkit nvcc compiles with.
    m.def("init", [](const std::string& library_root_path, const std::string& cuda_home_path_by_python) {
        deep_gemm::Compiler::prepare_init(library_root_path, cuda_home_path_by_python);
        deep_gemm::KernelRuntime::prepare_init(cuda_home_path_by_python);
        deep_gemm::IncludeParser::prepare_init(library_root_path);
    });
    m.def("set_num_sms", [](const int& n) { deep_gemm::device_runtime->set_num_sms(n); });
    m.def("get_num_sms", []() { return deep_gemm::device_runtime->get_num_sms(); });
    m.def("mega_moe_pre_dispatch_sm90", &deep_gemm::mega::mega_moe_pre_dispatch_sm90);
    m.def("get_token_alignment_for_sm90_mega_moe", &deep_gemm::mega::get_token_alignment_for_sm90_mega_moe);
    m.def("get_symm_buffer_size_for_sm90_mega_moe", &deep_gemm::mega::get_symm_buffer_size_for_sm90_mega_moe);
    m.def("fp8_mega_moe", &deep_gemm::mega::fp8_mega_moe);
}
