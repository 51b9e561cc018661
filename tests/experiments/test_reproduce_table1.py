"""Table 1 of the second study: the published numbers as recorded, and the reproduction script
end to end on tiny checkpoints standing in for a base model and its long-CoT distillation."""

import json
import os
import shutil
import sys

import pytest

from conftest import save_tiny_checkpoint
from jaxdepth.lab import published

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
import reproduce_table1 as reproduce  # noqa: E402


def test_published_table_has_all_twelve_models_and_every_pair():
    assert len(published.TABLE1) == 12
    for _, base, cot in published.LONG_COT_PAIRS:
        assert base in published.TABLE1 and cot in published.TABLE1
        assert published.TABLE1[base][0] == published.TABLE1[cot][0]  # same depth: a distillation
    assert reproduce.MODELS == list(published.TABLE1)


@pytest.mark.parametrize(
    "model, dataset, method, printed_ratio",
    [
        # ratios as the study prints them next to each ED: (ED + 1) / L rounded to 2 digits
        ("Qwen/Qwen2.5-Math-7B", "gsm8k", "cosine", 0.43),
        ("Qwen/Qwen2.5-14B-Instruct", "gsm8k", "cosine", 0.69),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "gsm8k", "kl", 0.07),
        ("Qwen/Qwen2.5-32B", "hellaswag", "overlap", 0.97),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "gsm8k", "kl", 0.88),
    ],
)
def test_published_ratios_follow_the_methods_definition(model, dataset, method, printed_ratio):
    row = next(
        r for r in published.published_rows() if (r["model"], r["dataset"], r["method"]) == (model, dataset, method)
    )
    assert round(row["ratio"], 2) == printed_ratio


def _gsm8k_rows(path):
    rows = [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
            "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
        }
        for a, b in [(3, 4), (12, 9), (7, 30)]
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_reproduction_on_tiny_stand_ins(tmp_path):
    checkpoint = save_tiny_checkpoint(str(tmp_path / "tiny"), context=1024)
    local = tmp_path / "hub"
    _, base, cot = published.LONG_COT_PAIRS[0]
    for name in (base, cot):
        shutil.copytree(checkpoint, local / name.split("/")[-1])
    out = tmp_path / "out"
    reproduce.main(
        [
            "--models",
            base,
            cot,
            "--datasets",
            "gsm8k",
            "--prompts",
            "3",
            "--dtype",
            "float32",
            "--local-dir",
            str(local),
            "--data",
            f"gsm8k={_gsm8k_rows(tmp_path / 'gsm8k.jsonl')}",
            "--out",
            str(out),
        ]
    )
    comparison = (out / "table1_vs_published.md").read_text()
    for name in (base, cot):
        line = next(l for l in comparison.splitlines() if l.startswith(f"| {name} | gsm8k |"))
        ours, theirs = line.split("|")[4].split(" / ")
        assert ours.strip() != "-"  # our result is in the table ...
        assert theirs.strip() == "{} ({:.2f})".format(
            *[
                (r["ed"], r["ratio"])
                for r in published.published_rows()
                if (r["model"], r["dataset"], r["method"]) == (name, "gsm8k", "cosine")
            ][0]
        )  # ... next to theirs
    assert (out / "table1.md").is_file()
    for figure in (
        "base_vs_long_cot.png",
        "contributions_gsm8k_relative_depth.png",
        "logit_lens_gsm8k_relative_depth.png",
    ):
        assert (out / "figures" / figure).stat().st_size > 5000
