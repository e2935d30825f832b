"""docs/configuration.md is generated from the config models: it must be the generator's
output, and every field must say what it does."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from dilonode.cli import config_doc

PAGE = Path(__file__).parents[2] / "docs" / "configuration.md"


def test_the_page_is_the_generated_reference():
    assert PAGE.read_text() == config_doc.render(), (
        "docs/configuration.md is out of date: run `python -m dilonode.cli.config_doc --write`")


def test_every_field_of_every_model_has_a_description():
    assert config_doc.undocumented() == []


def test_every_component_has_a_section_and_every_field_an_entry():
    page = config_doc.render()
    for section, model in config_doc.models():
        assert f"## `[{section}]`: `{model.__name__}`" in page or not section
        for name, field in model.model_fields.items():
            nested = isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
            assert nested or f"\n- `{name}` " in page, f"{section}.{name} has no entry"


class _Inner(BaseModel):
    """A nested component."""

    depth: int = Field(2, ge=1, le=8, description="how deep | how far")
    limit: int | None = Field(None, ge=0, description="optional")


class _Outer(BaseModel):
    """The root."""

    mode: str = "a"
    """Set by a docstring under the field."""
    inner: _Inner = _Inner()
    bare: float = 1.5


def test_a_nested_model_gets_its_own_section_and_docstrings_count():
    assert [s for s, _ in config_doc.models(_Outer)] == ["", "inner"]
    assert config_doc.undocumented(_Outer) == ["bare"]
    assert '- `mode` = `"a"` (str): Set by a docstring under the field.' in \
        config_doc._section("", _Outer)
    inner = config_doc._section("inner", _Inner)
    assert "- `depth` = `2` (int, >= 1, <= 8): how deep | how far" in inner
    assert "- `limit` (int, >= 0, unset): optional" in inner


def test_check_and_write(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    assert config_doc.main(["--check", "--path", str(page)]) == 1
    assert config_doc.main(["--write", "--path", str(page)]) == 0
    assert page.read_text() == config_doc.render()
    assert config_doc.main(["--check", "--path", str(page)]) == 0
    assert config_doc.main([]) == 0
    assert capsys.readouterr().out == config_doc.render()
