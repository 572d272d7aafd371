"""The whole construction: from a task set to a symbolic single-layer MoE transformer.

:func:`build` assembles the blocks (embedding, structure and subject heads, gate,
experts, unembedding), each documented with its proof in its own module, and chooses
parameters (β, γ) that make the closed-form bound (construction.bound) fall below ε.
:meth:`SymbolicModel.instantiate` turns it into numeric :class:`layout.Weights`,
the file layout the verifier reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import sympy

from construction import bound
from construction.bases import Space
from construction.embedding import embedding, positions, unembedding
from construction.experts import SymExpert, build_expert
from construction.gate import GateResult, build_gate
from construction.heads import SymHead, heads
from construction.params import BETA, GAMMA
from construction.residual import residual_space
from construction.symbolic import SymMatrix
from tasks.errors import TaskError
from tasks.model import MAX_TEMPLATE_LENGTH, TaskSet, long_template
from tasks.structure import StructureTrie, check_routable
from layout import Expert, Head, Weights
from tasks.structure import structure_of

DEFAULT_EPSILON = 0.01


@dataclass(frozen=True)
class SymbolicModel:
    taskset: TaskSet
    residual: Space
    E: SymMatrix
    P: SymMatrix
    heads: tuple[SymHead, ...]
    gate: GateResult
    experts: tuple[SymExpert, ...]
    U: SymMatrix
    epsilon: float
    beta: Fraction
    gamma: Fraction

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(e.width for e in self.experts)

    @property
    def bounds(self) -> tuple[int, ...]:
        """c(k) = L·|T(k)| + N_k per task."""
        return tuple(self.taskset.complexity(k) for k in range(len(self.taskset.tasks)))

    @property
    def values(self) -> dict[sympy.Symbol, sympy.Rational]:
        return {BETA: sympy.Rational(self.beta.numerator, self.beta.denominator),
                GAMMA: sympy.Rational(self.gamma.numerator, self.gamma.denominator)}

    def error_bound(self) -> sympy.Expr:
        """The closed-form worst-case error ε(β, γ) for this task set (construction.bound)."""
        return bound.error_bound(self.taskset.L, self.taskset.vocabulary.size)

    def bound_value(self) -> float:
        """A proven upper bound on the closed form ε(β, γ) at the chosen parameters (which
        bounds every query's error when :meth:`unproven_conditions` is empty)."""
        return bound.bound_upper(self.taskset.L, self.taskset.vocabulary.size, self.beta, self.gamma)

    def conditions(self) -> dict[str, float]:
        """The side conditions of the theorem at the chosen β (all must hold)."""
        d = bound.leak_upper(self.taskset.L, self.beta)
        return {"delta": d, "delta_max_gate": float(self.gate.beta_condition()), "delta_max_neurons": 0.5,
                "delta_subject": bound.subject_leak_upper(self.beta), "delta_subject_max": 0.5}

    def unproven_conditions(self) -> list[str]:
        """The theorem's side conditions not proven at the chosen β (construction.bound); none:
        the closed form is a proven bound on every query's error."""
        return bound.unproven_conditions(self.taskset.L, self.beta, self.gate.beta_condition())

    def instantiate(self, beta: Fraction | None = None, gamma: Fraction | None = None, *,
                    labels: bool = True) -> Weights:
        """Numeric weights in the verifier's layout (exact for dyadic β and γ). ``labels``:
        name the residual directions and neurons (up to 200,000 of each; for reading and for
        files: no check, digest or output depends on them)."""
        values = {BETA: float(self.beta if beta is None else beta),
                  GAMMA: float(self.gamma if gamma is None else gamma)}
        num = lambda m: m.numeric(values)  # noqa: E731
        vec = lambda m: np.asarray(m.numeric(values).toarray()).reshape(-1)  # noqa: E731
        return Weights(
            vocab=self.taskset.vocabulary.tokens,
            E=num(self.E), P=num(self.P),
            heads=tuple(Head(num(h.W_Q), num(h.W_K), num(h.W_V), num(h.W_O)) for h in self.heads),
            W_G=num(self.gate.W_G), b_G=vec(self.gate.b_G),
            experts=tuple(Expert(num(e.W_1), vec(e.b_1), num(e.W_2)) for e in self.experts),
            U=num(self.U),
            expert_tasks=self.taskset.names,
            gate_mode="top1",
            residual_labels=tuple(self.residual.labels()) if labels and self.residual.dim <= 200_000 else None,
            neuron_labels=tuple(tuple(e.neurons.blocks[0].labels) for e in self.experts)
            if labels and sum(self.widths) <= 200_000 else None,
            parameters={"beta": str(self.beta if beta is None else beta),
                        "gamma": str(self.gamma if gamma is None else gamma),
                        "epsilon": self.epsilon, "gate": self.gate.method},
        )


GRID = 65536


def dyadic(x: float) -> Fraction:
    """A user-given parameter on the 1/65536 grid, so that every weight is exact in float64."""
    return Fraction(round(float(x) * GRID), GRID)


def _located(err: TaskError, taskset: TaskSet) -> TaskError:
    """``err`` at the file and line of the first template it refers to (``err.refs``), if known."""
    refs = getattr(err, "refs", None) or []
    if not refs or taskset.sources is None:
        return err
    file, line = taskset.template_source(*refs[0])
    problem = err.problem
    if len(refs) > 1:
        _, other = taskset.template_source(*refs[1])
        if other is not None and other != line:
            problem += f" (the other template is on line {other})"
    out = type(err)(problem, file=err.file or file, line=err.line or line, fix=err.fix)
    out.refs = refs
    if hasattr(err, "certificate"):
        out.certificate = err.certificate
    return out


def _parameter(name: str, value: float, from_flag: bool, taskset: TaskSet) -> Fraction:
    """A parameter on the construction's grid; one that rounds to 0 is refused where it was written."""
    f = dyadic(value)
    if f <= 0:
        where = {} if from_flag else dict(zip(("file", "line"), taskset.parameter_source(name)))
        source = f"--{name} {value:g}" if from_flag else f"parameter '{name}' = {value:g}"
        raise TaskError(f"{source} rounds to 0 on the construction's grid of 1/{GRID} (weights must be exact "
                        f"binary fractions)", fix=f"give {name} >= 1/{GRID} ≈ {1 / GRID:.2g}", **where)
    return f


def route(taskset: TaskSet, trie: StructureTrie | None = None) -> tuple[Space, GateResult]:
    """The parts of the construction that can refuse a task set: its residual space and gate.

    Raises a :class:`TaskError`, at the file and line of the template it names: a template
    longer than :data:`MAX_TEMPLATE_LENGTH`; an ill-posed set (tasks.structure, no model can
    route it); or a :class:`RoutingError` when no gate of the construction's form routes it
    (with a proof where one was found, construction.separation).
    """
    if taskset.L > MAX_TEMPLATE_LENGTH:
        k, t = next((k, t) for k, task in enumerate(taskset.tasks) for t, tpl in enumerate(task.templates)
                    if len(tpl.parts) == taskset.L)
        file, line = taskset.template_source(k, t)
        err = TaskError(long_template(taskset.L), file=file, line=line, fix="split the sentence into shorter templates")
        err.refs = [(k, t)]  # type: ignore[attr-defined]
        raise err
    trie = trie if trie is not None else structure_of(taskset)
    try:
        check_routable(taskset, trie)
        residual = residual_space(taskset)
        gate = build_gate(taskset, residual, trie)
    except TaskError as err:
        raise _located(err, taskset) from None
    return residual, gate


def build(taskset: TaskSet, epsilon: float | None = None, beta: float | None = None, gamma: float | None = None,
          vocabulary_reach: int | None = None) -> SymbolicModel:
    """Construct the model; ε, β, γ default to the task set's, then to computed values.

    ``vocabulary_reach``: a computed γ is the smallest whose proven bound reaches ε for a
    vocabulary of this many tokens rather than the task set's own |V| (the bound grows with
    |V|, so the model then also serves edits that add entities up to that size: a saved
    certificate's headroom).

    Raises :class:`tasks.errors.TaskError` (a RoutingError) if the set cannot be routed, and
    a TaskError naming the parameter (and its file and line) if no parameters reach ε.
    """
    epsilon = epsilon if epsilon is not None else (taskset.epsilon if taskset.epsilon is not None else DEFAULT_EPSILON)
    beta_flag, gamma_flag = beta is not None, gamma is not None
    beta = beta if beta is not None else taskset.parameters.get("beta")
    gamma = gamma if gamma is not None else taskset.parameters.get("gamma")
    residual, gate = route(taskset)
    L, V = taskset.L, taskset.vocabulary.size
    smallest = bound.smallest_beta(L, gate.beta_condition())
    chosen_beta = _parameter("beta", beta, beta_flag, taskset) if beta is not None else smallest
    if gamma is not None:
        chosen_gamma = _parameter("gamma", gamma, gamma_flag, taskset)
    else:
        try:
            chosen_gamma = bound.smallest_gamma(L, max(V, vocabulary_reach or 0), chosen_beta, epsilon)
        except ValueError:
            where = {} if beta_flag else dict(zip(("file", "line"), taskset.parameter_source("beta")))
            raise TaskError(f"no gamma makes the proven error bound reach epsilon = {epsilon:g} at beta = "
                            f"{chosen_beta} (the attention leak at this beta is too large)",
                            fix=f"raise beta (the construction would choose {smallest}), give gamma too, or raise "
                                f"epsilon", **where) from None
    return SymbolicModel(
        taskset=taskset,
        residual=residual,
        E=embedding(taskset, residual),
        P=positions(taskset, residual),
        heads=heads(taskset, residual),
        gate=gate,
        experts=tuple(build_expert(taskset, k, residual) for k in range(len(taskset.tasks))),
        U=unembedding(taskset, residual),
        epsilon=epsilon,
        beta=chosen_beta,
        gamma=chosen_gamma,
    )
