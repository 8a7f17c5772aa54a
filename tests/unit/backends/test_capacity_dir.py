"""The slot and load files' directory (gateway/backends/capacity.py): the default is this
user's private directory, and one another user could have made is refused."""
import os

import pytest

from gateway.backends import capacity


def test_the_default_is_a_private_directory_of_this_user(tmp_path, monkeypatch):
    monkeypatch.setattr(capacity.tempfile, "gettempdir", lambda: str(tmp_path))
    path = capacity.slot_dir("")
    assert path == tmp_path / f"kiln-slots-{os.getuid()}"
    assert path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o777 == 0o700


def test_a_default_directory_others_may_write_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(capacity.tempfile, "gettempdir", lambda: str(tmp_path))
    shared = tmp_path / f"kiln-slots-{os.getuid()}"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # as if made by someone else for everyone
    with pytest.raises(RuntimeError, match="KILN_SLOT_DIR"):
        capacity.slot_dir("")


def test_a_symlink_in_its_place_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(capacity.tempfile, "gettempdir", lambda: str(tmp_path))
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / f"kiln-slots-{os.getuid()}").symlink_to(target)
    with pytest.raises(RuntimeError):
        capacity.slot_dir("")


def test_a_configured_directory_is_used_as_given(tmp_path):
    assert capacity.slot_dir(str(tmp_path / "run" / "slots")) == tmp_path / "run" / "slots"
