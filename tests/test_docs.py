"""README and docs: every relative link names a file of the repository, and the training guide
names every model file."""

import re

import pytest
from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
  targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
  missing = [t for t in targets if "://" not in t and not t.startswith("mailto:") and not (page.parent / t).exists()]
  assert missing == [], f"{page.relative_to(ROOT)} links to missing {missing}"


def test_the_training_guide_names_every_model_file():
  guide = (ROOT / "docs" / "guides" / "training.md").read_text()
  missing = [p.stem for p in sorted((ROOT / "configs" / "models").glob("*.yml")) if f"`{p.stem}`" not in guide]
  assert missing == [], f"docs/guides/training.md does not name {missing}"
