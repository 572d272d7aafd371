"""verifier.running.parallel.in_background: a forked child's answer is the function's, whatever happens
to the child."""

from __future__ import annotations

import os

import pytest

from verifier.running.parallel import in_background


def test_the_child_computes_what_the_function_gives():
    parent = os.getpid()
    wait = in_background(lambda: (os.getpid(), [1, 2, 3]))
    pid, value = wait()
    assert value == [1, 2, 3] and pid != parent          # computed in the child


def test_without_fork_the_function_runs_when_waited_for():
    calls = []
    wait = in_background(lambda: calls.append(1) or len(calls), fork=False)
    assert calls == [] and wait() == 1


def test_a_failing_child_leaves_the_answer_to_the_parent():
    parent = os.getpid()

    def only_here():
        if os.getpid() != parent:
            raise RuntimeError("the child fails")
        return "computed here"

    assert in_background(only_here)() == "computed here"
    assert in_background(lambda: (lambda: None))() is not None    # a result that does not pickle: computed here
    with pytest.raises(ZeroDivisionError):                       # the function's own exception, in the parent
        in_background(lambda: 1 / 0)()


def test_a_killed_child_leaves_the_answer_to_the_parent():
    parent = os.getpid()

    def die_in_child():
        if os.getpid() != parent:
            os._exit(3)
        return 42

    assert in_background(die_in_child)() == 42
