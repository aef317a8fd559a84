"""TrackerConfig and the KVGUARD_* environment: one normalisation, strict booleans, no empty values."""
import pytest

from kvguard import SettingsError, TrackerConfig
from kvguard.settings import BACKENDS, FLAG_WORDS, MODES


@pytest.mark.parametrize("spelling", ["check", "CHECK", " Check "])
def test_config_and_environment_normalise_alike(spelling):
    direct = TrackerConfig(mode=spelling, backend=spelling.replace("check", "torch").replace("CHECK", "TORCH")
                           .replace("Check", "Torch"))
    from_env = TrackerConfig.from_env({"KVGUARD_MODE": spelling, "KVGUARD_BACKEND": direct.backend.upper()})
    assert direct == from_env
    assert (direct.mode, direct.backend) == ("check", "torch")


@pytest.mark.parametrize("field", ["quarantine", "log_violations"])
@pytest.mark.parametrize("value", ["false", "true", "no", 1, 0, None, ""])
def test_dataclass_booleans_take_only_bools(field, value):
    with pytest.raises(SettingsError, match=rf"{field}=.* is not a bool; use True or False"):
        TrackerConfig(**{field: value})


@pytest.mark.parametrize("field", ["mode", "backend"])
@pytest.mark.parametrize("value", ["", "   ", None, 1])
def test_dataclass_rejects_empty_or_non_string_choices(field, value):
    choices = {"mode": MODES, "backend": BACKENDS}[field]
    with pytest.raises(SettingsError) as err:
        TrackerConfig(**{field: value})
    assert f"{field}=" in str(err.value) and all(c in str(err.value) for c in choices)


@pytest.mark.parametrize("key", ["KVGUARD_MODE", "KVGUARD_BACKEND", "KVGUARD_QUARANTINE",
                                 "KVGUARD_LOG_VIOLATIONS"])
@pytest.mark.parametrize("value", ["", "  "])
def test_empty_environment_values_are_rejected(key, value):
    with pytest.raises(SettingsError, match=rf"{key}=.* is empty"):
        TrackerConfig.from_env({key: value})


@pytest.mark.parametrize("word", sorted(FLAG_WORDS))
def test_environment_booleans(word):
    for spelling in (word, word.upper(), f" {word} "):
        assert TrackerConfig.from_env({"KVGUARD_QUARANTINE": spelling}).quarantine is FLAG_WORDS[word]


def test_bad_variable_fails_even_where_an_override_wins():
    with pytest.raises(SettingsError, match="KVGUARD_MODE='chek' is not valid; choose one of off, check"):
        TrackerConfig.from_env({"KVGUARD_MODE": "chek"}, mode="check")
    assert TrackerConfig.from_env({"KVGUARD_MODE": "off"}, mode="check").mode == "check"
