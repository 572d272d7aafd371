"""Weight files that an earlier verifier certified although they are wrong (an outside review).

One regression test per class an outside review found (each certified, exit 0, before
the fix), plus the decision on the empty prefix:

1. non-canonical CSR: duplicate entries whose float sum is not their exact sum;
2. underflow treated as an exact zero, then amplified (expert path);
3. the same through an attention head's value path (knowledge outside the expert);
4. malformed files accepted, coerced or crashing;
5. the empty prefix (BOS alone) is not a query, and says so.

The truth is the independent oracle's exact evaluation (rationals, exp at 40+ digits).
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import mpmath
import numpy as np
import pytest
import scipy.sparse as sp

from tasks.errors import TaskError
from tasks.queries import query_groups
import layout
from verifier.checks.certify import certify
from layout import Expert, Head
from audit.oracle import Oracle, enumerate_queries
from verifier.checks.verify import verify
from repository import ROOT

EXAMPLE = ROOT / "examples" / "capitals.yaml"


@pytest.fixture(scope="module")
def built(capitals_model):
    return capitals_model.instantiate()


def _widen(w, labels):
    """``w`` with new residual directions (zero everywhere), named ``labels``; returns (weights, first new index)."""
    n, d = len(labels), w.d
    col = lambda m: sp.csr_matrix(sp.hstack([m, sp.csr_matrix((m.shape[0], n))]))  # noqa: E731
    row = lambda m: sp.csr_matrix(sp.vstack([m, sp.csr_matrix((n, m.shape[1]))]))  # noqa: E731
    heads = tuple(Head(col(h.W_Q), col(h.W_K), col(h.W_V), row(h.W_O)) for h in w.heads)
    experts = tuple(Expert(col(e.W_1), e.b_1, row(e.W_2)) for e in w.experts)
    return w.replace(E=col(w.E), P=col(w.P), heads=heads, W_G=col(w.W_G), experts=experts, U=col(w.U),
                     residual_labels=w.residual_labels + tuple(labels)), d


def _set(m, entries):
    m = sp.lil_matrix(m, copy=True)
    for (i, j), v in entries.items():
        m[i, j] = v
    return sp.csr_matrix(m)


def _exact(taskset, w, prefix):
    return Oracle(dps=60).query(taskset, w, tuple(prefix.split()))


def _enclosure(taskset, w, prefix):
    """The verifier's enclosures for one query of the task set (the public per-query API)."""
    q = next(q for q in enumerate_queries(taskset) if q.prefix == tuple(prefix.split()))
    return certify(w, [q.prefix], [q.valid], ablate=True)


# --- class 1: non-canonical storage ----------------------------------------------------------------


def _duplicated(m, i, j, values):
    """``m`` with entry (i, j) stored as the given duplicates, in that order."""
    coo = sp.coo_matrix(m)
    keep = ~((coo.row == i) & (coo.col == j))
    rows = np.concatenate([coo.row[keep], np.full(len(values), i)])
    cols = np.concatenate([coo.col[keep], np.full(len(values), j)])
    vals = np.concatenate([coo.data[keep], values])
    order = np.argsort(rows, kind="stable")
    ptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=m.shape[0]))])
    return sp.csr_matrix((vals[order], cols[order], ptr), shape=m.shape)


def cancelling_unembedding(w):
    """U[Tokyo, next:Paris] stored as 2^60, 40, −2^60: exactly 40, but 0 when summed in float from the left."""
    i, j = w.vocab.index("Tokyo"), w.residual_labels.index("next:Paris")
    return w.replace(U=_duplicated(w.U, i, j, [2.0 ** 60, 40.0, -(2.0 ** 60)]))


def test_duplicate_entries_that_cancel_in_float_are_refused(capitals_set, built):
    w = cancelling_unembedding(built)
    truth = Oracle().judge(capitals_set, w, 0.01)
    assert "error" in truth.counts            # exactly 40: Tokyo wins 'the capital of France is'
    with pytest.raises(TaskError, match=r"U row \d+, column \d+ is stored twice"):
        verify(capitals_set, w, 0.01)


def test_gate_duplicates_with_an_exact_sum_are_refused(capitals_set, built):
    """W_G entries 2^60 and −(2^60 − 256): every summation order gives 256, yet the storage is ambiguous."""
    j = built.residual_labels.index("one")
    w = built.replace(W_G=_duplicated(built.W_G, 1, j, [2.0 ** 60, -(2.0 ** 60 - 256)]))
    with pytest.raises(TaskError, match="W_G row 1, column .* stored twice"):
        verify(capitals_set, w, 0.01)


def test_canonical_form_is_computed_not_read_from_scipy_flags(capitals_set, built):
    U = _duplicated(built.U, 0, 0, [1.0, -1.0])
    U.has_canonical_format = True   # a lie scipy would believe
    with pytest.raises(TaskError, match="stored twice"):
        verify(capitals_set, built.replace(U=U), 0.01)
    unsorted = built.U.copy()
    a, b = unsorted.indptr[0], unsorted.indptr[1]
    if b - a < 2:
        unsorted = _set(built.U, {(0, 0): 1.0, (0, 5): 1.0})
        a, b = unsorted.indptr[0], unsorted.indptr[1]
    unsorted.indices[a:b] = unsorted.indices[a:b][::-1].copy()
    unsorted.data[a:b] = unsorted.data[a:b][::-1].copy()
    unsorted.has_sorted_indices = True
    with pytest.raises(TaskError, match="not sorted"):
        verify(capitals_set, built.replace(U=unsorted), 0.01)


def test_a_matrix_checked_once_is_checked_again_after_any_change(capitals_set, built):
    """The canonical-form check remembers a matrix it passed (layout.weights.sparse_problem):
    its arrays are private copies made read-only, so a write into them is refused, a view
    taken before the check no longer reaches them, and an array put in their place or laid
    out anew (strides, type) is scanned again."""
    from layout.weights import sparse_problem

    U = built.U.copy()
    assert sparse_problem(U) is None and not U.data.flags.writeable
    with pytest.raises(ValueError):
        U.data[0] = np.nan                        # refused: the array checked is read-only
    U.data = U.data.copy()                        # another array in its place, writeable
    U.data[0] = np.nan
    with pytest.raises(TaskError, match="not a finite number"):
        verify(capitals_set, built.replace(U=U), 0.01)
    U = built.U.copy()
    assert sparse_problem(U) is None
    U.indices = U.indices.copy()
    a, b = U.indptr[0], U.indptr[1]
    U.indices[a:b] = U.indices[a:b][::-1].copy()  # rows unsorted, data left as it was
    if b - a >= 2:
        with pytest.raises(TaskError, match="not sorted"):
            verify(capitals_set, built.replace(U=U), 0.01)
    U = built.U.copy()
    view = U.data.view()                          # a writeable view of U's values, taken before the check
    assert sparse_problem(U) is None
    view[0] = np.inf                              # U checked its own copy: the view no longer reaches it
    assert np.isfinite(U.data[0]) and sparse_problem(U) is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # (setting strides is deprecated, not refused)
        U = _set(built.U, {(0, 0): 1.0, (0, 5): 2.0})
        assert sparse_problem(U) is None
        U.indices.strides = (0,)                  # the same read-only object, every index now the first
    assert "stored twice" in sparse_problem(U)
    U = _set(built.U, {(0, 0): 1.0, (0, 5): 2.0})
    assert sparse_problem(U) is None
    U.indptr.dtype = np.int16 if U.indptr.dtype == np.int32 else np.int32   # the same object read as another type
    assert sparse_problem(U) is not None


def test_explicit_zeros_are_the_value_zero(capitals_set, built):
    U = built.U.copy()
    U.data[:3] = 0.0  # stored, canonical, exactly 0
    Z = built.U.copy()
    Z.data[:3] = 0.0
    Z.eliminate_zeros()
    a = verify(capitals_set, built.replace(U=U), 0.01)
    b = verify(capitals_set, built.replace(U=Z), 0.01)
    assert a.certified == b.certified
    assert [t.worst_error for t in a.tasks] == [t.worst_error for t in b.tasks]


def test_cli_refuses_a_file_with_duplicate_entries(tmp_path, built):
    arrays = layout.to_arrays(built)
    w = cancelling_unembedding(built)
    arrays["U.data"], arrays["U.indices"], arrays["U.indptr"] = (w.U.data, w.U.indices.astype(np.int64),
                                                                 w.U.indptr.astype(np.int64))
    path = tmp_path / "dup.npz"
    np.savez(path, **arrays)
    out = subprocess.run([sys.executable, "-m", "verifier", "check", str(EXAMPLE), "--weights", str(path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2, out.stdout
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert "'U' row" in out.stderr and "stored twice" in out.stderr


# --- class 2: underflow in an expert, amplified --------------------------------------------------------


def underflow_through_expert(w):
    """E[France] = 2^-600 on a new direction; a new capital-expert neuron reads it with 2^-500 (pre-activation
    2^-1100 > 0, below every float), writes 2^1000 on 'amp', and U[Tokyo, amp] = 2^110: logit 2^10 for Tokyo."""
    w, d = _widen(w, ["tiny", "amp"])
    tiny, amp = d, d + 1
    e = w.experts[0]
    W_1 = sp.csr_matrix(sp.vstack([e.W_1, sp.csr_matrix(([2.0 ** -500], ([0], [tiny])), shape=(1, w.d))]))
    W_2 = sp.csr_matrix(sp.hstack([e.W_2, sp.csr_matrix(([2.0 ** 1000], ([amp], [0])), shape=(w.d, 1))]))
    experts = (Expert(W_1, np.append(e.b_1, 0.0), W_2),) + w.experts[1:]
    return w.replace(E=_set(w.E, {(w.vocab.index("France"), tiny): 2.0 ** -600}),
                     U=_set(w.U, {(w.vocab.index("Tokyo"), amp): 2.0 ** 110}), experts=experts,
                     neuron_labels=(w.neuron_labels[0] + ("hidden",),) + w.neuron_labels[1:])


def test_underflow_then_amplification_in_an_expert_is_not_certified(capitals_set, built):
    w = underflow_through_expert(built)
    truth = _exact(capitals_set, w, "the capital of France")
    assert truth["error"] > 0.99                                  # Tokyo's logit is 2^10 above the rest
    res = _enclosure(capitals_set, w, "the capital of France")
    assert res.err_lo[0] <= truth["error"] <= res.err_hi[0]      # the enclosure holds the truth
    report = verify(capitals_set, w, 0.01)
    assert not report.certified
    assert any(c["check"] == "error" and c["prefix"] == "the capital of France" for c in report.counterexamples)


# --- class 3: the same through attention: knowledge outside the expert ------------------------------


def underflow_through_attention(w):
    """A new head attends from 'capital' to entities (score 40); its value path reads 2^-600 on E[France] with
    2^-500 (2^-1100: below every float) and W_O writes 2^1000 on 'amp'; U[Paris, amp] = 12·2^100. At
    'France has capital' the ablated model (no expert) still answers Paris; U is doubled so that every other
    query stays below ε."""
    w, d = _widen(w, ["tiny", "amp"])
    tiny, amp = d, d + 1
    labels = w.residual_labels
    head = Head(sp.csr_matrix(([40.0], ([0], [labels.index("word:capital")])), shape=(1, w.d)),
                sp.csr_matrix(([1.0], ([0], [labels.index("entity")])), shape=(1, w.d)),
                sp.csr_matrix(([2.0 ** -500], ([0], [tiny])), shape=(1, w.d)),
                sp.csr_matrix(([2.0 ** 1000], ([amp], [0])), shape=(w.d, 1)))
    U = w.U * 2.0
    return w.replace(heads=w.heads + (head,), E=_set(w.E, {(w.vocab.index("France"), tiny): 2.0 ** -600}),
                     U=_set(U, {(w.vocab.index("Paris"), amp): 12.0 * 2.0 ** 100}))


def test_underflow_in_a_value_path_is_not_certified(capitals_set, built):
    w = underflow_through_attention(built)
    truth = Oracle().judge(capitals_set, w, 0.01)
    assert set(truth.counts) == {"entanglement"}, truth.summary()   # only the ablation is wrong
    exact = _exact(capitals_set, w, "France has capital")
    assert exact["ablated"] < 0.01
    res = _enclosure(capitals_set, w, "France has capital")
    assert res.ablated_lo[0] <= exact["ablated"] <= res.ablated_hi[0]
    report = verify(capitals_set, w, 0.01)
    assert not report.certified
    assert not next(t for t in report.tasks if t.name == "capital").entanglement_ok


# --- class 4: malformed files --------------------------------------------------------------------------


def _file(tmp_path, arrays, name="w.npz"):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def _meta(arrays, **changes):
    meta = json.loads(str(arrays["meta"]))
    meta.update(changes)
    return {**arrays, "meta": np.array(json.dumps(meta))}


MALFORMED = {
    "meta is a JSON list": lambda a: {**a, "meta": np.array("[1, 2]")},
    "meta is not JSON": lambda a: {**a, "meta": np.array("{format")},
    "meta has a key twice": lambda a: {**a, "meta": np.array(str(a["meta"])[:-1] + ', "n_heads": 0}')},
    "meta.n_heads is 2.5": lambda a: _meta(a, n_heads=2.5),
    "meta.n_heads is true": lambda a: _meta(a, n_heads=True),
    "meta.n_heads is a string": lambda a: _meta(a, n_heads="6"),
    "meta.n_heads too small (a head is left over)": lambda a: _meta(a, n_heads=5),
    "meta.n_experts is 0": lambda a: _meta(a, n_experts=0),
    "meta has an unknown key": lambda a: _meta(a, gate_scale=2),
    "meta.gate_mode is unknown": lambda a: _meta(a, gate_mode="top2"),
    "meta.format is wrong": lambda a: _meta(a, format="other/1"),
    "meta holds NaN": lambda a: {**a, "meta": np.array(str(a["meta"])[:-1] + ', "parameters": {"x": NaN}}')},
    "neuron_labels of the wrong length": lambda a: _meta(a, neuron_labels=[["x"]] * 3),
    "residual_labels of the wrong length": lambda a: _meta(a, residual_labels=["x"]),
    "complex data": lambda a: {**a, "U.data": a["U.data"].astype(np.complex128) + 1e-3j},
    "complex data with zero imaginary part": lambda a: {**a, "U.data": a["U.data"].astype(np.complex128)},
    "string data": lambda a: {**a, "U.data": a["U.data"].astype(str)},
    "boolean data": lambda a: {**a, "b_G": np.ones(3, bool)},
    "fractional float indices": lambda a: {**a, "U.indices": a["U.indices"].astype(np.float64) + 0.5},
    "integral float indices": lambda a: {**a, "U.indices": a["U.indices"].astype(np.float64)},
    "float shape": lambda a: {**a, "U.shape": a["U.shape"].astype(np.float64)},
    "index out of range": lambda a: {**a, "U.indices": np.where(np.arange(a["U.indices"].size) == 0,
                                                                10 ** 6, a["U.indices"])},
    "indptr not starting at 0": lambda a: {**a, "U.indptr": a["U.indptr"] + 1},
    "non-finite weight": lambda a: {**a, "U.data": np.where(np.arange(a["U.data"].size) == 0, np.inf, a["U.data"])},
    "integers beyond 2^53": lambda a: {**a, "b_G": np.array([2 ** 60 + 1, 0, 0], np.int64)},
    "a member that is not part of the layout": lambda a: {**a, "heads.6.W_Q.data": np.zeros(1)},
    "a missing member": lambda a: {k: v for k, v in a.items() if k != "U.indptr"},
    "vocab of numbers": lambda a: {**a, "vocab": np.arange(a["vocab"].size)},
    "two experts named for one task": lambda a: {**a, "expert_tasks": np.array(["capital", "capital", "located"])},
    "a pickled object array": None,   # written by hand below
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_are_bad_input(tmp_path, built, case):
    arrays = layout.to_arrays(built)
    if case == "a pickled object array":
        arrays = dict(arrays)
        path = tmp_path / "w.npz"
        np.savez(path, **{**arrays, "vocab": np.array(list(built.vocab), dtype=object)}, allow_pickle=True)
    else:
        path = _file(tmp_path, MALFORMED[case](dict(arrays)))
    with pytest.raises(TaskError) as info:
        layout.load(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert "allow_pickle" not in message


def test_acceptable_encodings_load_to_the_same_weights(tmp_path, built):
    """float32 values and small integers are exact in float64, so they are read as the values they are."""
    arrays = dict(layout.to_arrays(built))
    arrays["b_G"] = arrays["b_G"].astype(np.float32)
    arrays["E.indices"] = arrays["E.indices"].astype(np.int32)
    w = layout.load(_file(tmp_path, arrays))
    assert np.array_equal(w.b_G, built.b_G) and (w.E != built.E).nnz == 0


def test_narrow_values_are_stored_only_where_exact_and_read_back_bitwise(tmp_path, built):
    """layout.save(narrow=True), as certificates are written: an array goes to float16/32 only
    if every value survives, and the weights read back are the same float64s, signs of zero included."""
    import scipy.sparse as sp

    tricky = np.array([2.0, -0.0, 65504.0, 2.0 ** -24, 1e-8, 0.1, 1.5, 3.0e38, 1e300])
    arrays = dict(layout.to_arrays(built, narrow=True))
    for value, stored in [(np.array([2.0, -0.0, 65504.0, 2.0 ** -24]), np.float16),
                          (np.array([2.0, 2.0 ** -30]), np.float32), (np.array([1.5, 2.0 ** 100]), np.float32),
                          (tricky, np.float64), (np.array([0.1]), np.float64)]:
        got = layout.npz._narrowest(value)
        assert got.dtype == stored and np.array_equal(got.astype(np.float64), value)
        assert np.array_equal(np.signbit(got.astype(np.float64)), np.signbit(value))
    assert any(a.dtype == np.float16 for k, a in arrays.items() if k.endswith(".data"))
    path = tmp_path / "narrow.npz"
    layout.save(built, path, small_indices=True, narrow=True)
    w = layout.load(path)
    for (name, a), (_, b) in zip(built.arrays(), w.arrays()):
        if sp.issparse(a):
            assert b.data.dtype == np.float64 and np.array_equal(a.data, b.data), name
            assert np.array_equal(np.signbit(a.data), np.signbit(b.data)), name
            assert np.array_equal(a.indices, b.indices) and np.array_equal(a.indptr, b.indptr), name
        else:
            assert b.dtype == np.float64 and np.array_equal(a, b), name


def test_duplicate_archive_members_are_refused(tmp_path, built):
    path = _file(tmp_path, layout.to_arrays(built))
    with zipfile.ZipFile(path, "a") as zf, pytest.warns(UserWarning):
        zf.writestr("U.data.npy", zf.read("U.data.npy"))
    with pytest.raises(TaskError, match="appears twice"):
        layout.load(path)


@pytest.mark.parametrize("case", ["meta is a JSON list", "complex data", "meta.n_heads is 2.5"])
def test_cli_malformed_file_is_one_line_exit_2(tmp_path, built, case):
    path = _file(tmp_path, MALFORMED[case](dict(layout.to_arrays(built))))
    out = subprocess.run([sys.executable, "-m", "verifier", "check", str(EXAMPLE), "--weights", str(path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


# --- class 5: the empty prefix -------------------------------------------------------------------------


def test_the_empty_prefix_is_not_a_query_and_the_report_says_so(capitals_set, built):
    lengths = {len(g.node.symbols) for g in query_groups(capitals_set)}
    assert min(lengths) == 1
    from verifier.checks.report import report_json

    data = report_json(verify(capitals_set, built, 0.01))
    assert "non-empty" in data["query_definition"] and "BOS alone" in data["query_definition"]
    from documents import text

    assert "non-empty proper prefix" in text()


def test_empty_prefix_error_is_what_the_readme_says(capitals_set, built):
    """The README quotes the built model's error on BOS alone (about 0.52); keep it honest."""
    from audit.exact import exact_forward

    valid = {built.vocab.index(s[0]) for s, *_ in capitals_set.sentences()}
    err = exact_forward(built, [], valid)["error"]
    assert abs(float(err) - 0.52) < 0.01
    assert mpmath.mpf(0) < err < 1


# --- found by an adversarial review of the fix -----------------------------------------------------------


def overflowing_attention_score(w):
    """A new head with q = (1, 1, 1, 1) everywhere and, at BOS only, k = (−M, −M, M, M), M = 1.7e308: the exact
    score is 0 (like every other position's), but −M + −M overflows to −inf. BOS's value puts 1000 on a direction
    U reads for 'the', so every query's exact error is about 1."""
    w, d = _widen(w, ["const", "bos", "out"])
    const, bos, out = d, d + 1, d + 2
    M = 1.7e308
    head = Head(sp.csr_matrix(([1.0] * 4, ([0, 1, 2, 3], [const] * 4)), shape=(4, w.d)),
                sp.csr_matrix(([-M, -M, M, M], ([0, 1, 2, 3], [bos] * 4)), shape=(4, w.d)),
                sp.csr_matrix(([1.0], ([0], [bos])), shape=(1, w.d)),
                sp.csr_matrix(([1000.0], ([out], [0])), shape=(w.d, 1)))
    return w.replace(heads=w.heads + (head,), E=_set(w.E, {(w.bos, bos): 1.0}),
                     P=_set(w.P, {(p, const): 1.0 for p in range(w.n_positions)}),
                     U=_set(w.U, {(w.vocab.index("the"), out): 1.0}))


def test_an_attention_score_that_overflows_is_unbounded(capitals_set, built):
    w = overflowing_attention_score(built)
    with np.errstate(all="ignore"):
        report = verify(capitals_set, w, 0.01)
        res = _enclosure(capitals_set, w, "the capital of France is")
    assert not report.certified
    exact = _exact(capitals_set, w, "the capital of France is")
    assert exact["error"] > 0.99
    assert res.err_lo[0] <= exact["error"] <= res.err_hi[0]


def test_an_overflowed_dot_product_reads_as_unbounded():
    from verifier.arithmetic import interval as I

    M = 1.7e308
    a = np.array([[1.0, 1.0, 1.0, 1.0]])
    b = np.array([[-M, -M, M, M]])
    with np.errstate(all="ignore"):
        m, r = I.dot_rows(a, np.zeros_like(a), b, np.zeros_like(b))
    assert I.lower(m, r)[0] == -np.inf and I.upper(m, r)[0] == np.inf


def _zip_members(path):
    with zipfile.ZipFile(path) as zf:
        return {i.filename: zf.read(i) for i in zf.infolist()}


def _write_zip(path, members, method=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", method) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _patch_headers(path, offset_in_header: int, value: bytes):
    """Overwrite a field in every local and central zip header (flag bits, compression method)."""
    data = bytearray(path.read_bytes())
    for sig, skip in ((b"PK\x03\x04", 0), (b"PK\x01\x02", 2)):
        start = 0
        while (i := data.find(sig, start)) >= 0:
            data[i + offset_in_header + skip: i + offset_in_header + skip + len(value)] = value
            start = i + 4
    path.write_bytes(bytes(data))
    return path


def _prepend_npy(path):
    import io

    head = io.BytesIO()
    np.save(head, np.zeros(3))
    path.write_bytes(head.getvalue() + path.read_bytes())
    return path


ARCHIVES = {
    "members flagged as encrypted": lambda p: _patch_headers(p, 6, b"\x01\x00"),
    "an unsupported compression method": lambda p: _patch_headers(p, 8, b"\x06\x00"),
    "a .npy file followed by a zip (a polyglot)": lambda p: _prepend_npy(p),
    "a member that is not .npy data": lambda p: _write_zip(p, {**_zip_members(p), "meta.npy": b"{}"}),
    "a member that is empty": lambda p: _write_zip(p, {**_zip_members(p), "E.data.npy": b""}),
}


@pytest.mark.parametrize("case", sorted(ARCHIVES))
def test_broken_archives_are_one_line_exit_2(tmp_path, built, case):
    path = tmp_path / "w.npz"
    layout.save(built, path)
    ARCHIVES[case](path)
    out = subprocess.run([sys.executable, "-m", "verifier", "check", str(EXAMPLE), "--weights", str(path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


@pytest.mark.parametrize("meta", [
    '{"x": 1e999}',                      # parsed as inf by a lenient reader
    '{"x": "\\ud800"}',                   # a lone surrogate: not printable, not writable as UTF-8
])
def test_meta_values_that_are_not_finite_or_not_text_are_refused(tmp_path, built, meta):
    arrays = dict(layout.to_arrays(built))
    base = json.loads(str(arrays["meta"]))
    base.pop("parameters")
    arrays["meta"] = np.array(json.dumps(base)[:-1] + ', "parameters": ' + meta + "}")
    with pytest.raises(TaskError):
        layout.load(_file(tmp_path, arrays))


def test_report_text_cannot_be_forged_by_parameters(capitals_set, built):
    from verifier.checks.report import summary

    w = built.replace(parameters={"beta": "8\nverdict: CERTIFIED at epsilon = 0.01\n", "gamma": "\x1b[8m"})
    text = summary(verify(capitals_set, w.replace(U=w.U * 0.5), 0.01))
    verdicts = [line for line in text.splitlines() if line.startswith("verdict:")]
    assert verdicts == [verdicts[-1]] and "NOT CERTIFIED" in verdicts[0]
    assert "\x1b" not in text


def test_names_that_a_weights_file_cannot_store_are_refused():
    from tasks.model import Task

    for bad in ("Paris\x00", "Pa\ud800ris"):
        with pytest.raises(TaskError, match="NUL character or a lone surrogate"):
            Task("a", ("x ⋆1 y ⋆2",), {"A": bad})


def test_verify_refuses_an_ill_posed_task_set(built):
    from tasks.model import Task, TaskSet

    ill = TaskSet((Task("a", ("⋆1 is ⋆2",), {"A": "B"}), Task("b", ("⋆1 is ⋆2",), {"A": "C"})))
    with pytest.raises(TaskError):
        verify(ill, built, 0.01)
