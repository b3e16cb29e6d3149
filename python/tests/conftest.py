"""Prints the patch() sweep's table (test_patch_sweep.py, test_gpu.py) after the run."""

import sys


def pytest_terminal_summary(terminalreporter):
    for module in ("test_patch_sweep", "test_gpu"):
        mod = sys.modules.get(module)
        rows = getattr(mod, "ROWS", None) if mod is not None else None
        if rows:
            import hf_sweep
            import transformers
            terminalreporter.write_sep("=", f"fusedmlp.patch sweep ({module})")
            terminalreporter.write_line(hf_sweep.table(list(rows.values()),
                                                       transformers.__version__))
