"""fusedmlp.knobs() / knob() / info() over the library's table of FMLP_* environment knobs
(src/core/knobs.def, read through fmlp_knob_info): every row listed, values validated with the
library's message, rejected values reported as a RuntimeWarning."""

import warnings

import pytest

import fusedmlp


def test_knobs_list_the_table():
    knobs = fusedmlp.knobs()
    names = [k.name for k in knobs]
    assert len(names) == len(set(names)) > 10
    assert {"FMLP_PLAN_TUNE", "FMLP_TORCH_OPS", "FMLP_TP_P2P"} <= set(names)
    for k in knobs:
        assert k.kind in ("bool", "int", "float", "string")
        assert k.scope in ("cuda", "dist", "python", "cli", "test")
        assert k.purpose
        if k.env is None:
            assert k.value == k.default and k.error == ""


def test_knob_reads_and_validates(monkeypatch):
    monkeypatch.setenv("FMLP_PREFILL_SCRATCH_MB", "512")
    assert fusedmlp.knob("FMLP_PREFILL_SCRATCH_MB") == "512"
    monkeypatch.setenv("FMLP_PREFILL_SCRATCH_MB", "2")
    with pytest.warns(RuntimeWarning, match=r"FMLP_PREFILL_SCRATCH_MB=2 ignored: expected an "
                                            r"integer in \[8, 1024\]; the default \(128\)"):
        assert fusedmlp.knob("FMLP_PREFILL_SCRATCH_MB") == "128"
    monkeypatch.delenv("FMLP_PREFILL_SCRATCH_MB")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fusedmlp.knob("FMLP_PREFILL_SCRATCH_MB") == "128"
    with pytest.raises(KeyError, match="FMLP_NO_SUCH_KNOB is not a fusedmlp knob"):
        fusedmlp.knob("FMLP_NO_SUCH_KNOB")


def test_info_lists_the_knobs(monkeypatch):
    monkeypatch.setenv("FMLP_STREAM_U", "7")
    text = fusedmlp.info()
    assert text.startswith(f"fusedmlp {fusedmlp.__version__}")
    assert "backends:" in text
    assert "FMLP_STREAM_U=7 ignored: expected one of 3, 4" in text
    for k in fusedmlp.knobs():
        assert k.name in text
