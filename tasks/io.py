"""Load and dump task sets: the ``tasks.yaml`` format (this module is its documentation and
public entry point; the work is split by concern: :mod:`tasks.yaml_nodes` reads YAML with
line numbers, :mod:`tasks.reading` validates and builds the task set,
:mod:`tasks.facts_files` reads TSV/CSV facts, :mod:`tasks.writing` dumps, through the
one atomic-write mechanism of :mod:`tasks.files`).

Format
======

.. code-block:: yaml

    epsilon: 0.01            # optional, 0 < epsilon < 1
    parameters:              # optional construction parameters: positive numbers
      beta: 12               # allowed names: beta, gamma
      gamma: 20
    tasks:                   # required, a non-empty list
      - name: capital        # required string, unique among the tasks
        templates:           # required non-empty list of strings (one string is also accepted)
          - the capital of ⋆1 is ⋆2      # ⋆1/⋆2 (U+22C6) or ASCII *1/*2
          - "*1 has capital *2"          # quote a template that starts with *
        facts:               # inline: a mapping subject: object ...
          France: Paris
          New York City: United States   # entities may contain spaces and any unicode
      - name: continent
        templates: [the continent of *1 is *2]
        facts:               # ... or a list of [subject, object] pairs
          - [France, Europe]
      - name: currency
        templates: [the currency of *1 is *2]
        facts_file: currency.tsv         # or a facts file (or a list of them)

Rules
-----

* Top-level keys: ``epsilon``, ``parameters``, ``tasks``; task keys: ``name``,
  ``templates``, ``facts``, ``facts_file``. Any other key is an error (typo protection).
* Templates are split into words on whitespace. ``⋆1``/``*1`` is the subject slot,
  ``⋆2``/``*2`` the object slot; exactly one of each, ⋆1 first. YAML reads an unquoted
  ``*1`` at the start of a value as an alias, so quote such templates.
* A task has exactly one of ``facts`` (inline) and ``facts_file``. Inline facts are a
  mapping ``subject: object`` or a list of ``[subject, object]`` pairs.
* Names (task names, subjects, objects) must be YAML *strings*. YAML 1.1 reads ``no``,
  ``yes``, ``on``, ``off``, ``true``, ``null``, ``~``, ``1984``, ``3.5``, ``2001-01-01``
  as other types: write such names in quotes (``Norway: 'no'``). Names are stripped of
  surrounding whitespace and must not contain tabs or line breaks.
* The same fact twice is harmless (kept once); a subject with two different objects in
  one task is an error naming both places.
* No token may be both a template word and an entity, and no two tasks may share an
  object-query prefix (nobody could route it): both are errors naming the lines.
* Anchors are allowed, aliases (``*name``) and merge keys (``<<``) are not: write the
  value out. Nesting deeper than 32 levels is refused.
* The file is UTF-8 (a UTF-8 byte-order mark is tolerated).
* Limits, each checked before any work that grows faster than the input: the file holds
  at most 4 MiB and each of its lines at most 1 MiB (checked on the bytes, before the YAML
  is parsed; larger dictionaries belong in facts files); a template has at most 1,000
  words (slots counted); a name (task, template word, subject, object) at most 1,000
  characters.

Facts files
-----------

``facts_file`` is a path relative to the YAML file's directory (or absolute), or a
non-empty list of such paths (their facts are merged). A file whose name ends in
``.csv`` is read with Python's :mod:`csv` module (comma-separated, double quotes for
fields containing commas, exactly 2 columns); any other name (``.tsv``, ``.tab``,
``.txt``, ...) is tab-separated with exactly 2 fields per line (no quoting). In both:

* files are UTF-8 (a byte-order mark is tolerated); lines end in ``\\n`` or ``\\r\\n``;
* blank lines and lines whose first non-blank character is ``#`` are skipped;
* the first remaining line is skipped if it is exactly the header
  ``subject<sep>object``; a first line of other lower-case names above a line with an
  upper-case letter (``language<TAB>creator``) is refused as a likely header, never read
  as a fact (:mod:`tasks.facts_files`);
* fields are stripped of surrounding whitespace.
* a line holds at most 1 MiB; the file's size is not limited.

Errors
------

Every problem is one :class:`~tasks.errors.TaskError` whose string is one line,
``file:line: what is wrong; how to fix it``; the line is 1-based and refers to the
facts file when the problem is in one.

Dumping
-------

:func:`dumps_tasks` writes facts inline. :func:`dump_tasks` with ``facts_dir`` writes
each task's facts to ``<facts_dir>/<safe task name>.tsv`` (header line included) and
refers to it by a relative ``facts_file``; a task whose entities cannot be written
safely to a tab-separated file (a subject starting with ``#``, control characters)
keeps its facts inline. ``ascii=True`` writes the YAML in ASCII (``*1``/``*2`` and
escapes); facts files are always UTF-8. Every output file is written to a temporary
file in the same directory and moved into place with :func:`os.replace`, so a failed
dump leaves the previous files untouched and no partial file behind. A YAML the reader would
refuse for its size (facts inline beyond 4 MiB) is not written: give ``facts_dir``.
"""

from __future__ import annotations

from tasks.reading import PARAMETER_NAMES, input_files, input_signature, load_tasks, loads_tasks
from tasks.writing import dump_tasks, dumps_tasks

__all__ = ["load_tasks", "loads_tasks", "dump_tasks", "dumps_tasks", "input_files",
           "input_signature", "PARAMETER_NAMES"]
