"""The README is a guide a newcomer can follow: short, its links lead somewhere, its example file is
valid and its commands are ones the CLI accepts."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import yaml

from flows.cli import _parser
from tasks.config.spec import load

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_readme_is_a_short_guide_whose_links_lead_somewhere():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert "make run" in text and "make test" in text
    for page in ["docs/" + p.name for p in (REPO / "docs").glob("*.md")] + ["docker/README.md"]:
        assert f"]({page}" in text, f"README.md does not lead to {page}"
    for target in re.findall(r"\]\(((?:docs|docker)/[^)#]+)", text):
        assert (REPO / target).is_file(), f"README.md links to {target}, which does not exist"
    for page in (REPO / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+\.md)", page.read_text()):
            assert (page.parent / target).is_file(), f"{page.name} links to {target}, which does not exist"


def test_readme_example_pipelines_file_is_valid(tmp_path):
    (example,) = _blocks(README.read_text(), "yaml")
    shutil.copytree(REPO / "data", tmp_path / "data")
    (tmp_path / "pipelines.yaml").write_text(example)
    specs = load(tmp_path / "pipelines.yaml", check_env=False)
    assert yaml.safe_load(example)["pipelines"].keys() == specs.pipelines.keys()


def test_every_smelter_command_in_the_readme_and_docs_parses():
    pages = [README, REPO / "docker" / "README.md", *(REPO / "docs").glob("*.md")]
    commands = []
    for page in pages:
        for block in _blocks(page.read_text(), "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line.split("#")[0])
                if "smelter" in words:
                    commands.append(words[words.index("smelter") + 1:])
    assert commands
    for args in commands:
        _parser().parse_args(args)  # argparse exits (SystemExit) on a command the CLI does not take


def test_readme_pictures_exist_and_come_from_the_screenshot_script():
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", README.read_text())
    assert pictures, "the README shows no screenshot"
    names = re.findall(r'"([\w{}.-]+\.png)"', (REPO / "scripts" / "screenshots.py").read_text())  # f-string templates
    made = [re.compile(r"[\w.-]+".join(map(re.escape, re.split(r"\{[\w.]+\}", name))) + "$") for name in names]
    for picture in pictures:
        assert (REPO / picture).is_file(), f"README.md shows {picture}, which does not exist"
        assert any(m.match(picture.split("/")[-1]) for m in made), f"{picture} is not one scripts/screenshots.py makes"
