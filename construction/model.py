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
from tasks.model import TaskSet
from tasks.structure import StructureTrie, check_routable
from layout import Expert, Head, Weights

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
        """A proven upper bound on ε(β, γ) at the chosen parameters."""
        return bound.bound_upper(self.taskset.L, self.taskset.vocabulary.size, self.beta, self.gamma)

    def conditions(self) -> dict[str, float]:
        """The side conditions of the theorem at the chosen β (all must hold)."""
        d = bound.leak_upper(self.taskset.L, self.beta)
        return {"delta": d, "delta_max_gate": float(self.gate.beta_condition()), "delta_max_neurons": 0.5}

    def instantiate(self, beta: Fraction | None = None, gamma: Fraction | None = None) -> Weights:
        """Numeric weights in the verifier's layout (exact for dyadic β and γ)."""
        values = {BETA: float(self.beta if beta is None else beta), GAMMA: float(self.gamma if gamma is None else gamma)}
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
            residual_labels=tuple(self.residual.labels()) if self.residual.dim <= 200_000 else None,
            neuron_labels=tuple(tuple(e.neurons.blocks[0].labels) for e in self.experts) if sum(self.widths) <= 200_000 else None,
            parameters={"beta": str(self.beta if beta is None else beta), "gamma": str(self.gamma if gamma is None else gamma),
                        "epsilon": self.epsilon, "gate": self.gate.method},
        )


def dyadic(x: float) -> Fraction:
    """A user-given parameter on the 1/65536 grid, so that every weight is exact in float64."""
    return Fraction(round(float(x) * 65536), 65536)


def build(taskset: TaskSet, epsilon: float | None = None, beta: float | None = None, gamma: float | None = None) -> SymbolicModel:
    """Construct the model; ε, β, γ default to the task set's, then to computed values.

    Raises :class:`tasks.errors.TaskError` (a RoutingError) if the set cannot be routed.
    """
    epsilon = epsilon if epsilon is not None else (taskset.epsilon if taskset.epsilon is not None else DEFAULT_EPSILON)
    beta = beta if beta is not None else taskset.parameters.get("beta")
    gamma = gamma if gamma is not None else taskset.parameters.get("gamma")
    trie = StructureTrie(taskset)
    check_routable(taskset, trie)
    residual = residual_space(taskset)
    gate = build_gate(taskset, residual, trie)
    L, V = taskset.L, taskset.vocabulary.size
    chosen_beta = dyadic(beta) if beta is not None else bound.smallest_beta(L, gate.beta_condition())
    if gamma is not None:
        chosen_gamma = dyadic(gamma)
    else:
        chosen_gamma = bound.smallest_gamma(L, V, chosen_beta, epsilon)
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
