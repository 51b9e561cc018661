"""A search over layer programs per prompt (CoLa, arXiv 2507.07996): which chain of layers,
shorter than the model or rearranged, still answers a prompt right, or answers right a prompt
the model gets wrong.

A program is the sequence of layers a run applies (`jaxdepth.core.structure`): the intact
model is 0, 1, ..., L-1. The search starts from it and runs rounds. In each round every kept
program of every prompt is edited in each way of `ProgramSearch.edits`:

- 'skip': one step left out;
- 'repeat': one step run twice in a row;
- 'swap': two neighbouring steps exchanged;

and every new candidate of every prompt is scored in one batched sweep (the programs are data,
padded to one length, so every round reuses the same compiled programs). A program is *right*
for a prompt when, with `score='generation'`, the answer it generates (greedy) reads as the
reference does (`jaxdepth.analyses.answers.same_answer`), or, with `score='likelihood'`, its
teacher-forced log-likelihood of the reference answer is within `margin` nats of the intact
model's. Each prompt keeps its best `keep` programs, ranked: right first; then, for a prompt
the intact model answers right, the shorter first (the search is for a shorter chain), and for
one it answers wrong, the likelier first (the search is for a fix); ties to the likelier, then
the shorter.

Reported per prompt: whether the intact model is right, the shortest right program found (for
a prompt it answers right) and the right programs found (for one it answers wrong: the fixes).
Over the prompts, CoLa's two numbers: the share of right prompts with a right program shorter
than L, and the share of wrong prompts with a fix. The baseline is Gromov et al.'s angular rule
(arXiv 2403.17887): for a right prompt whose shortest program has n fewer layers, the block of n
layers that rule drops (the start where the residuals n layers apart are closest in angle, over
the prompts), scored the same way.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import TYPE_CHECKING, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdepth.analyses.answers import cut_generation, same_answer
from jaxdepth.analyses.layer_structure import angular_distances, generations, gromov_choice, new_tokens_for
from jaxdepth.analyses.suite import Analysis, Settings, option
from jaxdepth.core.batch import PromptBatch
from jaxdepth.core.compilation import jit
from jaxdepth.core.config import ModelConfig
from jaxdepth.core.decoding import Decoding
from jaxdepth.core.execution import Execution
from jaxdepth.core.loops import LayerRun, run_layers
from jaxdepth.core.model import embed, token_per_layer_inputs, unembed
from jaxdepth.core.progress import track
from jaxdepth.core.saved_result import SavedResult
from jaxdepth.core.structure import LayerOrder
from jaxdepth.core.sweep import member_bytes

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the analysis
    from matplotlib.figure import Figure

__all__ = [
    "ProgramSearch",
    "ProgramSearchResult",
    "search_programs",
    "beam_search",
    "Searched",
    "edited_programs",
    "program_order",
    "score_programs",
    "program_figure",
    "ProgramSettings",
    "ANALYSIS",
    "EDITS",
    "SCORES",
]

EDITS = ("skip", "repeat", "swap")
SCORES = ("generation", "likelihood")


@dataclasses.dataclass(frozen=True)
class ProgramSearch:
    """What the search does: `rounds` of the `edits` (a subset of `EDITS`), keeping the best
    `keep` programs per prompt, scored by `score` ('generation': the greedy answer of up to
    `max_new_tokens` tokens, ending at `eos_ids`, is right; 'likelihood': the answer's
    log-likelihood within `margin` nats of the intact model's). A program runs at most
    `max_extra` steps more than the model has layers (repeats lengthen it)."""

    rounds: int = 3
    keep: int = 2
    edits: tuple = EDITS
    score: str = "generation"
    margin: float = 0.5
    max_new_tokens: int = 16
    eos_ids: tuple = ()
    max_extra: int = 2

    def __post_init__(self):
        unknown = set(self.edits) - set(EDITS)
        if unknown or not self.edits:
            raise ValueError(f"edits are some of {EDITS}, got {self.edits}")
        if self.score not in SCORES:
            raise ValueError(f"score is one of {SCORES}, got {self.score!r}")
        for name in ("rounds", "keep", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.margin < 0 or self.max_extra < 0:
            raise ValueError(f"margin and max_extra must be >= 0, got {self.margin}, {self.max_extra}")


def edited_programs(program: tuple, edits: Sequence[str], max_length: int) -> list[tuple]:
    """Every program one edit of `edits` away from `program` (a tuple of layer indices), in a
    fixed order (skips, repeats, swaps, each from the first step), none empty, none longer than
    `max_length`, none equal to `program`, each once."""
    out: list[tuple] = []
    n = len(program)
    if "skip" in edits and n > 1:
        out += [program[:i] + program[i + 1 :] for i in range(n)]
    if "repeat" in edits and n < max_length:
        out += [program[: i + 1] + program[i:] for i in range(n)]
    if "swap" in edits:
        out += [program[:i] + (program[i + 1], program[i]) + program[i + 2 :] for i in range(n - 1)]
    return [p for p in dict.fromkeys(out) if p != program]


def program_order(program: Sequence[int], length: int) -> LayerOrder:
    """`program` as a `LayerOrder [length, 1]`, its steps first and unused steps after (every
    program of a search shares one shape, one compiled program)."""
    if not 1 <= len(program) <= length:
        raise ValueError(f"a program of {len(program)} steps does not fit {length}")
    layers = np.zeros((length, 1), np.int32)
    layers[: len(program), 0] = program
    return LayerOrder(layers, (np.arange(length) < len(program))[:, None])


@partial(jit, static_argnames="config")
def _likelihoods(params, tokens, valid, positions, real, orders, config: ModelConfig):
    """`[M]`: each member's summed log-probability of its answer tokens (`positions [M, A]` the
    positions predicting them, `real [M, A]`), run under its order `[M, N, 1]`. The LM head runs
    at the answer positions only."""

    def one(tok, val, pos, keep, layers, used):
        h, _ = run_layers(
            params,
            embed(params, tok[None], config),
            config,
            valid=val[None],
            run=LayerRun(order=LayerOrder(layers, used)),
            per_layer_inputs=token_per_layer_inputs(params, tok[None], config),
        )
        logp = jax.nn.log_softmax(unembed(params, h[0, pos], config).astype(jnp.float32), axis=-1)
        targets = tok[jnp.minimum(pos + 1, tok.shape[0] - 1)]
        return jnp.sum(jnp.where(keep, jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0], 0.0))

    return jax.vmap(one)(tokens, valid, positions, real, orders.layers, orders.used)


@dataclasses.dataclass(frozen=True)
class _Prompts:
    """What scoring reads of the prompts: the whole prompts and their answer positions (for
    likelihoods), the questions alone (for generation) and the reference texts."""

    tokens: np.ndarray
    valid: np.ndarray
    positions: np.ndarray
    real: np.ndarray
    questions: np.ndarray
    asked: np.ndarray
    references: list


def _prompts(batch: PromptBatch, decode) -> _Prompts:
    if (batch.answer_start >= batch.lengths).any():
        raise ValueError("every prompt needs a reference answer: answer_start is past a prompt's end")
    pairs = [batch.answer_positions(i) for i in range(len(batch))]
    A = max(len(p) for p, _ in pairs)
    pad = lambda x, fill: np.concatenate([x, np.full(A - len(x), fill, x.dtype)])  # noqa: E731
    Q = int(np.max(batch.answer_start))
    references = None
    if decode is not None:
        references = [
            decode([int(t) for t in r[a:n]]) for r, a, n in zip(batch.tokens, batch.answer_start, batch.lengths)
        ]
    return _Prompts(
        tokens=np.asarray(batch.tokens, np.int32),
        valid=np.asarray(batch.valid, bool),
        positions=np.stack([pad(p, p[-1]) for p, _ in pairs]).astype(np.int32),
        real=np.stack([pad(r, False) for _, r in pairs]),
        questions=np.asarray(batch.tokens[:, :Q], np.int32),
        asked=np.arange(Q)[None, :] < np.asarray(batch.answer_start)[:, None],
        references=references,
    )


def score_programs(
    params, prompts: _Prompts, config: ModelConfig, members, search: ProgramSearch, execution: Execution, decode
) -> tuple[np.ndarray, np.ndarray, list]:
    """`(loglik [M], right [M], texts [M])` of `members`, `(prompt, program)` pairs, all in
    chunked vmapped sweeps of one shape (`Execution.chunk`): the answer's log-likelihood always;
    with `search.score` 'generation', whether the greedy answer reads as the reference does and
    the answer read (its text cut as `cut_generation` cuts it); with 'likelihood', None and
    None (the caller holds the likelihood against the margin)."""
    length = config.num_layers + search.max_extra
    index = np.array([p for p, _ in members], np.int64)
    orders = [program_order(program, length) for _, program in members]
    layers = np.stack([o.layers for o in orders])
    used = np.stack([o.used for o in orders])
    T = prompts.tokens.shape[1]
    chunk = execution.chunk(len(members), member_bytes(config, T))
    loglik = np.zeros(len(members))
    right = None if search.score == "likelihood" else np.zeros(len(members), bool)
    texts = None if right is None else [None] * len(members)
    eos = {int(e) for e in search.eos_ids}
    for start in track(range(0, len(members), chunk), execution.progress, "scoring layer programs (chunks)"):
        pick = np.arange(start, min(start + chunk, len(members)))
        filled = np.concatenate([pick, np.repeat(pick[-1:], chunk - len(pick))])  # one shape for every chunk
        p, order = index[filled], LayerOrder(layers[filled], used[filled])
        values = _likelihoods(
            params, prompts.tokens[p], prompts.valid[p], prompts.positions[p], prompts.real[p], order, config
        )
        loglik[pick] = np.asarray(values)[: len(pick)]
        if right is not None:
            # each member's greedy continuation of its own question `[1, Q]` under its order
            out = generations(
                params,
                prompts.questions[p][:, None],
                prompts.asked[p][:, None],
                order,
                config,
                search.max_new_tokens,
                Decoding(eos_ids=tuple(sorted(eos))),
                axes=(0, 0, 0),
            )
            new, counts = np.asarray(out.tokens)[:, 0], np.asarray(out.lengths)[:, 0]
            for k, m in enumerate(pick):
                text = cut_generation(decode([int(t) for t in new[k, : counts[k]] if int(t) not in eos]))
                right[m], texts[m] = same_answer(text, prompts.references[index[m]]), text
    return loglik, right, texts


@dataclasses.dataclass
class ProgramSearchResult(SavedResult):
    """What the search found for `N` prompts of a model of `num_layers` layers: per prompt
    `intact_right [N]` and `intact_loglik [N]`; `shortest [N]` (the shortest right program
    found, a list of layers, for a prompt the intact model answers right; None otherwise, and
    the intact order where nothing shorter is right), `fixes [N]` (the right programs found for
    a prompt it answers wrong, each a list of layers, the likeliest first; empty for the
    others), `answers [N]` (with `score='generation'`, the answer the shortest program, or the
    first fix, generated, as read; None elsewhere), `gromov [N]` (for a
    right prompt whose shortest program is n layers shorter, the angular rule's block of n
    dropped, and `gromov_right [N]` whether it stays right; None and False elsewhere);
    `scored [rounds]` candidates scored per round; `settings` the search's."""

    intact_right: np.ndarray
    intact_loglik: np.ndarray
    shortest: list
    fixes: list
    answers: list
    gromov: list
    gromov_right: np.ndarray
    scored: np.ndarray
    num_layers: int
    settings: dict

    def shares(self) -> dict:
        """CoLa's two numbers and the baseline's: 'shorter' (of the right prompts, the share
        with a right program shorter than L), 'fixed' (of the wrong prompts, the share with a
        fix), 'gromov' (of the right prompts with a shorter program, the share where the angular
        rule's drop of the same size stays right); NaN where no prompt counts."""
        right = self.intact_right.astype(bool)
        shorter = np.array([s is not None and len(s) < self.num_layers for s in self.shortest])
        mean = lambda x: float(np.mean(x)) if np.size(x) else float("nan")  # noqa: E731
        return {
            "shorter": mean(shorter[right]),
            "fixed": mean([bool(f) for f, r in zip(self.fixes, right) if not r]),
            "gromov": mean(self.gromov_right[right & shorter]),
        }


def _rank(intact_right: bool, length: int, loglik: float, right: bool) -> tuple:
    """Sort key of a program for a prompt (module docstring): smaller is better."""
    if intact_right:
        return (not right, length, -loglik)
    return (not right, -loglik, length)


@dataclasses.dataclass(frozen=True)
class Searched:
    """What `beam_search` found, per prompt: `right0 [N]` and `loglik0 [N]` of the intact
    model, `shortest`, `fixes` and `answers` as `ProgramSearchResult` holds them, and `scored`,
    the candidates scored per round."""

    right0: np.ndarray
    loglik0: np.ndarray
    shortest: list
    fixes: list
    answers: list
    scored: list


def beam_search(score, num_prompts: int, num_layers: int, search: ProgramSearch) -> Searched:
    """The search's rounds (module docstring) for `num_prompts` prompts of a model of
    `num_layers` layers, whatever scores them: `score(members)`, for a list of `(prompt,
    program)` pairs, returns `(loglik [M], right [M] or None, texts [M] or None)` as
    `score_programs` does (a likelihood search judges `loglik` against the margin itself)."""
    L, N = num_layers, num_prompts
    intact = tuple(range(L))
    loglik0, right0, texts0 = score([(p, intact) for p in range(N)])
    if right0 is None:
        right0 = np.ones(N, bool)  # within any margin of itself
    judge = lambda p, ll, r: bool(r) if search.score == "generation" else bool(ll >= loglik0[p] - search.margin)  # noqa: E731
    seen = [{intact} for _ in range(N)]
    kept = [[(intact, float(loglik0[p]), bool(right0[p]))] for p in range(N)]
    found = [dict() for _ in range(N)]  # every right program: its log-likelihood
    said = [{intact: None if texts0 is None else texts0[p]} for p in range(N)]  # every answer read
    scored = []
    for _ in range(search.rounds):
        members = []
        for p in range(N):
            for program, _, _ in kept[p]:
                for candidate in edited_programs(program, search.edits, L + search.max_extra):
                    if candidate not in seen[p]:
                        seen[p].add(candidate)
                        members.append((p, candidate))
        scored.append(len(members))
        if not members:
            break
        loglik, right, texts = score(members)
        for m, (p, program) in enumerate(members):
            ok = judge(p, loglik[m], None if right is None else right[m])
            said[p][program] = None if texts is None else texts[m]
            kept[p].append((program, float(loglik[m]), ok))
            if ok:
                found[p][program] = float(loglik[m])
        for p in range(N):
            kept[p] = sorted(kept[p], key=lambda k: _rank(bool(right0[p]), len(k[0]), k[1], k[2]))[: search.keep]
    shortest, fixes, answers = [], [], []
    for p in range(N):
        if right0[p]:
            best = min([intact] + list(found[p]), key=lambda prog: (len(prog), -found[p].get(prog, loglik0[p])))
            shortest.append(list(best))
            fixes.append([])
            answers.append(said[p][best])
        else:
            shortest.append(None)
            fixes.append([list(prog) for prog in sorted(found[p], key=lambda prog: -found[p][prog])])
            answers.append(said[p][tuple(fixes[-1][0])] if fixes[-1] else None)
    return Searched(np.asarray(right0, bool), np.asarray(loglik0, np.float64), shortest, fixes, answers, scored)


def search_programs(
    params,
    batch: PromptBatch,
    config: ModelConfig,
    decode,
    search: ProgramSearch = ProgramSearch(),
    *,
    execution: Execution = Execution(),
) -> ProgramSearchResult:
    """The search over layer programs (module docstring) on the prompts of `batch` (a
    `PromptBatch` whose answers, from `answer_start`, are the references): `decode` turns token
    ids into text (a tokenizer's; needed for `score='generation'`), `search` says what the
    search does, `execution` how its sweeps run (chunk size, memory budget, progress)."""
    if search.score == "generation" and decode is None:
        raise ValueError("scoring by generation reads answers as text: give decode (a tokenizer's)")
    L, N = config.num_layers, len(batch)
    prompts = _prompts(batch, decode)

    def score(members):
        return score_programs(params, prompts, config, members, search, execution, decode)

    found = beam_search(score, N, L, search)
    shortest, loglik0 = found.shortest, found.loglik0
    judge = lambda p, ll, r: bool(r) if search.score == "generation" else bool(ll >= loglik0[p] - search.margin)  # noqa: E731
    # the baseline: the angular rule's drop of as many layers as each right prompt's shortest program removes
    removed = [L - len(s) if s is not None else 0 for s in shortest]
    gromov, gromov_right = [None] * N, np.zeros(N, bool)
    sizes = sorted({n for n in removed if 0 < n < L})
    if sizes:
        blocks = gromov_choice(angular_distances(params, batch, config, max(sizes)))
        members = []
        for p, n in enumerate(removed):
            if 0 < n < L:
                block = blocks[n - 1]
                program = tuple(l for l in range(L) if not block.start <= l < block.start + n)
                gromov[p] = list(program)
                members.append((p, program))
        loglik, right, _ = score(members)
        for m, (p, _) in enumerate(members):
            gromov_right[p] = judge(p, loglik[m], None if right is None else right[m])
    return ProgramSearchResult(
        intact_right=found.right0,
        intact_loglik=loglik0,
        shortest=shortest,
        fixes=found.fixes,
        answers=found.answers,
        gromov=gromov,
        gromov_right=gromov_right,
        scored=np.asarray(found.scored, np.int64),
        num_layers=L,
        settings=dataclasses.asdict(search),
    )


# ----------------------------------------------------------------------------- figure, summary, suite


def _runs_per_layer(program, num_layers: int) -> np.ndarray:
    """How many times `program` runs each layer `[L]` (0: skipped, 2: repeated)."""
    return np.bincount(np.asarray(program, np.int64), minlength=num_layers)


def program_figure(result: ProgramSearchResult) -> "Figure":
    """Left: each prompt's program, layer by layer (how many times it runs each layer: 0
    skipped, 1, 2 repeated), the shortest right one for a prompt the model answers right, the
    first fix for one it answers wrong (rows of neither: nothing found). Right: CoLa's two
    shares and the angular rule's baseline."""
    from jaxdepth.analyses import drawing as d

    d.expect(result, ProgramSearchResult, "program_figure")
    L, N = result.num_layers, len(result.shortest)
    runs = np.full((N, L), np.nan)
    labels = []
    for p, (shortest, fixes, right) in enumerate(zip(result.shortest, result.fixes, result.intact_right)):
        program = shortest if right else (fixes[0] if fixes else None)
        if program is not None:
            runs[p] = _runs_per_layer(program, L)
        what = f"{len(program)} steps" if program is not None else "no fix found"
        labels.append(f"prompt {p} ({'right' if right else 'wrong'}: {what})")
    from matplotlib.colors import ListedColormap

    fig = d.new_figure(14, max(3.6, 1.8 + 0.3 * N))
    grid_ax, share_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.6, 1]})
    most = int(max(2, np.nanmax(runs, initial=2)))
    colors = ListedColormap(["#e6e6e6", "#4c72b0", "#dd8452", "#c44e52", "#8172b2"][: most + 1])
    image = grid_ax.imshow(runs, aspect="auto", cmap=colors, vmin=-0.5, vmax=most + 0.5, interpolation="nearest")
    grid_ax.set_yticks(np.arange(N), labels, fontsize="small")
    grid_ax.set(xlabel="layer", title="the program found per prompt: how many times it runs each layer")
    fig.colorbar(image, ax=grid_ax, label="runs (0: skipped)", ticks=np.arange(most + 1))
    shares = result.shares()
    names = [
        "right prompts with a\nshorter right program",
        "wrong prompts fixed",
        "the angular rule's drop\nstays right",
    ]
    values = [shares["shorter"], shares["fixed"], shares["gromov"]]
    y = np.arange(3)
    share_ax.barh(y, np.nan_to_num(values), color=["C0", "C2", "C7"])
    for row, v in zip(y, values):
        share_ax.text(np.nan_to_num(v) + 0.02, row, "n/a" if np.isnan(v) else f"{100 * v:.0f}%", va="center")
    share_ax.set_yticks(y, names, fontsize="small")
    share_ax.invert_yaxis()
    share_ax.set(xlim=(0, 1.15), xlabel="share of prompts", title=f"scored by {result.settings['score']}")
    d.title_figure(fig, "Layer programs per prompt", None, result.settings)
    return fig


def _summary(result: ProgramSearchResult) -> list[str]:
    """CoLa's two numbers, the baseline, and the mean length of the shortest right programs."""
    shares = result.shares()
    pct = lambda v: "n/a" if np.isnan(v) else f"{100 * v:.0f}%"  # noqa: E731
    lengths = [len(s) for s in result.shortest if s is not None]
    return [
        f"right prompts with a shorter right program {pct(shares['shorter'])}, wrong ones fixed "
        f"{pct(shares['fixed'])}; the angular rule's drop of the same size stays right {pct(shares['gromov'])}",
        f"shortest right program {np.mean(lengths):.1f} of {result.num_layers} layers on average"
        if lengths
        else "no prompt answered right",
    ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramSettings(Settings):
    """The search over layer programs in a study (`Settings` and its options)."""

    program_rounds: int = option(3, "layer programs: rounds of edits")
    program_keep: int = option(2, "layer programs: the programs kept per prompt after each round")
    program_edits: tuple = option(EDITS, "layer programs: the edits, some of skip, repeat, swap")
    program_score: str = option("generation", "layer programs: what makes a program right", choices=SCORES)
    program_margin: float = option(0.5, "layer programs: the likelihood margin (nats) of score likelihood")
    program_new_tokens: int = option(
        -1, "layer programs: new tokens per generated answer (-1: the longest reference answer's length plus 8)"
    )

    def __post_init__(self):
        super().__post_init__()
        self.search(1)  # the search's own checks, at once

    def search(self, new_tokens: int, eos_ids: tuple = ()) -> ProgramSearch:
        """These settings as a `ProgramSearch`, `new_tokens` per generated answer."""
        return ProgramSearch(
            rounds=self.program_rounds,
            keep=self.program_keep,
            edits=tuple(self.program_edits),
            score=self.program_score,
            margin=self.program_margin,
            max_new_tokens=new_tokens,
            eos_ids=eos_ids,
        )


def _run(x) -> ProgramSearchResult:
    tokenizer = x.model.tokenizer
    if x.settings.program_score == "generation" and tokenizer is None:
        raise ValueError("layer programs scored by generation read answers as text: the model needs a tokenizer")
    setting = x.settings.program_new_tokens
    new_tokens = new_tokens_for(x.batch, setting)
    eos = getattr(tokenizer, "eos_token_id", None)
    return search_programs(
        x.model.params,
        x.batch,
        x.model.config,
        None if tokenizer is None else tokenizer.decode,
        x.settings.search(new_tokens, () if eos is None else (int(eos),)),
        execution=Execution(progress=x.progress, memory_budget=x.settings.memory_budget),
    )


ANALYSIS = Analysis(
    name="layer_programs",
    default=False,  # in the suite, run when named: `--analyses layer_programs`
    result_type=ProgramSearchResult,
    settings=ProgramSettings,
    identity=lambda s: {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name.startswith("program_")},
    run=_run,
    figures=lambda r, tokenizer, n: {"": program_figure(r)},
    summary=_summary,
    detail=True,
)
