"""The repository's own descriptions kept true, in process: deploy/kiln.env.example documents
every setting with its default, and the README's layout names every package of ``gateway/``."""
import dataclasses
import re

import pytest

import nginx_proc
from gateway.config import Config
from gateway_proc import ROOT

pytestmark = pytest.mark.unit
ENV_EXAMPLE = ROOT / "deploy" / "kiln.env.example"
MiB = 1024 * 1024

# Commented-out settings that show an example value, their default being empty (said in words).
EXAMPLE_VALUES = {"KILN_CORS_ORIGINS", "KILN_SLOT_DIR"}


def env_example_settings(text):
    """``{name: (value, commented out, its comment)}`` of each ``KILN_*`` line of the example;
    settings on consecutive lines share the comment above them."""
    out, comment, after_setting = {}, [], False
    for line in text.splitlines():
        match = re.match(r"^(#?)(KILN_\w+)=(.*)$", line)
        if match:
            out[match[2]] = (match[3], bool(match[1]), " ".join(comment))
        elif line.startswith("#"):
            comment = ([] if after_setting else comment) + [line]
        elif not line.strip():
            comment = []
        after_setting = bool(match)
    return out


def test_env_example_documents_every_setting():
    settings = env_example_settings(ENV_EXAMPLE.read_text())
    names = {f"KILN_{f.name.upper()}" for f in dataclasses.fields(Config)}
    names |= set(re.findall(r"KILN_[A-Z_]*[A-Z]", (ROOT / "deploy" / "gunicorn.conf.py")
                            .read_text()))
    assert names - set(settings) == set()
    for name, (value, commented, comment) in settings.items():
        assert comment.strip("# "), f"{name} has no comment"
        field = name.removeprefix("KILN_").lower()
        if commented and field in Config.__dataclass_fields__ and name not in EXAMPLE_VALUES:
            # "Unset variables take the default shown."
            assert getattr(Config.from_mapping({field: value}), field) == \
                getattr(Config(), field), name
    assigned = {name: value for name, (value, commented, _) in settings.items()
                if not commented}
    assert assigned["KILN_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert int(assigned["KILN_MAX_BODY_BYTES"]) == 16 * MiB
    assert assigned["KILN_BIND"] == nginx_proc.SHIPPED_UPSTREAM


def test_the_readmes_layout_names_every_package_and_shared_module():
    """README "Layout" names each package of ``gateway/`` (``api/``, ...) and each module left
    at its top, and nothing that does not exist."""
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    package = ROOT / "gateway"
    packages = {f"{p.parent.name}/" for p in package.glob("*/__init__.py")}
    modules = {p.stem for p in package.glob("*.py")}
    named = set(re.findall(r"`([a-z_]+/?)`", layout))
    assert packages - named == set()
    assert modules - named == set()
    elsewhere = {"gateway/", "tests/", "unit/", "functional/", "migrations/", "deploy/", "bench/",
                 "scripts/"}
    assert {n for n in named if n.endswith("/") and n not in elsewhere} <= packages
