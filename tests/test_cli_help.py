"""Every flag of `pdserve serve` and `pdserve bench serve` explains itself: non-empty help, and
where it has a default (other than None, or a plain on/off switch's own off), its help says so
(argparse's %(default)s or the word "default"). Walks the parsers' actions, as --help shows
them."""
import argparse

import pytest


def _parsers():
    from pdserve.bench.serve import build_parser as bench_parser
    from pdserve.server.main import build_parser as serve_parser
    return {"serve": serve_parser(), "bench serve": bench_parser()}


def _problems(p: argparse.ArgumentParser) -> list[str]:
    fmt = p._get_formatter()
    bad = []
    for a in p._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        name = a.option_strings[0] if a.option_strings else a.dest
        text = fmt._expand_help(a) if a.help else ""
        if not text.strip():
            bad.append(f"{name}: no help")
            continue
        # a store_true / store_false switch is off until given: its name says the default
        switch = isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if a.default is not None and a.default is not argparse.SUPPRESS and not switch \
                and "default" not in text.lower():
            bad.append(f"{name}: help does not mention its default {a.default!r}")
    return bad


@pytest.mark.parametrize("command", ["serve", "bench serve"])
def test_every_flag_has_help_and_names_its_default(command):
    assert _problems(_parsers()[command]) == []


def test_the_check_catches_a_bare_flag():
    """The walk above fails a flag without help, and one whose help hides its default."""
    p = argparse.ArgumentParser()
    p.add_argument("--a", type=int, default=3)
    p.add_argument("--b", type=int, default=3, help="a number")
    p.add_argument("--c", type=int, default=3, help="a number (default %(default)s)")
    p.add_argument("--d", action="store_true", help="on")
    assert _problems(p) == ["--a: no help", "--b: help does not mention its default 3"]
