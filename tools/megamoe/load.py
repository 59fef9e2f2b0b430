"""Import DeepGEMM's SM90 MegaMoE the way `symmring.bench.moe_anchor.load_megamoe` does (its torch-2.11 compat
library first) and say what loaded: ``python tools/megamoe/load.py`` (exit status 0 when it loads)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from symmring.bench.moe_anchor import load_megamoe  # noqa: E402

try:
    dg = load_megamoe()
except ImportError as exc:
    print(f"load.py: {exc}")
    sys.exit(1)
print(f"load.py: deep_gemm {getattr(dg, '__version__', '?')} from {os.path.dirname(dg.__file__)}; "
      f"SM90 token alignment {int(dg._C.get_token_alignment_for_sm90_mega_moe())}")
