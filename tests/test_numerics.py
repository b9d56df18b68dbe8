"""The oneDNN instruction-set cap that keeps outputs the same across CPU
generations (see trioserve/__init__.py): set on import, in this process and
in every server or CLI process trioserve starts, and never over an
operator's own choice."""

from __future__ import annotations

import os
import subprocess
import sys


def test_importing_trioserve_caps_onednn_unless_the_operator_chose():
    import trioserve  # noqa: F401 - imported for its side effect, already done by collection

    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    code = "import os, trioserve; print(os.environ['ONEDNN_MAX_CPU_ISA'])"
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    fresh = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert fresh.stdout.strip() == "AVX512_CORE_BF16"
    chosen = subprocess.run([sys.executable, "-c", code], env={**env, "ONEDNN_MAX_CPU_ISA": "ALL"}, capture_output=True, text=True, timeout=60, check=True)
    assert chosen.stdout.strip() == "ALL"
