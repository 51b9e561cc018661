"""The chunk-width experiment runs the study's IG of one layer at each width and prints its
table; the widths change the time, not the attributions."""

import json
import os
import sys

import jax.numpy as jnp
import numpy as np

from conftest import save_tiny_checkpoint
from jaxdepth.analyses.ig.rules import quadrature
from jaxdepth.core.batch import LengthBuckets
from jaxdepth.lab.prompts import encode, format_short
from jaxdepth.lab.sources import load

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
import ig_chunk_width as experiment  # noqa: E402
import study_ig_paths as paths  # noqa: E402

ROW = {
    "question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7",
}


def test_each_width_is_timed_and_gives_the_same_attributions(tmp_path, capsys):
    checkpoint = save_tiny_checkpoint(str(tmp_path / "tiny"), context=256)
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    argv = [
        "--model",
        checkpoint,
        "--data",
        str(data),
        "--steps",
        "8",
        "--widths",
        "3,8,auto",
        "--repeat",
        "1",
        "--quiet-timeout",
        "0",
    ]
    assert experiment.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "width" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["3", "8", "8"]  # auto: the memory bound, all 8 steps
    assert [row.split("|")[2].strip() for row in rows] == ["3", "1", "1"]
    assert [row.split("|")[3].strip() for row in rows] == ["3", "8", "8"]
    assert all(float(row.split("|")[4]) > 0 for row in rows)

    model = load(checkpoint)
    prompt = encode(model.tokenizer, [format_short(ROW)], context=256).prompt(0, LengthBuckets(4, geometric=False))
    x, b, inputs, _ = paths.ig_inputs(model.params, prompt, model.config)
    alphas, weights = (jnp.asarray(v, jnp.float32) for v in quadrature("left", 8))
    path = paths.study_path(x, b, inputs, 0, "layer")
    by_width = [
        np.asarray(
            paths.ig_of_layer(
                model.params, prompt, jnp.int32(0), path, model.config, alphas=alphas, weights=weights, chunk_size=w
            )[0]
        )
        for w in (3, 8)
    ]
    np.testing.assert_allclose(by_width[0], by_width[1], rtol=1e-5, atol=1e-7)
