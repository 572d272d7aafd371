"""The residual stream of the construction: a direct sum of labelled blocks.

==========  ==================  ===================================================
block       labels              written by, meaning
==========  ==================  ===================================================
one         ""                  E: 1 in every token embedding (BOS included)
word        template words      E: which word this token is
entity      ""                  E: 1 if this token is an entity
id          entities            E: which entity this token is
pos         0 .. L-1            P: the position (0 is BOS)
slot<m>     words, "⋆"          structure head m: the symbol at position m (m = 1..L-1)
subj        entities            subject head: the entity of the prefix (the subject)
next        all tokens          experts: evidence for the next token, read by U
==========  ==================  ===================================================

``⋆`` stands for "an entity" (either slot) in a template structure.
"""

from __future__ import annotations

from construction.bases import Space, block
from tasks.model import TaskSet
from tasks.structure import OBJ, SUBJ

ENTITY_SYMBOL = "⋆"


def symbols(taskset: TaskSet) -> tuple[str, ...]:
    """The structure alphabet: template words and ⋆."""
    return taskset.vocabulary.words + (ENTITY_SYMBOL,)


def symbol_label(code: int, taskset: TaskSet) -> str:
    """Trie symbol code -> slot label."""
    return ENTITY_SYMBOL if code in (SUBJ, OBJ) else taskset.vocabulary.words[code]


def residual_space(taskset: TaskSet) -> Space:
    vocab = taskset.vocabulary
    L = taskset.L
    alphabet = symbols(taskset)
    return Space.of(
        block("one"),
        block("word", vocab.words),
        block("entity"),
        block("id", vocab.entities),
        block("pos", range(L)),
        *[block(f"slot{m}", alphabet) for m in range(1, L)],
        block("subj", vocab.entities),
        block("next", vocab.tokens),
    )
