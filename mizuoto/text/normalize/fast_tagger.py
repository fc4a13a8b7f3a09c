"""A faster machine for the wetext tagger, with the same paths and path costs, for long-text pieces.

Composition with the tagger opens ~1,000 hypotheses per input byte for English; most are
chains of arcs that read nothing and write one byte each (the spoken words of a number, the
`cardinal { integer: "` markup). Two rewrites shrink that without changing any path's input,
output or cost:

* an input without certain bytes (ASCII digits; all of ASCII) never takes an arc that reads
  one, so those arcs are dropped and the machine trimmed to its start-to-final states;
* a chain of zero-cost, read-nothing arcs through states with one way in and one way out is
  one arc whose output is the chain's bytes, written as one new output symbol.

Costs are float32 sums of the same non-zero terms in the same order, so the best path only
could differ between exactly tied paths; the tests compare against kaldifst's TextNormalizer.
"""

from __future__ import annotations

from pathlib import Path

import kaldifst

_FIRST_SYMBOL = 256  # output labels 1..255 are bytes; higher ones name byte strings

_DROPPED: dict[str, frozenset[int]] = {
    "full": frozenset(),
    "no_digits": frozenset(range(0x30, 0x3A)),
    "no_ascii": frozenset(range(0x01, 0x80)),
}

# ilabel, olabel, weight, nextstate; a float32 weight is exact as a Python float and back.
_Arc = tuple[int, int, float, int]


def fast_tagger(fst_path: str | Path) -> FastTagger:
    """The shared FastTagger of a tagger file (its machines take seconds to build, so every normalizer reuses them)."""
    key = Path(fst_path).resolve()
    if key not in _SHARED:
        _SHARED[key] = FastTagger(key)
    return _SHARED[key]


class FastTagger:
    """The tagger at `fst_path`, read through reduced, chain-compressed machines (one per byte variant)."""

    def __init__(self, fst_path: str | Path) -> None:
        self.fst_path = Path(fst_path)
        self._arcs: list[list[_Arc]] | None = None
        self._machines: dict[str, tuple[kaldifst.StdVectorFst | None, list[bytes]]] = {}

    def _load(self) -> None:
        fst = kaldifst.StdVectorFst.read(str(self.fst_path))
        self._start = fst.start
        finals = ((s, fst.final(s).value) for s in range(fst.num_states))
        self._finals = {s: w for s, w in finals if w != float("inf")}
        self._arcs = [[(a.ilabel, a.olabel, a.weight.value, a.nextstate) for a in kaldifst.ArcIterator(fst, s)]
                      for s in range(fst.num_states)]

    def _machine(self, variant: str) -> tuple[kaldifst.StdVectorFst | None, list[bytes]]:
        if variant not in self._machines:
            if self._arcs is None:
                self._load()
            self._machines[variant] = self._build(_DROPPED[variant])
        return self._machines[variant]

    def _build(self, dropped: frozenset[int]) -> tuple[kaldifst.StdVectorFst | None, list[bytes]]:
        arcs = [[a for a in out if a[0] not in dropped] for out in self._arcs]
        live = _trim(arcs, self._start, self._finals)
        if self._start not in live:
            return None, []
        arcs = [[a for a in out if a[3] in live] if s in live else [] for s, out in enumerate(arcs)]
        indegree = [0] * len(arcs)
        for out in arcs:
            for a in out:
                indegree[a[3]] += 1
        inside = [indegree[s] == 1 and len(out) == 1 and out[0][0] == 0 and out[0][2] == 0.0
                  and s not in self._finals and s != self._start for s, out in enumerate(arcs)]

        kept = [s for s in sorted(live) if not inside[s]]
        number = {s: i for i, s in enumerate(kept)}
        machine = kaldifst.StdVectorFst()
        for _ in kept:
            machine.add_state()
        machine.start = number[self._start]
        symbols: dict[bytes, int] = {}
        for s in kept:
            if s in self._finals:
                machine.set_final(number[s], kaldifst.TropicalWeight(self._finals[s]))
            for ilabel, olabel, weight, target in arcs[s]:
                written = [olabel] if olabel else []
                while inside[target]:
                    _, chained, _, target = arcs[target][0]
                    if chained:
                        written.append(chained)
                if len(written) > 1:
                    label = symbols.setdefault(bytes(written), _FIRST_SYMBOL + len(symbols))
                else:
                    label = written[0] if written else 0
                machine.add_arc(number[s], kaldifst.StdArc(ilabel, label, weight, number[target]))
        kaldifst.arcsort(machine, sort_type="ilabel")
        return machine, list(symbols)

    def __call__(self, text: str, variant: str = "full") -> str:
        """The tagger's best output for `text` ('' when it has no path); `text` must avoid the variant's bytes."""
        machine, table = self._machine(variant)
        if machine is None:  # the variant accepts nothing
            return ""
        line = kaldifst.make_linear_acceptor(list(text.encode("utf-8")))
        best = kaldifst.shortest_path(kaldifst.compose(line, machine), 1)
        _, _, written, _ = kaldifst.get_linear_symbol_sequence(best)
        out = b"".join(table[x - _FIRST_SYMBOL] if x >= _FIRST_SYMBOL else bytes((x,)) for x in written)
        return out.decode("utf-8")


_SHARED: dict[Path, FastTagger] = {}


def _trim(arcs: list[list[_Arc]], start: int, finals: dict) -> set[int]:
    """States on some start-to-final path."""
    reached, stack = {start}, [start]
    while stack:
        for a in arcs[stack.pop()]:
            if a[3] not in reached:
                reached.add(a[3])
                stack.append(a[3])
    incoming: list[list[int]] = [[] for _ in arcs]
    for s in reached:
        for a in arcs[s]:
            incoming[a[3]].append(s)
    ending = {s for s in finals if s in reached}
    stack = list(ending)
    while stack:
        for s in incoming[stack.pop()]:
            if s not in ending:
                ending.add(s)
                stack.append(s)
    return ending
