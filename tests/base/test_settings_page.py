"""docs/configuration.md is generated from the settings classes: it must match them, and every setting must say
what it does."""

from __future__ import annotations

import pytest
from pydantic_settings import BaseSettings

from services.base import settings, settings_page


def test_the_configuration_page_matches_the_settings_classes():
    written = settings_page.PAGE.read_text() if settings_page.PAGE.exists() else ""
    if written != settings_page.render():
        pytest.fail(f"{settings_page.PAGE} differs from the settings classes in services/base/settings.py: "
                    f"run `{settings_page.COMMAND}`")


def test_every_setting_has_a_description():
    missing = settings_page.undocumented()
    assert not missing, (f"settings with neither a Field(description=...) nor a comment: {', '.join(missing)}; "
                         f"describe them in services/base/settings.py, then run `{settings_page.COMMAND}`")


def test_every_settings_class_and_variable_is_on_the_page():
    page = settings_page.render()
    classes = settings_page.settings_classes()
    assert {cls.__name__ for cls in classes} == {
        name for name, obj in vars(settings).items()
        if isinstance(obj, type) and issubclass(obj, BaseSettings) and obj is not BaseSettings}
    for cls in classes:
        for name, field in cls.model_fields.items():
            for env in settings_page.env_names(cls, name, field):
                assert f"`{env}`" in page
    assert "`TOKENFLEET_WORKER_MAX_NUM_SEQS`" in page and "`TOKENFLEET_GATEWAY_PORT` | int | `8000`" in page
    assert "`TOKENFLEET_REDIS_URL` or `REDIS_URL`" in page
