#!/usr/bin/env bash
# tools/megamoe/own_libstdcxx.sh SO -- exit 0 (and say so) when the shared object SO defines libstdc++'s own
# locale/stream symbols in its dynamic table, i.e. carries a static copy of libstdc++; exit 1 when it takes
# libstdc++ from the process. build.sh refuses such a _C: the copy's exported symbols bind partly to the
# process's libstdc++.so.6 and partly to themselves, and a std::ostream can then read a null facet.
set -uo pipefail
own=$(nm -D --defined-only "$1" | grep -c -e ' _ZNSt6locale' -e ' _ZNSo9_M_insert' -e 'St7codecvt')
if (( own > 0 )); then
  echo "own_libstdcxx.sh: $1 defines $own of libstdc++'s own symbols (a static libstdc++ in its link)"
  exit 0
fi
exit 1
