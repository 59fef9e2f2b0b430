"""tools/megamoe/patch_src.py SRC -- take std::regex out of DeepGEMM's JIT host code in an unpacked
megamoe-src tree (tools/megamoe/build.sh runs it before compiling _C; the tarball stays upstream's source).

Why: a _C compiled on the GPU machine (g++ 13.3, torch 2.11) segfaulted at the first MegaMoE call inside
std::regex in IncludeParser::get_includes, the process's first std::regex; -Wl,-Bsymbolic and -static-libstdc++
crashed the same way, and a _C compiled with g++ 12.2 elsewhere ran. Not a deep recursion: the parser over
every deep_gemm header runs in 32 KiB of stack. The three std::regex uses are plain scans, so they become
plain string code and nothing of <regex> is compiled into _C:
  jit/include_parser.hpp  get_includes: every match of `#\\s*include\\s*[<"][^>"]+[>"]` found by hand, same
                          matches in the same order, so the include hashes (the JIT cache keys) do not change
  jit/compiler.hpp        `release (\\d+\\.\\d+)` in `nvcc --version` and `Local memory used` in ptxas output
Each anchor must occur exactly once: another DeepGEMM tree fails here, loudly, instead of building unpatched.
"""
import pathlib
import re
import sys

# A scanner equivalent to std::sregex_iterator over R"(#\s*include\s*[<"][^>"]+[>"])" (ECMAScript \s).
SCAN_INCLUDES = r'''
    // symmring anchor build: the matches of #\s*include\s*[<"][^>"]+[>"], scanned by hand
    // (tools/megamoe/patch_src.py says why).
    static std::vector<std::string> scan_include_directives(const std::string& code) {
        const auto is_space = [](const char c) { return c == ' ' or (c >= '\t' and c <= '\r'); };
        std::vector<std::string> found;
        size_t start = code.find('#');
        while (start != std::string::npos) {
            size_t i = start + 1;
            while (i < code.size() and is_space(code[i])) ++ i;
            bool matched = code.compare(i, 7, "include") == 0;
            if (matched) {
                i += 7;
                while (i < code.size() and is_space(code[i])) ++ i;
                matched = i < code.size() and (code[i] == '<' or code[i] == '"');
            }
            if (matched) {
                const size_t close = code.find_first_of(">\"", i + 1);
                matched = close != std::string::npos and close > i + 1;
                if (matched) {
                    found.push_back(code.substr(start, close + 1 - start));
                    start = code.find('#', close + 1);
                    continue;
                }
            }
            start = code.find('#', start + 1);
        }
        return found;
    }
'''

EDITS = {
    "csrc/jit/include_parser.hpp": [
        ("#include <regex>\n", ""),
        ("    static std::vector<std::string> get_includes(",
         SCAN_INCLUDES.lstrip("\n") + "\n    static std::vector<std::string> get_includes("),
        ('        const std::regex pattern(R"(#\\s*include\\s*[<"][^>"]+[>"])");\n'
         "        std::sregex_iterator iter(code.begin(), code.end(), pattern);\n"
         "        const std::sregex_iterator end;\n", ""),
        ("        for (; iter != end; ++ iter) {\n            const auto include_str = iter->str();\n",
         "        for (const auto& include_str: scan_include_directives(code)) {\n"),
    ],
    "csrc/jit/compiler.hpp": [
        ("#include <regex>\n", ""),
        ("        std::smatch match;\n"
         '        DG_HOST_ASSERT(std::regex_search(output, match, std::regex(R"(release (\\d+\\.\\d+))")));\n'
         '        std::sscanf(match[1].str().c_str(), "%d.%d", &major, &minor);\n',
         "        // symmring anchor build: `release X.Y` scanned by hand (tools/megamoe/patch_src.py)\n"
         "        size_t at = output.find(\"release \");\n"
         "        while (at != std::string::npos and\n"
         "               std::sscanf(output.c_str() + at + 8, \"%d.%d\", &major, &minor) != 2)\n"
         "            at = output.find(\"release \", at + 1);\n"
         "        DG_HOST_ASSERT(at != std::string::npos and \"no `release X.Y` in nvcc --version\");\n"),
        ('            DG_HOST_ASSERT(not std::regex_search(output, std::regex(R"(Local memory used)")));\n',
         '            DG_HOST_ASSERT(output.find("Local memory used") == std::string::npos);\n'),
    ],
}


MARK = "symmring anchor build"
REGEX_USE = re.compile(r"#include <regex>|std::(regex|sregex_iterator|smatch|regex_search)\b")


def main(src: str) -> int:
    root = pathlib.Path(src)
    for rel, edits in EDITS.items():
        path = root / rel
        text = path.read_text()
        if MARK in text:
            print(f"patch_src.py: {rel} is patched already")
            continue
        for old, new in edits:
            if text.count(old) != 1:
                print(f"patch_src.py: {rel}: expected one {old.splitlines()[0]!r}, found {text.count(old)}; "
                      "not the DeepGEMM tree this patch is for", file=sys.stderr)
                return 1
            text = text.replace(old, new)
        path.write_text(text)
    left = [str(p.relative_to(root)) for p in (root / "csrc").rglob("*.hpp")
            if REGEX_USE.search(p.read_text())]
    if left:
        print(f"patch_src.py: std::regex still in {', '.join(left)}", file=sys.stderr)
        return 1
    print("patch_src.py: std::regex taken out of csrc/jit (include_parser.hpp, compiler.hpp)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: patch_src.py SRC  (an unpacked megamoe-src tree)")
    sys.exit(main(sys.argv[1]))
