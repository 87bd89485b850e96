"""`--tls-self-signed`'s throw-away files: an owner-only directory (0700) and files (0600), removed by
`TlsFiles.remove` at stop; a cache dir that cannot be written is one clear error naming it, not a traceback."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from colibri_common import tls
from colibri_common.errors import ColibriError, ConfigError
from colibri_common.tls import TlsFiles, self_signed
from tests.conftest import colibri_run


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_directory_is_owner_only_and_removed_at_stop(tmp_path):
    d = tmp_path / "cache" / "tls-1"
    files = self_signed(d)
    assert files.directory == str(d)
    assert mode(d) == 0o700
    for f in (files.cert, files.key, files.ca):
        assert Path(f).parent == d and mode(f) == 0o600
    files.remove()
    assert not d.exists() and (tmp_path / "cache").is_dir()
    files.remove()                                        # twice is harmless


def test_an_existing_directory_is_made_owner_only(tmp_path):
    d = tmp_path / "tls-2"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    files = self_signed(d)
    assert mode(d) == 0o700 and mode(files.key) == 0o600


def test_a_link_in_place_of_the_directory_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "tls-3").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ColibriError, match="not a directory of this user"):
        self_signed(tmp_path / "tls-3")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_files_the_user_named_are_never_removed(tmp_path):
    made = self_signed(tmp_path / "mine")
    named = TlsFiles.of(made.cert, made.key, made.ca)
    assert named is not None and named.directory is None
    named.remove()
    assert all(Path(f).is_file() for f in (made.cert, made.key, made.ca))


def test_a_cache_dir_that_is_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "cache").write_text("not a directory")
    with pytest.raises(ColibriError) as err:
        self_signed(tmp_path / "cache" / "tls-4")
    assert str(tmp_path / "cache" / "tls-4") in str(err.value) and "COLIBRI_CACHE_DIR" in str(err.value)


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.ENOSPC])
def test_a_directory_that_cannot_be_written_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch, code):
    real_open = os.open

    def refuse_the_key(path, flags, *args):
        if Path(path).name == "key.pem":
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(tls.os, "open", refuse_the_key)
    d = tmp_path / "tls-5"
    with pytest.raises(ColibriError) as err:
        self_signed(d)
    assert str(d) in str(err.value) and "COLIBRI_CACHE_DIR" in str(err.value) and os.strerror(code) in str(err.value)
    assert not d.exists()                                 # the files begun there, and the directory, removed


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_cache_dir_is_a_clear_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ColibriError, match="COLIBRI_CACHE_DIR"):
            self_signed(ro / "tls-6")
    finally:
        ro.chmod(0o700)


def test_serve_with_an_unwritable_cache_dir_says_so_without_a_traceback(oracles, tmp_path):
    (tmp_path / "cache").write_text("not a directory")
    env = {**os.environ, "COLIBRI_CACHE_DIR": str(tmp_path / "cache")}
    out = colibri_run(["serve", "--model", str(oracles["olmoe"].path), "--workers", "1", "--port", "0",
                       "--tls-self-signed"], timeout=120, env=env)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert str(tmp_path / "cache") in out.stderr and "set COLIBRI_CACHE_DIR to a writable directory" in out.stderr


@pytest.mark.parametrize("flags, message", [
    (["--tls-ca", "CA", "--tls-cert", "CA"], "give --tls-cert and --tls-key together"),
    (["--tls-key", "CA"], "give --tls-cert and --tls-key together"),
    (["--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem: No such file or directory"),
])
@pytest.mark.parametrize("command", ["health", "workers"])
def test_client_tls_flags_that_cannot_work_are_one_line_errors(tmp_path, command, flags, message):
    """A certificate without its key aborted the process inside gRPC (exit 134); a missing file was a traceback."""
    ca = self_signed(tmp_path / "tls").ca
    argv = [command, "--target", "127.0.0.1:1", *(ca if f == "CA" else f for f in flags)]
    out = colibri_run(argv, timeout=60)
    assert out.returncode == 2, out
    assert message in out.stderr and "Traceback" not in out.stderr


def test_a_client_with_half_a_certificate_is_a_config_error(tmp_path):
    from colibri.client import Client
    from colibri_common.errors import ConfigError

    files = self_signed(tmp_path / "tls")
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key together"):
        Client("127.0.0.1:1", tls_ca=files.ca, tls_cert=files.cert)


def test_a_key_that_is_not_the_certificates_or_a_ca_that_is_not_pem_is_named(tmp_path):
    """gRPC reported both as a port it could not bind ("cannot listen on …")."""
    one, two = self_signed(tmp_path / "one"), self_signed(tmp_path / "two")
    assert TlsFiles.of(one.cert, one.key, one.ca) is not None
    with pytest.raises(ConfigError, match="is not the key of --tls-cert"):
        TlsFiles.of(one.cert, two.key, one.ca)
    junk = tmp_path / "ca.txt"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="holds no PEM certificate"):
        TlsFiles.of(one.cert, one.key, str(junk))
    with pytest.raises(ConfigError, match="not a PEM certificate and its PEM key"):
        TlsFiles.of(str(junk), one.key, one.ca)
