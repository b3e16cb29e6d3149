"""fusedmlp.patch over every causal-LM, MoE and encoder class of the installed transformers
that builds from a tiny config (hf_sweep.py): random-init fp32 models on the CPU backend.

Per class: patch() must not break the model (no exception, logits within 1e-4 of the row rms
of the unpatched model's: fp32 accumulation order gives ~1e-6), must account in its report for
every MLP-looking module (hf_sweep.mlp_looking, by class names and children), and strict mode
must either patch (then the logits match too) or refuse with PatchError leaving the model
unchanged. Classes that cannot be built that way are skipped with the reason. The table of the
sweep is printed at the end of the pytest run (conftest.py); bench/patch_sweep.py writes it to
bench/results/patch_sweep.md and the README."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed; fusedmlp.patch needs it")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed; the sweep builds its models")

import hf_sweep  # noqa: E402

FP32_TOLERANCE = 1e-4  # max |patched - unpatched| / rms(unpatched logits row)
ROWS = {}  # arch -> hf_sweep.Row, printed by conftest.py


def check(row, tolerance, close=None):
    """Asserts the sweep's conditions on a row (see the module docstring)."""
    assert not row.error, row.error
    assert row.max_diff <= tolerance if close is None else row.close <= 1.0, (
        f"{row.arch}: patched logits differ by {row.max_diff:.3g} of the row rms "
        f"(close error {row.close:.3g}); replaced {row.replaced + row.experts}")
    assert not row.unaccounted, f"{row.arch}: the report misses {row.unaccounted}"
    assert row.strict == "patched" or row.strict.startswith("refused: "), row.strict
    assert row.strict_diff <= tolerance if close is None else True, (
        f"{row.arch}: strict-patched logits differ by {row.strict_diff:.3g}")


@pytest.mark.parametrize("kind,arch", hf_sweep.classes(), ids=lambda v: v)
def test_patch_sweep_fp32(kind, arch):
    row = hf_sweep.run(kind, arch)
    ROWS[arch] = row
    if not row.built:
        pytest.skip(row.reason)
    check(row, FP32_TOLERANCE)
