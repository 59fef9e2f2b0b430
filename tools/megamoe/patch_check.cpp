// tools/megamoe/patch_check.cpp -- on CPU (tools/megamoe/check_patch.sh builds and runs it): the include scanner
// that tools/megamoe/patch_src.py puts into DeepGEMM's IncludeParser finds exactly what DeepGEMM's
// std::sregex_iterator over R"(#\s*include\s*[<"][^>"]+[>"])" finds, on every header under SRC/include and on
// random texts; then the patched parser's include hash of every deep_gemm/impls kernel (the JIT cache key).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "utils/format.hpp"
#include "utils/hash.hpp"
#include "utils/lazy_init.hpp"
#include "utils/system.hpp"
#define class struct  // the scanner is a private member of IncludeParser
#include "jit/include_parser.hpp"
#undef class

static std::vector<std::string> upstream_matches(const std::string& text) {
    static const std::regex pattern(R"(#\s*include\s*[<"][^>"]+[>"])");
    std::vector<std::string> found;
    for (std::sregex_iterator it(text.begin(), text.end(), pattern), end; it != end; ++it)
        found.push_back(it->str());
    return found;
}

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: patch_check SRC (a patched megamoe-src tree)\n");
        return 2;
    }
    const std::filesystem::path root = argv[1];
    long files = 0, matches = 0;
    for (const auto& entry: std::filesystem::recursive_directory_iterator(root / "include")) {
        if (not entry.is_regular_file())
            continue;
        std::ifstream in(entry.path());
        const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        const auto want = upstream_matches(text);
        if (deep_gemm::IncludeParser::scan_include_directives(text) != want) {
            std::printf("MISMATCH in %s\n", entry.path().c_str());
            return 1;
        }
        ++files, matches += static_cast<long>(want.size());
    }
    std::printf("headers: scanner == std::sregex_iterator in %ld files (%ld directives)\n", files, matches);

    const std::vector<std::string> atoms = {"#", "include", " ", "\t", "\n", "\r", "\v", "\f", "<", ">", "\"", "x",
                                            "deep_gemm/a.cuh", "/", "# include", "#include <", "incl"};
    std::mt19937 rng(1234);
    matches = 0;
    for (int t = 0; t < 200000; ++t) {
        std::string text;
        for (int k = static_cast<int>(rng() % 24); k > 0; --k)
            text += atoms[rng() % atoms.size()];
        const auto want = upstream_matches(text);
        if (deep_gemm::IncludeParser::scan_include_directives(text) != want) {
            std::printf("MISMATCH on random text \"%s\"\n", text.c_str());
            return 1;
        }
        matches += static_cast<long>(want.size());
    }
    std::printf("random: scanner == std::sregex_iterator on 200000 texts (%ld matches)\n", matches);

    deep_gemm::IncludeParser::prepare_init(root.string());
    std::vector<std::string> kernels;
    for (const auto& entry: std::filesystem::directory_iterator(root / "include" / "deep_gemm" / "impls"))
        kernels.push_back(entry.path().filename().string());
    std::sort(kernels.begin(), kernels.end());
    std::string code;
    for (const auto& name: kernels)
        code += "#include <deep_gemm/impls/" + name + ">\n";
    std::printf("include hash of every deep_gemm/impls kernel: %s\n", deep_gemm::include_parser->get_hash_value(code).c_str());
    return 0;
}
