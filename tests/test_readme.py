from pathlib import Path

from sluicegate.settings import settings_markdown


def test_readme_settings_table_is_current() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert settings_markdown() in readme, "regenerate the README's table: sluicegate config --markdown"
