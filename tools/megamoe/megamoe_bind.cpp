// tools/megamoe/megamoe_bind.cpp -- a Python module (_C) with DeepGEMM's SM90 FP8 MegaMoE alone, built from
// DeepGEMM's own host code (csrc/apis/sm90_mega.hpp and what it includes) against the installed torch.
// Source: deepseek-ai/DeepGEMM refs/pull/323/head 8ddf7f9 (2026-07-02, "SM90 FP8 MegaMoE swapAB"), the
// newest stored tree with the SM90 kernel; that tree binds its API through tvm-ffi (its pybind
// register_apis are compiled out), so this file binds the few entry points the benchmark calls. A tool for
// `bench moe --anchor megamoe` only: never part of the symmring package. tools/megamoe/build.sh compiles it on
// DeepGEMM's tree as tools/megamoe/patch_src.py leaves it (no std::regex in the JIT host code).
#include <csignal>
#include <cstdlib>
#include <execinfo.h>
#include <unistd.h>

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

namespace {
// MEGAMOE_SEGV_BACKTRACE=1: a SIGSEGV/SIGBUS prints the native frames (exported symbols) to stderr, then the
// signal goes on to the handler that was there before (Python's faulthandler prints the Python frames). A
// crash inside the host code then names its function in the one device call that hit it.
struct sigaction previous_segv, previous_bus;

void print_native_backtrace(int sig) {
    void* frames[64];
    const int n = backtrace(frames, 64);
    const char head[] = "megamoe_dg: fatal signal, native frames:\n";
    (void) !write(STDERR_FILENO, head, sizeof(head) - 1);
    backtrace_symbols_fd(frames, n, STDERR_FILENO);
    sigaction(sig, sig == SIGSEGV ? &previous_segv : &previous_bus, nullptr);
    raise(sig);
}

void install_backtrace_on_crash() {
    const char* flag = std::getenv("MEGAMOE_SEGV_BACKTRACE");
    if (flag == nullptr or flag[0] != '1')
        return;
    void* warm[1];
    backtrace(warm, 1);  // loads the unwinder now, not inside the handler
    static char alternate_stack[1 << 16];  // the handler still runs after a stack overflow
    stack_t stack = {};
    stack.ss_sp = alternate_stack;
    stack.ss_size = sizeof(alternate_stack);
    sigaltstack(&stack, nullptr);
    struct sigaction action = {};
    action.sa_handler = print_native_backtrace;
    action.sa_flags = SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, &previous_segv);
    sigaction(SIGBUS, &action, &previous_bus);
}
}  // namespace

PYBIND11_MODULE(_C, m) {
    install_backtrace_on_crash();
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
