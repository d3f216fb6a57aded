"""The README and the guides stay true: the two commands come first, every file and link they name
exists, every config field they name is a field of the config, every make target is the
Makefile's, and the exit-code table is the code's."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
SECTIONS = ("model", "train", "data", "optim", "parallel", "checkpoint", "reliability")


def test_the_readme_starts_with_make_demo_and_make_test():
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```\w*\n(.*?)```", readme, re.S)
    assert first_block and first_block.group(1).split() == ["make", "demo", "make", "test"], first_block
    assert readme.index("```") < readme.index("\n## ")  # before any section


def test_every_link_and_named_file_exists():
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not re.match(r"[a-z]+://", target) and not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)}: link {target}")
        for path in re.findall(r"`((?:configs|benchmarks|megatrain|flows|tasks|scripts|infra|docs|tests)/[\w./-]+)`", text):
            if "<" not in path and "*" not in path and not (ROOT / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, missing


def _resolves(dotted: str) -> bool:
    from megatrain.config import Config

    model: type = Config
    for part in dotted.split("."):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return False
        annotation = fields[part].annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next((c for c in candidates if hasattr(c, "model_fields")), None)
    return True


def test_every_config_field_named_is_a_field():
    unknown, named = [], 0
    for doc in DOCS:
        for dotted in re.findall(r"`(" + "|".join(SECTIONS) + r")\.([a-z_][\w.]*)(?:[=:][^`]*)?`", doc.read_text()):
            name = ".".join(dotted).rstrip(".")
            named += 1
            if not name.endswith("*") and not _resolves(name):
                unknown.append(f"{doc.relative_to(ROOT)}: {name}")
    assert named > 20 and not unknown, unknown


def test_every_make_target_named_is_the_makefiles():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = {t for doc in DOCS for t in re.findall(r"(?:`|^)make ([a-z][\w-]*)", doc.read_text(), re.M)}
    assert named and named <= targets, named - targets


def test_the_exit_code_table_is_the_codes():
    from megatrain import errors

    codes = {getattr(errors, name) for name in dir(errors) if name.startswith("EXIT_") and name != "EXIT_OK"}
    table = (ROOT / "docs" / "guides" / "failures.md").read_text()
    listed = {int(code) for code in re.findall(r"^\|\s*(\d+)\s*\|", table, re.M)}
    assert listed == codes, (sorted(listed), sorted(codes))
