"""Saved results name their type (class, module, qualified name) and load back as it: the module
is imported when the type is not yet, files saved before the module was recorded still load, and
a type that cannot be found is an error naming it and the module to import."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxdepth.analyses.integrated_gradients import IntegratedGradientsResult
from jaxdepth.core.saved_result import UnknownResultTypeError
from jaxdepth.lab.results import load_result


def _result() -> IntegratedGradientsResult:
    P, L, T = 1, 2, 3
    return IntegratedGradientsResult(
        attributions=np.ones((P, L, T), np.float32),
        gap=np.zeros((P, L), np.float32),
        f_input=np.ones(P, np.float32),
        f_baseline=np.zeros((P, L), np.float32),
        tokens=np.arange(T)[None],
        lengths=np.array([T]),
        answer_start=np.array([1]),
        settings={"rule": "left", "steps": 4},
    )


def _header(path) -> dict:
    with np.load(path) as data:
        return json.loads(data["__meta__"].tobytes().decode())


def _rewrite_header(path, **changes) -> str:
    """Change the JSON header of a saved result (a value None drops the key), as an older or other
    writer would have written it."""
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    meta = _header(path)
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(path, **arrays)
    return str(path)


def test_a_saved_result_records_its_type_module_and_qualified_name(tmp_path):
    path = _result().save(str(tmp_path / "ig.npz"))
    meta = _header(path)
    assert (meta["type"], meta["type_module"], meta["type_qualname"]) == (
        "IntegratedGradientsResult",
        "jaxdepth.analyses.integrated_gradients",
        "IntegratedGradientsResult",
    )
    back = load_result(path)
    assert type(back) is IntegratedGradientsResult and back.settings == {"rule": "left", "steps": 4}


def test_a_file_saved_without_the_module_still_loads_when_its_type_is_known(tmp_path):
    path = _rewrite_header(_result().save(str(tmp_path / "ig.npz")), type_module=None, type_qualname=None)
    back = load_result(path)
    assert type(back) is IntegratedGradientsResult
    np.testing.assert_array_equal(back.attributions, _result().attributions)


def test_a_type_whose_module_moved_loads_by_its_name(tmp_path):
    path = _rewrite_header(_result().save(str(tmp_path / "ig.npz")), type_module="jaxdepth.analyses.moved_away")
    assert type(load_result(path)) is IntegratedGradientsResult


def test_a_type_that_cannot_be_found_is_an_error_naming_it_and_its_module(tmp_path):
    saved = _result().save(str(tmp_path / "ig.npz"))
    old = _rewrite_header(saved, type="GoneResult", type_module=None, type_qualname=None)
    with pytest.raises(
        UnknownResultTypeError,
        match=r"unknown result type 'GoneResult'; the file does not record "
        r"the module that defines it",
    ):
        load_result(old)
    path = _rewrite_header(saved, type="GoneResult", type_module="no_such_results_module", type_qualname="GoneResult")
    with pytest.raises(
        ValueError,
        match=r"result type 'GoneResult' is defined in the module 'no_such_results_module', "
        r"which cannot be imported \(ModuleNotFoundError: .*`import "
        r"no_such_results_module` works",
    ):
        load_result(path)
    path = _rewrite_header(saved, type="GoneResult", type_module="json", type_qualname="GoneResult")
    with pytest.raises(
        UnknownResultTypeError,
        match=r"result type 'GoneResult': the module 'json' defines no "
        r"SavedResult GoneResult",
    ):
        load_result(path)
