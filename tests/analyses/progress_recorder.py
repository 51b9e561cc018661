"""What the tests of an `Execution` reaching an analysis's sweep read: the bars it opens (a
tqdm-like class of one's own) and the chunk sizes it hands its vmapped sweep."""


def bar_recorder():
    """`(Recorder, bars)`: a tqdm-like class, what `Execution(progress=...)` takes, and the list
    of the bars it opened, each holding its `desc`, `total` and the steps `done`."""
    bars = []

    class Recorder:
        def __init__(self, total, desc, initial=0):
            self.desc, self.total, self.done = desc, total, 0
            bars.append(self)

        def update(self, n=1):
            self.done += n

        def set_postfix(self, **_):
            pass

    return Recorder, bars


def record_chunks(monkeypatch, module) -> list:
    """The chunk sizes `module`'s sweeps are handed: its `sweep` wrapped (for the test) so that
    every call appends its chunk and computes what it computed."""
    chunks = []
    vmapped = module.sweep
    monkeypatch.setattr(module, "sweep", lambda fn, members, chunk: chunks.append(chunk) or vmapped(fn, members, chunk))
    return chunks
