"""Data directory resolution and the errors for missing data."""

import pytest

from lla.data import paths


def test_explicit_argument_wins_over_environment(tmp_path, monkeypatch):
  explicit, from_env = tmp_path / "explicit", tmp_path / "env"
  explicit.mkdir()
  from_env.mkdir()
  monkeypatch.setenv(paths.ENV_VAR, str(from_env))
  assert paths.resolve_data_dir(explicit) == explicit
  assert paths.resolve_data_dir(None) == from_env
  assert paths.resolve_data_dir("") == from_env


def test_nothing_configured_lists_both_places_and_how_to_fix(monkeypatch):
  monkeypatch.delenv(paths.ENV_VAR, raising=False)
  with pytest.raises(paths.DataNotFoundError) as error:
    paths.resolve_data_dir(None)
  message = str(error.value)
  assert "argument data_dir: (not given)" in message
  assert f"environment variable {paths.ENV_VAR}: (unset)" in message
  assert "--config.data.data_dir" in message
  assert "wikitext-2/{train,valid,test}.txt" in message
  assert "gpt2-tokenizer/{vocab.json,merges.txt}" in message
  assert isinstance(error.value, FileNotFoundError)


def test_missing_explicit_directory_is_not_replaced_by_environment(tmp_path, monkeypatch):
  monkeypatch.setenv(paths.ENV_VAR, str(tmp_path))
  missing = tmp_path / "nope"
  with pytest.raises(paths.DataNotFoundError) as error:
    paths.resolve_data_dir(missing)
  assert str(missing) in str(error.value)
  assert "not consulted" in str(error.value)


def test_missing_environment_directory_names_it(tmp_path, monkeypatch):
  monkeypatch.setenv(paths.ENV_VAR, str(tmp_path / "gone"))
  with pytest.raises(paths.DataNotFoundError, match="gone"):
    paths.resolve_data_dir(None)


def test_find_file_lists_every_candidate(tmp_path):
  (tmp_path / "b.txt").write_text("x")
  assert paths.find_file(tmp_path, ["a.txt", "b.txt"], "thing") == tmp_path / "b.txt"
  with pytest.raises(paths.DataNotFoundError) as error:
    paths.find_file(tmp_path, ["a.txt", "c/d.txt"], "thing")
  assert error.value.looked == (str(tmp_path / "a.txt"), str(tmp_path / "c/d.txt"))
  assert str(tmp_path / "c/d.txt") in str(error.value)
