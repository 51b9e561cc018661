"""The one way every command caches: a step's saved result is reused when its identity matches
and computed again otherwise, for results that keep their identity in their settings and for
those that keep it beside them; a result that grows in place refuses another identity."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from jaxdepth.core.saved_result import SavedResult
from jaxdepth.lab.runs import SIDECAR, Step, check_recorded_identity, identity_key, produce


@dataclasses.dataclass
class WithSettings(SavedResult):
    values: np.ndarray
    settings: dict


@dataclasses.dataclass
class WithoutSettings(SavedResult):
    values: np.ndarray


def _step(kind, identity, calls):
    def run():
        calls.append(identity)
        return kind(values=np.arange(3.0), settings={}) if kind is WithSettings else kind(values=np.arange(3.0))

    return Step(file="result.npz", result_type=kind, identity=identity, run=run)


@pytest.mark.parametrize("kind", [WithSettings, WithoutSettings])
def test_a_step_is_reused_when_its_identity_matches_and_computed_otherwise(kind, tmp_path):
    calls = []
    first = produce(_step(kind, {"seed": 1}, calls), str(tmp_path))
    assert not first.reused and first.seconds >= 0 and calls == [{"seed": 1}]
    again = produce(_step(kind, {"seed": 1}, calls), str(tmp_path))
    assert again.reused and len(calls) == 1
    np.testing.assert_array_equal(again.result.values, first.result.values)
    assert not produce(_step(kind, {"seed": 2}, calls), str(tmp_path)).reused and len(calls) == 2
    marker = tmp_path / ("result.npz" + SIDECAR)
    if kind is WithSettings:
        saved = WithSettings.load(str(tmp_path / "result.npz")).settings
        assert saved["identity"] == {"seed": 2} and "versions" in saved and not marker.exists()
    else:
        key, provenance = marker.read_text().splitlines()
        assert key == identity_key({"seed": 2})
        saved = json.loads(provenance)
    # where it ran, beside every result: one CPU device here, no mesh
    assert saved["devices"] == {
        "platform": "cpu",
        "device_kind": "cpu",
        "device_count": jax.device_count(),
        "process_count": 1,
        "mesh": None,
    }


def test_a_result_records_the_mesh_it_ran_on(tmp_path):
    from jaxdepth.core.sharding import make_mesh

    with jax.set_mesh(make_mesh(data=jax.device_count())):
        produce(_step(WithSettings, {"seed": 1}, []), str(tmp_path))
    saved = WithSettings.load(str(tmp_path / "result.npz")).settings
    assert saved["devices"]["mesh"] == {"data": jax.device_count(), "model": 1}


def test_a_result_without_its_identity_file_is_computed_again(tmp_path):
    calls = []
    produce(_step(WithoutSettings, {"seed": 1}, calls), str(tmp_path))
    os.remove(tmp_path / ("result.npz" + SIDECAR))  # as a run killed between the two writes leaves it
    assert not produce(_step(WithoutSettings, {"seed": 1}, calls), str(tmp_path)).reused


def test_a_recorded_identity_refuses_another(tmp_path):
    path = str(tmp_path / "lens.json")
    assert not check_recorded_identity(path, {"settings": {"steps": 4}, "data": {}})  # nothing recorded, none written
    assert not os.path.exists(path)
    assert not check_recorded_identity(path, {"settings": {"steps": 4}, "data": {}}, record=True)
    assert json.load(open(path)) == {"settings": {"steps": 4}, "data": {}}
    assert check_recorded_identity(path, {"settings": {"steps": 4}, "data": {}})
    with pytest.raises(ValueError, match=r"holds a lens trained with other settings \(\{'steps': 4\}, not"):
        check_recorded_identity(path, {"settings": {"steps": 5}, "data": {}}, what="a lens trained")
