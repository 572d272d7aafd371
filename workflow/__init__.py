"""The library layer: what each command does, without the command line.

The verifier certifies weights without knowing how they were made; the construction builds
them and knows its own evidence. These modules compose the two for a task set, and are
what :mod:`cli` parses arguments for and prints; a library user calls them directly:

* :mod:`workflow.checking`: ``check`` as a whole (given weights, a model built, a certificate);
* :mod:`workflow.check`: build (for a floating-point deployment, if asked) and verify,
  with the construction's evidence attached;
* :mod:`workflow.execution`: the deployment of ``--precision`` and where the work runs;
* :mod:`workflow.build`: the construction, aimed at a deployment, and ``build``;
* :mod:`workflow.certificates`: the full check that saves a certificate, and the
  parameters it leaves room with (``check --certificate``);
* :mod:`workflow.since`: re-certification of an edit from a certificate (``check --since``);
* :mod:`workflow.watching`: a certificate held in memory, re-certified at each edit (``watch``);
* :mod:`workflow.export`: the certified model as an ONNX graph (``export``);
* :mod:`workflow.inspect`: the construction shown, or why there is none (``inspect``);
* :mod:`workflow.explain`: one prefix traced (``explain``);
* :mod:`workflow.plots`: the pictures that need both sides (``plot``);
* :mod:`workflow.accessibility`: the sequences the model can be made to generate (``accessible``);
* :mod:`workflow.errors`: what a command stops on besides bad input.
"""
