// tools/megamoe/torch211_compat.cpp -- the eight libtorch symbols that sgl-deep-gemm 0.2.5's prebuilt _C.so
// needs and torch 2.11 does not export (the wheel was built against torch >= 2.13; its C++ source,
// csrc/torch_library_api.cpp, is not published in any stored snapshot of sgl-project/DeepGEMM, so _C.so
// cannot be rebuilt against 2.11). Each one forwards to torch 2.11's equivalent. Loaded with RTLD_GLOBAL
// before deep_gemm (tools/megamoe/load.py). A benchmark tool only: never part of the symmring package.
//
// What each forward assumes (checked against the torch 2.11.0+cu130 and 2.13.0 headers):
// * c10::ValueError(SourceLocation, std::string): 2.13 declares it, 2.11 inherits Error's; c10::Error's
//   members are the same in both, so the object built here has the layout the caller allocated.
// * c10::cuda::CUDAErrorLogCapture (2.14: a CUDA 13 driver-log cursor): the constructor writes nothing and
//   the check ignores it (2.11 has no log capture; the error message loses only the driver-log suffix).
// * at::TensorBase::const_data_ptr<float>(): 2.11 exports it as const_data_ptr<float, 0>.
// * torch::Library::_def(..., std::vector<torch::headeronly::Tag>, ...): the same enum (int) moved to
//   torch::headeronly; the vector is passed through (DeepGEMM defines its ops without tags).
// * torch_exception_get_what(_without_backtrace) (stable C shim, 2.13): only read on an error path; 2.11
//   keeps no such record, so they return a fixed text.
#include <new>
#include <string>
#include <utility>
#include <c10/util/Exception.h>

#define SYM(name) __asm__(name)

// --- c10::ValueError::ValueError(c10::SourceLocation, std::string), complete and base object ------------
extern "C" void dg_compat_value_error_c1(c10::ValueError* self, c10::SourceLocation loc, std::string msg)
    SYM("_ZN3c1010ValueErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");
extern "C" void dg_compat_value_error_c1(c10::ValueError* self, c10::SourceLocation loc, std::string msg) {
    new (self) c10::ValueError(loc, std::move(msg));
}
extern "C" void dg_compat_value_error_c2(c10::ValueError* self, c10::SourceLocation loc, std::string msg)
    SYM("_ZN3c1010ValueErrorC2ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE");
extern "C" void dg_compat_value_error_c2(c10::ValueError* self, c10::SourceLocation loc, std::string msg) {
    new (self) c10::ValueError(loc, std::move(msg));
}

// --- c10::cuda::CUDAErrorLogCapture and the 6-argument CUDA check -------------------------------------------
extern "C" void dg_compat_log_capture_c1(void*) SYM("_ZN3c104cuda19CUDAErrorLogCaptureC1Ev");
extern "C" void dg_compat_log_capture_c1(void*) {}
extern "C" void dg_compat_log_capture_c2(void*) SYM("_ZN3c104cuda19CUDAErrorLogCaptureC2Ev");
extern "C" void dg_compat_log_capture_c2(void*) {}

extern "C" void torch211_cuda_check(int, const char*, const char*, unsigned int, bool)
    SYM("_ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jb");
extern "C" void dg_compat_cuda_check(int err, const char* file, const char* func, unsigned int line,
                                     bool include_device_assertions, void*)
    SYM("_ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jbPNS0_19CUDAErrorLogCaptureE");
extern "C" void dg_compat_cuda_check(int err, const char* file, const char* func, unsigned int line,
                                     bool include_device_assertions, void*) {
    torch211_cuda_check(err, file, func, line, include_device_assertions);
}

// --- at::TensorBase::const_data_ptr<float>() const -----------------------------------------------------------
extern "C" const float* torch211_const_data_ptr_f(const void*) SYM("_ZNK2at10TensorBase14const_data_ptrIfLi0EEEPKT_v");
extern "C" const float* dg_compat_const_data_ptr_f(const void* self) SYM("_ZNK2at10TensorBase14const_data_ptrIfEEPKT_v");
extern "C" const float* dg_compat_const_data_ptr_f(const void* self) { return torch211_const_data_ptr_f(self); }

// --- torch::Library::_def with torch::headeronly::Tag -> with at::Tag ---------------------------------------
extern "C" void* torch211_def_schema(void*, void*, void*, const void*, int)
    SYM("_ZNR5torch7Library4_defEON3c1014FunctionSchemaEPNS1_12OperatorNameERKSt6vectorIN2at3TagESaIS8_EENS_17_RegisterOrVerifyE");
extern "C" void* dg_compat_def_schema(void* self, void* schema, void* out_name, const void* tags, int rv)
    SYM("_ZNR5torch7Library4_defEON3c1014FunctionSchemaEPNS1_12OperatorNameERKSt6vectorINS_10headeronly3TagESaIS8_EENS_17_RegisterOrVerifyE");
extern "C" void* dg_compat_def_schema(void* self, void* schema, void* out_name, const void* tags, int rv) {
    return torch211_def_schema(self, schema, out_name, tags, rv);
}
extern "C" void* torch211_def_fn(void*, void*, void*, const void*)
    SYM("_ZNR5torch7Library4_defEOSt7variantIJN3c1012OperatorNameENS2_14FunctionSchemaEEEONS_11CppFunctionERKSt6vectorIN2at3TagESaISB_EE");
extern "C" void* dg_compat_def_fn(void* self, void* name_or_schema, void* fn, const void* tags)
    SYM("_ZNR5torch7Library4_defEOSt7variantIJN3c1012OperatorNameENS2_14FunctionSchemaEEEONS_11CppFunctionERKSt6vectorINS_10headeronly3TagESaISB_EE");
extern "C" void* dg_compat_def_fn(void* self, void* name_or_schema, void* fn, const void* tags) {
    return torch211_def_fn(self, name_or_schema, fn, tags);
}

// --- stable C shim (2.13) -------------------------------------------------------------------------------------
extern "C" __attribute__((visibility("default"))) const char* torch_exception_get_what() {
    return "(torch 2.11 keeps no stable-ABI exception record; see the log above for the C++ error)";
}
extern "C" __attribute__((visibility("default"))) const char* torch_exception_get_what_without_backtrace() {
    return torch_exception_get_what();
}
