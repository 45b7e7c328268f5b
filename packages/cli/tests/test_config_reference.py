"""``docs/config.md`` lists every key the config dataclasses define, with its default and a
meaning, and equals what ``mtl.cli.config_reference.render()`` makes of them today."""

import dataclasses
from pathlib import Path

from mtl.cli.config_reference import missing_meanings, render
from mtl.core.config import SECTIONS

DOC = Path(__file__).resolve().parents[3] / "docs" / "config.md"


def test_docs_config_md_matches_the_dataclasses():
    assert DOC.read_text() == render(), (
        "docs/config.md is out of date with mtl/core/config_sections.py: regenerate it with "
        "`python -m mtl.cli.config_reference > docs/config.md`")


def test_every_key_is_listed_with_a_meaning():
    assert missing_meanings() == [], "add a comment beside the field in config_sections.py (or an entry in MEANINGS)"
    text = render()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"| `{section}.{f.name}` |" in text
