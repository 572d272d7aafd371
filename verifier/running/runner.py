"""Where the certified pass runs: the weights cut to shards, one runner.

A verification sends batches of queries (:mod:`verifier.passes.batches`) through a certified
forward pass and reads back, per query, the enclosures the checks decide on. This module
owns everything between the two:

* **the pass** (:class:`PassSpec`): the exact pass of :mod:`verifier.passes.forward` or the
  deployed pass of a floating-point format (:mod:`verifier.passes.floating`), both with
  ``run_batch(tokens, valid_ptr, valid, ablate, scores, target) -> BatchResult`` (the pass
  protocol, :class:`verifier.passes.protocol.Pass`); a spec is small and picklable, and the
  pass's tables are built where they are used;
* **a shard** (:class:`Shard`): weights, the task-set -> weights token map and a spec;
  :class:`ShardPart`: the weights *cut* to a cone of influence (some tasks' experts, some
  tokens: :mod:`verifier.running.shards`) and renumbered, whose results are the full pass's bit
  for bit for every row that stays inside it;
* **the runner** (:class:`Runner`): one implementation of *cut, run, defer, merge* for
  every way of running: on local processes over the full weights (the executor's ``map``),
  on a cluster over shards of tasks (``map_keyed``, one part per shard), and in
  re-certification over one cut, the cone of an edit (:meth:`Runner.run_cut`). A row that
  reaches outside its part (a token it does not hold, an expert that may win elsewhere) is
  *deferred*: run again over the full weights here, and its result merged in its place;
* **the allowed combinations** of pass, where it runs and whether query classes are
  recorded for a certificate (:data:`COMBINATIONS`), which also gives the refusals.

Results come back in the order the batches were sent, so a report never depends on where
they ran.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import scipy.sparse as sp

from layout import Weights
from tasks.errors import TaskError
from verifier.passes.floating import Deployment
from verifier.passes.dense import DensePass, DeployedDensePass, is_dense
from verifier.passes.factored import FactoredPass, Split
from verifier.passes.forward import BatchResult, Prepared
from verifier.passes.protocol import Pass


@dataclass(frozen=True)
class PassSpec:
    """Which pass to build for some weights: the exact one (``deployment`` None) or the
    deployed one of a floating-point format. ``gate_terms`` and ``vocab_size``: as
    :class:`verifier.passes.forward.Prepared` takes them (a cut of larger weights passes theirs, so
    that its enclosures are theirs bit for bit)."""

    deployment: Deployment | None = None
    gate_terms: int = 0
    vocab_size: int | None = None
    stages: Any = None          # verifier.passes.floating.Stages of the full weights, mapped to a cut's numbering
    #: the exact pass factored over cohorts (:mod:`verifier.passes.factored`) with the full
    #: weights' split, mapped to a cut's numbering; None: the plain pass
    split: Split | None = None
    #: the exact pass of dense weights on BLAS (:mod:`verifier.passes.dense`)
    dense: bool = False

    @staticmethod
    def for_taskset(taskset, weights: Weights, tmap: np.ndarray, deployment: Deployment | None = None) -> "PassSpec":
        """The pass that verifies ``taskset``'s queries: the exact pass factored over cohorts
        (the task set's entities own their terms), or the deployed pass of a format."""
        if is_dense(weights):
            return PassSpec(deployment, dense=True)
        if deployment is not None:
            return PassSpec(deployment)
        return PassSpec(split=Split.of(weights, tmap[taskset.vocabulary.n_words:]))

    @property
    def kind(self) -> str:
        return "exact" if self.deployment is None else "float"

    def build(self, weights: Weights, watch: np.ndarray | None = None) -> Pass:
        """The pass's tables for ``weights``; ``watch`` (exact pass): the global neurons whose
        possible activity each row records (:class:`verifier.checks.classes.ClassRecorder`)."""
        if self.dense and watch is None:
            if self.deployment is not None:
                return DeployedDensePass(weights, vocab_size=self.vocab_size, deployment=self.deployment,
                                         stages=self.stages)
            return DensePass(weights, vocab_size=self.vocab_size)
        prep = Prepared(weights, gate_terms=self.gate_terms, vocab_size=self.vocab_size, deployment=self.deployment,
                        stages=self.stages)
        if watch is not None:
            prep.watch = watch
        if self.split is not None and self.deployment is None:
            return FactoredPass(prep, self.split)
        return prep


# --- what may run where ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    why: str
    fix: str


#: (pass kind, where it runs, whether query classes are recorded) -> None (allowed) or why not.
#: Query classes (a certificate for later edits) are recorded by the exact pass on local
#: processes; the deployed pass of a format runs on local processes.
COMBINATIONS: dict[tuple[str, str, bool], Refusal | None] = {
    ("exact", "local", False): None,
    ("exact", "local", True): None,
    ("exact", "cluster", False): None,
    ("exact", "cluster", True): Refusal("a certificate for later edits is recorded on local processes only",
                                        "drop --scheduler, or drop --certificate / --since"),
    ("float", "local", False): None,
    ("float", "local", True): Refusal("a certificate for later edits is saved for the exact pass only",
                                      "drop --precision, or drop --certificate / --since"),
    ("float", "cluster", False): None,
    ("float", "cluster", True): Refusal("a certificate for later edits is saved for the exact pass on local "
                                        "processes only", "drop --precision and --scheduler, or drop --certificate"),
}


def require_allowed(spec: PassSpec, executor, classes: bool) -> None:
    """Raise the table's refusal (TaskError) for this pass, executor and class recording."""
    require_combination(spec.kind, "local" if executor is None or executor.shares_memory else "cluster", classes)


def require_combination(kind: str, where: str, classes: bool) -> None:
    """Raise the table's refusal (TaskError) for a pass of ``kind`` ("exact", "float") run
    ``where`` ("local", "cluster"), recording query classes or not: the one place the table
    is read, also before anything runs (a command refuses its flags up front)."""
    refusal = COMBINATIONS[(kind, where, bool(classes))]
    if refusal is not None:
        raise TaskError(refusal.why, fix=refusal.fix)


# --- shards ------------------------------------------------------------------------------------------


class Shard:
    """What a worker needs to run any batch over the full weights: the weights, the task-set
    → weights token map and the pass to build. The pass's tables are built on first use in
    the process that uses them and are never pickled: a cluster worker receives the
    weights once and builds its own; a forked worker inherits the parent's."""

    def __init__(self, weights: Weights, tmap: np.ndarray, spec: PassSpec = PassSpec(),
                 watch: np.ndarray | None = None) -> None:
        self.weights, self.tmap, self.spec, self.watch = weights, tmap, spec, watch
        self._pass: Pass | None = None

    def prepared(self) -> Pass:
        if self._pass is None:
            self._pass = self.spec.build(self.weights, self.watch)
        return self._pass

    def release(self) -> None:
        """Build the pass and drop the weights: the pass reads its own tables from here on
        (it keeps only the weights' frame, :meth:`layout.Weights.frame`)."""
        self.prepared()
        self.weights = None

    def __getstate__(self) -> dict:
        if self.weights is None:
            raise RuntimeError("a shard whose weights were released runs where it is; it cannot be sent")
        return {"weights": self.weights, "tmap": self.tmap, "spec": self.spec, "watch": self.watch, "_pass": None}


def verify_batch(shard: Shard, batch) -> BatchResult:
    """The certified pass over one batch of the task set's queries, reduced to what the
    checks read (a work unit)."""
    tmap = shard.tmap
    ablate = batch.object_query & (batch.determined >= 0)
    target = np.where(ablate & (batch.target >= 0), tmap[np.maximum(batch.target, 0)], -1)
    res = shard.prepared().run_batch(tmap[batch.tokens], batch.valid_ptr, tmap[batch.valid],
                                     ablate=ablate, scores=False, target=target).compact()
    if res.expert.shape[0] != len(batch):
        raise RuntimeError(f"a work unit returned {res.expert.shape[0]} rows for a batch of {len(batch)}")
    return res


class ShardPart:
    """The weights cut to a cone of influence and renumbered to what it holds
    (:func:`verifier.running.shards.restrict`, :func:`verifier.running.shards.compact`): some experts (the
    full weights' ``experts``) and the rows of E of the query tokens ``tokens`` (full ids).
    Work units arrive with their tokens already in the part's compact ids
    (:meth:`localize`, where the batches are made), so a worker holds nothing of the size
    of the whole vocabulary. Like :class:`Shard`, its pass is built where it is used."""

    def __init__(self, weights: Weights, experts: np.ndarray, inputs: np.ndarray, spec: PassSpec,
                 watched: list[np.ndarray] | None = None, tokens: np.ndarray | None = None) -> None:
        """``inputs``: the query tokens whose rows of E the part keeps; ``tokens`` (default:
        ``inputs``): every token the part numbers, valid next tokens included (only their
        rows of U are needed); ``watched``: per expert of the full weights, the neurons
        whose activity is recorded."""
        from verifier.running.shards import compact, distinct_ids, restrict

        experts = np.asarray(experts, np.int64)
        inputs = np.asarray(inputs, np.int64)
        comp = compact(restrict(weights, inputs, experts), inputs if tokens is None else np.asarray(tokens, np.int64))
        self.spec = replace(spec, vocab_size=comp.vocab_size,
                            split=spec.split.cut(comp.tokens) if spec.split is not None else None)
        if spec.deployment is not None:          # the full weights' stages, in the cut's numbering
            full = spec.stages if spec.stages is not None else _stages(weights, spec.deployment)
            widths = np.array([e.width for e in weights.experts], np.int64)
            off = np.concatenate([[0], np.cumsum(widths)])
            neurons = np.concatenate([np.arange(off[k], off[k + 1]) for k in np.unique(experts)]
                                     + [np.zeros(0, np.int64)])
            self.spec = replace(self.spec, stages=full.cut(comp.coords, comp.tokens[:len(comp.weights.vocab)],
                                                            neurons.astype(np.int64)))
        self.weights = comp.weights
        self.tokens = comp.tokens                      # compact token id -> full id (sorted)
        self.embedded = distinct_ids(inputs)           # query tokens the part can hold
        self.vocab_size = comp.vocab_size
        self.has_expert = np.zeros(len(comp.weights.experts), bool)
        self.has_expert[experts] = True
        widths = np.array([e.width for e in weights.experts], np.int64)
        #: per expert of the cut weights, where its neurons start in the full weights' numbering
        self.full_off = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
        self.watch = None
        if watched is not None:
            self.watch = np.concatenate([watched[k] if self.has_expert[k] else np.zeros(0, bool)
                                         for k in range(len(weights.experts))] + [np.zeros(0, bool)])
        self._pass: Pass | None = None
        self._lookup_cache: tuple | None = None        # (tmap, its lookups): see _lookup

    def prepared(self) -> Pass:
        if self._pass is None:
            self._pass = self.spec.build(self.weights, self.watch)
        return self._pass

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_pass"] = state["_lookup_cache"] = None
        return state

    def __sizeof__(self) -> int:
        """The bytes of its weights' arrays (what a cluster reads to place it on a worker)."""
        total = object.__sizeof__(self)
        for _, a in self.weights.arrays():
            for array in (a.data, a.indices, a.indptr) if sp.issparse(a) else (a,):
                total += np.asarray(array).nbytes
        return total

    def _compact_ids(self, full_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(compact ids, held?) of full weights' token ids; a token not held maps to BOS."""
        full_ids = np.asarray(full_ids, np.int64)
        pos = np.minimum(np.searchsorted(self.tokens, full_ids), max(self.tokens.size - 1, 0))
        held = ((self.tokens.size > 0) & (self.tokens[pos] == full_ids) if self.tokens.size
                else np.zeros(full_ids.shape, bool))
        bos = full_ids == self.vocab_size
        return np.where(held, pos, self.tokens.size), held | bos

    def _lookup(self, tmap: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per task-set token (through ``tmap``): its compact id, whether the part holds it
        (or it is BOS), whether the part embeds it (or it is BOS), and whether it can be a
        next token the part holds. Built once per ``tmap`` where the batches are made, and
        never pickled (it has the size of the task set's vocabulary)."""
        cached = self._lookup_cache
        if cached is None or cached[0] is not tmap:
            full = np.asarray(tmap, np.int64)
            cid, held = self._compact_ids(full)
            pos = np.minimum(np.searchsorted(self.embedded, full), max(self.embedded.size - 1, 0))
            embeds = (self.embedded[pos] == full) if self.embedded.size else np.zeros(full.shape, bool)
            embeds |= full == self.vocab_size
            cached = (tmap, cid, held, embeds, held & (full != self.vocab_size))   # BOS is never a next token
            self._lookup_cache = cached
        return cached[1:]

    def localize(self, batch, tmap: np.ndarray):
        """(the batch with compact token ids, rows holding a token outside the part)."""
        cid, held_or_bos, embeds, next_held = self._lookup(tmap)
        tokens = cid[batch.tokens]
        # a query token must be one the part embeds (compact also keeps tokens that only
        # have a row of U: their E rows are gone)
        held = embeds[batch.tokens]
        valid, vheld = cid[batch.valid], next_held[batch.valid]
        outside = ~held.all(axis=1)
        bad_valid = np.repeat(np.arange(len(batch)), np.diff(batch.valid_ptr))[~vheld]
        outside[bad_valid] = True
        # the object of an object query is one of its valid next tokens (held, or the row is deferred)
        has = batch.target >= 0
        target, theld = cid[np.maximum(batch.target, 0)], held_or_bos[np.maximum(batch.target, 0)]
        outside |= has & ~theld
        # a deferred row runs here too (its result is replaced by the full weights'): a next
        # token the part does not hold is read as token 0, and its object as none, so that
        # every id the kernels index by is one of the part's tokens
        valid = np.where(vheld, valid, 0)
        return replace(batch, tokens=tokens, valid=valid, target=np.where(has & theld, target, -1)), outside


def verify_shard_batch(part: ShardPart, payload) -> tuple[BatchResult, np.ndarray]:
    """The certified pass over one batch on a part (tokens in the part's compact ids), in
    the full weights' numbering (predicted tokens, recorded neurons), and which rows must
    run again over the full weights (a token or a candidate expert outside the part): a
    work unit."""
    batch, outside = payload
    ablate = batch.object_query & (batch.determined >= 0)
    res = part.prepared().run_batch(batch.tokens, batch.valid_ptr, batch.valid, ablate=ablate, scores=False,
                                    target=np.where(ablate, batch.target, -1))
    cand_ptr, cand = res.candidates
    rows = np.repeat(np.arange(len(batch)), np.diff(cand_ptr))
    outside = outside.copy()
    outside[rows[~part.has_expert[cand]]] = True
    outside |= ~part.has_expert[res.expert]
    res.predicted = np.where(res.predicted >= 0, part.tokens[np.maximum(res.predicted, 0)], -1)
    if res.active is not None and part.watch is not None and res.active.size:
        act = res.active.copy()              # the part's neuron numbering -> the full weights'
        shift = (part.full_off[:-1] - part.prepared().layer.off[:-1])[res.expert]
        R = act.shape[1] - 1
        act[:, :R] = np.where(act[:, :R] >= 0, act[:, :R] + shift[:, None], -1)
        res.active = act
    return res.compact(), outside


#: Batches a cluster unit's group of pieces may hold back before it is sent unfilled (:meth:`Runner._cut_reduce`).
GROUP_WAIT = 8

#: ``reduce(batch, result, rows)``: what a row subset of a batch (``rows``, increasing) adds
#: to a verification's records, computed where the rows ran (:meth:`Runner.run_reduced`)
Reduce = Callable[[Any, BatchResult, np.ndarray], Any]


def reduce_shard_batch(reduce: Reduce, part: ShardPart, payload) -> tuple[Any, np.ndarray]:
    """:func:`verify_shard_batch`, then ``reduce`` of the rows the part holds (None if it
    holds none), and which rows must run again over the full weights: a work unit whose
    result is small (the reduction, a mask), whatever the batch's size."""
    batch, outside, rows = payload
    res, outside = verify_shard_batch(part, (batch, outside))
    keep = np.flatnonzero(~outside)
    if not keep.size:
        return None, outside
    if keep.size < len(batch):
        batch, res = batch.take(keep), res.take(keep)
    return reduce(batch, res, rows[keep]), outside


def reduce_shard_group(reduce: Reduce, part: ShardPart, pieces: list) -> list[tuple[int, tuple[Any, np.ndarray]]]:
    """:func:`reduce_shard_batch` of each ``(number, payload)`` of a unit carrying several
    pieces of one part, each run as a batch of its own: ``[(number, (share, outside))]``."""
    return [(n, reduce_shard_batch(reduce, part, payload)) for n, payload in pieces]


def merge(n: int, pieces: list[tuple[np.ndarray, BatchResult]]) -> BatchResult:
    """One compact result of n rows from results of row subsets ``(rows, result)``."""
    first = pieces[0][1]

    def field(get):
        out = np.empty((n,) + get(first).shape[1:], get(first).dtype)
        for rows, res in pieces:
            out[rows] = get(res)
        return out

    top = tuple(field(lambda r, i=i: r.top_gate[i]) for i in range(3)) if first.top_gate is not None else None
    extra = {}
    if all(res.rho_lo is not None for _, res in pieces):
        for name in ("rho_lo", "rho_hi", "ablated_rho_lo", "ablated_rho_hi", "active"):
            extra[name] = field(lambda r, name=name: getattr(r, name))
    if all(res.ablated_gap is not None for _, res in pieces):
        for name in ("ablated_gap", "ablated_zeros", "ablated_object_lo"):
            extra[name] = field(lambda r, name=name: getattr(r, name))
    return BatchResult(field(lambda r: r.expert), field(lambda r: r.margin), field(lambda r: r.ambiguous), None, None,
                       field(lambda r: r.err_lo), field(lambda r: r.err_hi), field(lambda r: r.ablated_lo),
                       field(lambda r: r.ablated_hi), field(lambda r: r.predicted), top, **extra)


def _stages(weights: Weights, deployment: Deployment):
    """The deployed pass's stages of the full weights (as deployed: rounded to the format)."""
    from layout.formats import round_weights
    from verifier.passes.floating import stages

    return stages(round_weights(weights, deployment.fmt), deployment)


class Inline:
    """A keyed executor that runs every unit here, in order (a re-certification's one cut)."""

    shares_memory = True

    def map_keyed(self, fn, part, items):
        for key, payload in items:
            yield (key, payload), fn(part(key), payload)


# --- the runner --------------------------------------------------------------------------------------


class Runner:
    """Runs batches of a task set's queries on ``executor`` and yields ``(batch, result)`` in
    order (see the module docstring). ``deferred`` counts the rows run again over the full
    weights."""

    def __init__(self, weights: Weights, tmap: np.ndarray, spec: PassSpec = PassSpec(), executor=None,
                 watched: list[np.ndarray] | None = None, taskset=None) -> None:
        """``taskset``: the task set the batches come from (needed to cut shards of its tasks
        on a cluster); ``watched``: per expert, the neurons whose possible activity each row
        records (query classes for a certificate)."""
        from verifier.running.parallel import LocalPool

        self.weights, self.tmap, self.spec, self.taskset = weights, tmap, spec, taskset
        self.executor = executor if executor is not None else LocalPool(1)
        self.watched = watched
        self.deferred = 0
        self._full: Shard | None = None
        if spec.deployment is not None and spec.stages is None and not self.executor.shares_memory:
            self.spec = spec = replace(spec, stages=_stages(weights, spec.deployment))   # computed once, for every cut
        # the full weights' longest gate row: a part's rounding bound uses it, so that its
        # enclosures are the full pass's bit for bit
        self.gate_terms = int(np.diff(sp.csr_matrix(weights.W_G).indptr).max(initial=1))

    def full(self) -> Shard:
        """The full weights' shard (its pass built on first use)."""
        if self._full is None:
            watch = np.concatenate(self.watched) if self.watched else None
            self._full = Shard(self.weights, self.tmap, self.spec, watch)
        return self._full

    def prepare(self) -> Pass:
        """Build the full weights' pass now (before local workers fork, so they share it)."""
        return self.full().prepared()

    def release(self) -> None:
        """Build the full weights' pass now and let the weights go (the runner then holds
        only that pass's tables): for a runner that runs on local processes over the full
        weights, which never cuts them. At scale the weights are as large as a good part
        of the tables, and nothing reads them once the tables are built."""
        self.full().release()
        self.weights = None

    def _weights(self) -> Weights:
        if self.weights is None:
            raise RuntimeError("this runner released its weights (Runner.release): it cannot cut them")
        return self.weights

    def part(self, experts: np.ndarray, inputs: np.ndarray, tokens: np.ndarray | None = None) -> ShardPart:
        """The weights cut to ``experts`` and the query tokens ``inputs`` (full ids; ``tokens``:
        as :class:`ShardPart` takes them)."""
        return ShardPart(self._weights(), experts, inputs, replace(self.spec, gate_terms=self.gate_terms), self.watched,
                         tokens)

    def run(self, stream: Iterable) -> Iterator[tuple[Any, BatchResult]]:
        """Every batch over the full weights on local processes, or over shards of tasks on
        a cluster (an executor that does not share memory: ``map_keyed``)."""
        if self.executor.shares_memory:
            return self.executor.map(verify_batch, self.full(), stream)
        return self._on_shards(stream)

    def run_cut(self, batches: list, part: ShardPart) -> Iterator[tuple[Any, BatchResult]]:
        """Every batch on one cut of the weights, here (a re-certification's cone)."""
        return self._cut_run(((b, [(0, np.arange(len(b)))]) for b in batches), lambda key: part, Inline())

    def run_reduced(self, stream: Iterable, reduce: Reduce) -> Iterator[tuple[Any, list]]:
        """Every batch over shards of tasks on a cluster, each unit's rows reduced where they
        ran (``reduce``, a picklable function; it travels with every unit), so that only the
        reductions come back. Rows reaching outside their part run again here over the full
        weights and are reduced here. Yields ``(batch, reductions)``, the reductions of a
        partition of the batch's rows, in order of batches."""
        return self._on_shards(stream, reduce)

    def _on_shards(self, stream: Iterable, reduce: Reduce | None = None) -> Iterator[tuple[Any, Any]]:
        from verifier.running.shards import Plan

        if self.spec.dense:
            # dense weights: every row reaches every token, so a part is the whole weights, one
            # copy per shard, and each batch goes whole to one of them in turn (a batch's rows are
            # then multiplied together as on local processes: the same BLAS products, the same report)
            weights = self._weights()
            n = max(1, int(self.executor.shards))
            plan = Plan((np.zeros(len(self.taskset.tasks), np.int64)),
                        (np.arange(len(weights.vocab), dtype=np.int64),) * n,
                        (np.arange(len(weights.experts), dtype=np.int64),) * n)
            split = ((b, [(i % n, np.arange(len(b)))]) for i, b in enumerate(stream))
        else:
            plan = Plan.make(self.taskset, self._weights(), self.tmap, self.executor.shards)
            split = ((b, plan.split(b)) for b in stream)
        parts: dict[int, ShardPart] = {}

        def part(s: int) -> ShardPart:
            if s not in parts:
                parts[s] = self.part(plan.experts[s], plan.tokens[s])
            return parts[s]

        if reduce is None:
            return self._cut_run(split, part, self.executor)
        return self._cut_reduce(split, part, self.executor, reduce)

    def _cut_reduce(self, split_stream, part, executor, reduce: Reduce) -> Iterator[tuple[Any, list]]:
        """As :meth:`_cut_run`, each piece reduced where it ran (:meth:`run_reduced`). A unit
        carries the pieces of several batches for one part, about ``executor.unit_rows``
        rows (each piece still runs as a batch of its own, so its results do not depend on
        the grouping): a unit costs round trips between the client, the scheduler and a
        worker whatever its size. Pieces are numbered as they are cut; a batch is yielded
        once the shares of all its pieces are back, in order of batches."""
        queue: deque = deque()                 # (batch, split, number of its first piece)
        tmap = self.tmap
        target = max(int(getattr(executor, "unit_rows", 0) or 0), 1)
        got: dict[int, tuple[Any, np.ndarray]] = {}

        def items():
            open_: dict[object, tuple[list, int, int]] = {}   # part -> (pieces, rows, first batch) not yet sent
            n = 0
            for b, (batch, split) in enumerate(split_stream):
                queue.append((batch, split, n))
                for key, rows in split:
                    piece, outside = part(key).localize(batch.take(rows) if rows.size != len(batch) else batch, tmap)
                    pieces, size, since = open_.pop(key, ([], 0, b))
                    pieces.append((n, (piece, outside, rows)))
                    n += 1
                    open_[key] = (pieces, size + rows.size, since)
                # sent when full, or when it holds back a batch GROUP_WAIT batches old (so
                # that a part with few rows does not keep every later batch waiting here)
                for key in [k for k, (_, size, since) in open_.items() if size >= target or b - since >= GROUP_WAIT]:
                    yield key, open_.pop(key)[0]
            for key, (pieces, _, _) in open_.items():
                yield key, pieces

        results = executor.map_keyed(partial(reduce_shard_group, reduce), part, items())
        for _, returned in results:
            got.update(returned)
            while queue and all(queue[0][2] + k in got for k in range(len(queue[0][1]))):
                batch, split, first = queue.popleft()
                shares, redo = [], []
                for k, (_, rows) in enumerate(split):
                    share, outside = got.pop(first + k)
                    if share is not None:
                        shares.append(share)
                    redo.append(rows[outside])
                redo_rows = np.sort(np.concatenate(redo))
                if redo_rows.size:
                    self.deferred += int(redo_rows.size)
                    sub = batch.take(redo_rows)
                    shares.append(reduce(sub, verify_batch(self.full(), sub), redo_rows))
                yield batch, shares
        # a batch still queued here has a piece whose unit returned nothing: it is never
        # yielded, so its queries are not counted as recorded and the report is not certified

    def _cut_run(self, split_stream, part, executor) -> Iterator[tuple[Any, BatchResult]]:
        """Cut, run, defer, merge: each batch's rows go to their parts (``split_stream`` yields
        (batch, [(key, rows)])); rows reaching outside a part run again over the full weights."""
        queue: deque = deque()
        tmap = self.tmap

        def items():
            for batch, split in split_stream:
                queue.append((batch, split))
                for key, rows in split:
                    yield key, part(key).localize(batch.take(rows) if rows.size != len(batch) else batch, tmap)

        results = executor.map_keyed(verify_shard_batch, part, items())
        while True:
            try:
                _, got = next(results)
            except StopIteration:
                return
            batch, split = queue.popleft()
            pieces, redo = [], []
            for k, (key, rows) in enumerate(split):
                if k:
                    _, got = next(results)
                res, outside = got
                pieces.append((rows, res))
                redo.append(rows[outside])
            redo_rows = np.concatenate(redo)
            if redo_rows.size:
                self.deferred += int(redo_rows.size)
                pieces.append((redo_rows, verify_batch(self.full(), batch.take(redo_rows))))
            whole = len(pieces) == 1 and np.array_equal(pieces[0][0], np.arange(len(batch)))
            yield batch, (pieces[0][1] if whole else merge(len(batch), pieces))
