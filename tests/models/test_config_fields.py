"""Typed config-field reads: what a bad field or file is refused as, and the message naming it."""
from __future__ import annotations

import json
import sys

import pytest

from m3_eagle_plugin.models.config_fields import ConfigError, ConfigFields, read_json_object


def test_an_integer_too_long_to_read_names_the_file(tmp_path):
    """json reads integers of up to sys.get_int_max_str_digits() digits; a longer one raised a bare
    ValueError naming neither the file nor the field (transformers' own reader fails on it too)."""
    digits = sys.get_int_max_str_digits() + 1
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": ' + "7" * digits + "}")
    with pytest.raises(ValueError) as oracle:  # the parser's own refusal: what the message must carry
        json.loads(path.read_text())
    with pytest.raises(ConfigError) as info:
        read_json_object(path)
    assert str(info.value) == f"{path}: cannot be read as JSON ({str(oracle.value).split(';')[0]})"
    assert f"value has {digits} digits" in str(info.value)


def test_a_required_field_given_as_null_is_named_null_not_missing():
    fields = ConfigFields({"hidden_size": None}, "x.json", "text_config")
    with pytest.raises(ConfigError, match=r"^x\.json: text_config\.hidden_size: required field is null$"):
        fields.get_int("hidden_size")
    with pytest.raises(ConfigError, match=r"^x\.json: text_config\.vocab_size: required field is missing$"):
        fields.get_int("vocab_size")
    assert fields.get_int("hidden_size", 7) == 7  # a null with a default takes the default, as a missing one
