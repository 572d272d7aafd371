"""Training single-layer mixture-of-experts transformers on knowledge tasks (optional).

This package is **neither the hand construction** (:mod:`construction`) **nor the
verifier** (:mod:`verifier`). It reproduces the paper's experiments: it trains, with
PyTorch on the CPU, a model of exactly the architecture of the weight layout
(:mod:`layout`: BOS at position 0, token + position embedding, H heads without
score scaling, residual, linear gate, top-1 routing, ReLU experts, residual,
unembedding), with the Switch-style differentiable gate ``gate_mode = "top1-scaled"``,
under three objectives (cross-entropy; + load balancing; + task-router loss), and
exports the result as :class:`layout.Weights`, so the verifier can check it
like any other weights.

It needs the ``train`` extra (``pip install -e ".[train]"``, which pins a CPU build of
torch); the heat maps need the ``plots`` extra (matplotlib). Nothing outside this
package imports it, but for :mod:`training.cramming` (the soft-prompt search of
``python -m verifier accessible``, run by :mod:`workflow.accessibility`), which imports
nothing of :mod:`workflow` or :mod:`cli`.

Modules:

* :mod:`training.data`: every query of a task set as tensors (prefix, valid next
  tokens, object-query flag, determined task);
* :mod:`training.model`: the torch module (:class:`~training.model.MoETransformer`);
* :mod:`training.objectives`: the losses;
* :mod:`training.loop`: :func:`~training.loop.train`, :func:`~training.loop.evaluate`;
* :mod:`training.rounds`: counterexample rounds, training until the verifier certifies;
* :mod:`training.train`: the CLI (``python -m training.train TASKS.yaml -o trained.npz``);
* :mod:`training.export`: to :class:`layout.Weights`, with an optional
  expert -> task mapping;
* :mod:`training.metrics`: routing matrix, purity, entropy, parameter counts;
* :mod:`training.sweep`: the experiment grid, writing ``docs/training/``;
* :mod:`training.plots`: Figure-2-style task x expert heat maps;
* :mod:`training.cramming`: soft prompts by gradient search, proposed to the verifier's
  accessibility analysis (:mod:`verifier.accessibility.accessible`).
"""
