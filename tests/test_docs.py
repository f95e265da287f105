"""Every reference to a section of the package's docs (`docs/semantics.md#13-tree-drafts`
in code and docs, `semantics.md#...` links between the docs) names a heading that
exists, under the anchor GitHub gives it; CI runs the commands README gives."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md")),
           *sorted((ROOT / "kda_ops").rglob("*.py")), *sorted((ROOT / "tools").glob("*.py"))]
REFERENCE = re.compile(r"(?:docs/)?([a-z_]+\.md)#([A-Za-z0-9_-]*[A-Za-z0-9_])")


def anchor(heading):
    """GitHub's anchor of a markdown heading: lower case, punctuation but `-`
    and `_` dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc):
    return {anchor(line.lstrip("#")) for line in doc.read_text().splitlines()
            if line.startswith("#")}


def test_anchor_follows_github():
    assert anchor("13. Tree drafts") == "13-tree-drafts"
    assert anchor("7. Caches in a model, dtypes and gradients") == \
        "7-caches-in-a-model-dtypes-and-gradients"
    assert anchor("6. conv_update") == "6-conv_update"


def references():
    found = []
    for source in SOURCES:
        for number, line in enumerate(source.read_text().splitlines(), 1):
            for name, target in REFERENCE.findall(line):
                found.append((f"{source.relative_to(ROOT)}:{number}", name, target))
    return found


def test_references_are_found():
    names = {name for _, name, _ in references()}
    assert {"semantics.md", "integration.md", "performance.md", "compile.md"} <= names


@pytest.mark.parametrize("where, name, target", references(),
                         ids=lambda value: value if ":" in str(value) else None)
def test_reference_names_an_existing_section(where, name, target):
    doc = DOCS / name
    assert doc.is_file(), f"{where}: no docs/{name}"
    assert target in anchors(doc), f"{where}: docs/{name} has no section #{target}"


def _bash_blocks(text):
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_ci_runs_readme_s_install_and_test_commands():
    """.ci/run installs exactly as README says and runs README's test command:
    both commands appear in it word for word."""
    readme = _bash_blocks((ROOT / "README.md").read_text())
    install = next(block for block in readme if "pip install 'torch==" in block).strip()
    tests = next(block for block in readme if "python -m pytest" in block).strip()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install in ci and tests in ci
