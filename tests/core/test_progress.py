"""`jaxdepth.core.progress`: loops report how far they are as the caller asks, a driver included."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest

from conftest import tiny_config
from jaxdepth.analyses import erasure
from jaxdepth.core.batch import make_batch
from jaxdepth.core.model import random_params
from jaxdepth.core.execution import Execution
from jaxdepth.core.progress import LineProgress, progress_bar, track


class Recorder:
    """A tqdm-like callable of one's own: records what it is told, and each step as
    `(count after it, whether the bar was closed)`."""

    def __init__(self):
        self.bars = []
        self.steps = []

    def __call__(self, *, total, desc, initial=0):
        bar = {"total": total, "desc": desc, "done": initial, "closed": False}
        self.bars.append(bar)
        steps = self.steps

        class Bar:
            def update(self, n=1):
                bar["done"] += n
                steps.append((bar["done"], bar["closed"]))

            def close(self):
                bar["closed"] = True

        return Bar()


def test_track_counts_every_item_and_closes_the_bar_even_when_stopped_early():
    recorder = Recorder()
    assert list(track(range(4), recorder, "four")) == [0, 1, 2, 3]
    assert recorder.bars == [{"total": 4, "desc": "four", "done": 4, "closed": True}]
    for i in track(range(5), recorder, "stopped"):
        if i == 1:
            break
    assert recorder.bars[1]["done"] == 1 and recorder.bars[1]["closed"]
    assert list(track(range(3), False, "silent")) == [0, 1, 2]
    with progress_bar(recorder, total=9, desc="steps", initial=4) as bar:
        bar.update(2)
        bar.set_postfix(kl="0.1")  # a bar without set_postfix takes it too
    assert recorder.bars[2] == {"total": 9, "desc": "steps", "done": 6, "closed": True}
    with pytest.raises(TypeError, match="progress must be True, False, None or a tqdm-like callable"):
        list(track(range(2), "yes", "bad"))


def test_a_driver_reports_to_the_callers_progress():
    """Erasure's bar counts the position pieces of every prompt, a step as each piece finishes:
    one prompt's erasures can take minutes, and a bar over prompts sat at 0/1 through them."""
    config = tiny_config(num_layers=2)
    params = random_params(config, 0, scale=0.2)
    rng = np.random.default_rng(0)
    batch = make_batch([rng.integers(0, 97, 12).tolist(), rng.integers(0, 97, 10).tolist()], [8, 6])
    baseline = erasure.mean_residuals(params, batch, config)
    pieces = [erasure.pieces_to_run(batch.prompt(i)) for i in range(len(batch))]
    assert pieces == [2, 2]
    recorder = Recorder()
    result = erasure.residual_erasure(params, batch, config, baseline, execution=Execution(progress=recorder))
    assert recorder.bars == [{"total": 4, "desc": "residual erasure (position pieces)", "done": 4, "closed": True}]

    recorder = Recorder()  # one prompt: a step per piece, each before the end
    alone = erasure.residual_erasure(
        params, batch.select(slice(0, 1)), config, baseline, execution=Execution(progress=recorder)
    )
    assert recorder.steps == [(1, False), (2, False)] and recorder.bars[0]["closed"]
    n = int(batch.lengths[0])
    np.testing.assert_array_equal(alone.effects[0, :, :n], result.effects[0, :, :n])


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_true_writes_whole_lines_where_stderr_is_not_a_terminal(capsys):
    """Piped or logged, a bar is lines (no carriage return redrawing it): one as it starts, one
    per interval while it runs, one at the end; a loop stopped early says where it stopped."""
    assert not sys.stderr.isatty()  # capsys: what a pipe or a log file is
    for i in track(range(3), True, "three"):
        pass
    with progress_bar(True, total=10, desc="stopped", initial=2) as bar:
        bar.update(3)
    written = capsys.readouterr().err
    assert "\r" not in written and written.endswith("\n")
    lines = written.splitlines()
    assert lines[0] == "three: 0/3" and lines[2:] == ["stopped: 2/10", "stopped: stopped at 5/10"], lines
    assert lines[1].startswith("three: 3/3 in ") and lines[1].endswith(" s"), lines

    clock, out = Clock(), io.StringIO()
    bar = LineProgress(total=8, desc="steps", file=out, interval=30.0, clock=clock)
    for seconds in (10, 25, 31, 40, 65, 70, 80):  # lines at 31 s and 65 s: 30 s or more after the last
        clock.now = seconds
        bar.set_postfix(kl="0.1")
        bar.update(1)
    clock.now = 90
    bar.update(1)
    bar.close()
    assert out.getvalue().splitlines() == [
        "steps: 0/8",
        "steps: 3/8 (37%), 31 s [kl=0.1]",
        "steps: 5/8 (62%), 65 s [kl=0.1]",
        "steps: 8/8 in 90.0 s [kl=0.1]",
    ]


def test_progress_true_is_tqdms_bar_on_a_terminal(monkeypatch):
    from tqdm.auto import tqdm

    from jaxdepth.core import progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert progress._default_bar() is tqdm
