"""The cuBLASLt tune table from Python: the tuning() scope, and tune files rejected with the
entry and field that did not parse. No GPU needed (the table and its file are host state); the
GPU behaviour of tuned calls is tests/test_tune.cpp's."""
import json

import pytest

import fusedmlp
from fusedmlp import _ext

needs_cuda_build = pytest.mark.skipif(not _ext.with_cuda(), reason="built without CUDA")


def test_tuning_scope_nests_and_ends_on_error():
    with fusedmlp.tuning():
        with fusedmlp.tuning():
            pass
    with pytest.raises(KeyError):
        with fusedmlp.tuning():
            raise KeyError("inside")
    if _ext.with_cuda():
        with pytest.raises(ValueError, match="without a matching fmlp_tune_begin"):
            _ext.tune_end()


@needs_cuda_build
def test_tune_file_round_trip_and_corrupt_entries(tmp_path):
    fusedmlp.tune_clear()
    empty = tmp_path / "empty.json"
    fusedmlp.tune_save(empty)
    doc = json.loads(empty.read_text())
    assert doc["format"] == "fusedmlp-cublaslt-tune" and doc["version"] == 1
    assert doc["entries"] == []
    entry = {"device": "NVIDIA Test GPU", "key": list(range(1, 20)), "algo": "0" * 128,
             "workspace": 0, "us": 3.5}
    good = dict(doc, entries=[entry])
    path = tmp_path / "one.json"
    path.write_text(json.dumps(good))
    fusedmlp.tune_load(path)
    assert fusedmlp.tune_count() == 1
    bad = dict(doc, entries=[dict(entry, key=list(range(18)))])
    path.write_text(json.dumps(bad))
    with pytest.raises(RuntimeError, match='entry 0: "key"'):
        fusedmlp.tune_load(path)
    assert fusedmlp.tune_count() == 1  # a rejected file leaves the table
    path.write_text(json.dumps(dict(doc, cublaslt_version=1)))
    with pytest.raises(NotImplementedError, match="re-run `fusedmlp tune`"):
        fusedmlp.tune_load(path)
    fusedmlp.tune_clear()
    assert fusedmlp.tune_count() == 0


@pytest.mark.skipif(_ext.with_cuda(), reason="CUDA build: the table exists")
def test_tune_file_needs_cuda(tmp_path):
    with pytest.raises(NotImplementedError):
        fusedmlp.tune_save(tmp_path / "x.json")
