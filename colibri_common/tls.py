"""TLS for the services: mutual TLS between the router and its workers, TLS (optionally mutual) between
clients and the router, and a throw-away CA for local fleets (`serve --tls-self-signed`).

A worker given `--tls-cert --tls-key --tls-ca` serves TLS only and refuses a caller without a certificate
that CA signed. The router uses the same three files both ways: its certificate is its client certificate
to the workers, the CA verifies them (and, with `--tls-client-auth`, its own clients). Certificates are PEM
files; cert-manager's `tls.crt` / `tls.key` / `ca.crt` fit as they are.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc

from colibri_common.errors import ColibriError, ConfigError

log = logging.getLogger("colibri")
SELF_SIGNED_FILES = ("ca.pem", "cert.pem", "key.pem")


@dataclass(frozen=True)
class TlsFiles:
    cert: str
    key: str
    ca: str | None = None
    directory: str | None = None     # the throw-away directory `self_signed` made (None: files the user named)

    @staticmethod
    def of(cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
        """The files named by the flags, checked; None when TLS is off."""
        if not (cert or key or ca):
            return None
        if not (cert and key):
            raise ConfigError("TLS needs both --tls-cert and --tls-key (and --tls-ca to verify the peers)")
        for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{flag} {path}: no such file")
        check_pem(cert, key, ca)
        return TlsFiles(cert, key, ca)

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        return (Path(self.cert).read_bytes(), Path(self.key).read_bytes(),
                Path(self.ca).read_bytes() if self.ca else None)

    def server(self, require_client_cert: bool) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        if require_client_cert and ca is None:
            raise ConfigError("requiring client certificates needs --tls-ca (the CA that signs them)")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=require_client_cert)

    def channel(self) -> grpc.ChannelCredentials:
        return channel_credentials(self.ca, self.cert, self.key)

    def remove(self) -> None:
        """Delete the throw-away files `self_signed` wrote and their directory (when the fleet stops); files the
        user named are never touched. Safe to call twice; what cannot be removed is a warning naming it."""
        if self.directory is None or os.path.islink(self.directory) or not os.path.isdir(self.directory):
            return
        d = Path(self.directory)
        try:
            for name in SELF_SIGNED_FILES:
                (d / name).unlink(missing_ok=True)
            d.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove the throw-away TLS directory %s (%s); delete it by hand", d, exc)


def check_pem(cert: str, key: str, ca: str | None) -> None:
    """The files gRPC would take, checked with Python's ssl first: gRPC reported a key that is not the
    certificate's, or a CA that is not PEM, as a port it could not bind. A certificate outside its validity
    period is a warning (every peer will refuse it)."""
    _check_pair(cert, key)
    if ca is not None:
        _check_ca(ca)
    try:
        from cryptography import x509

        pem = x509.load_pem_x509_certificate(Path(cert).read_bytes())
    except (ImportError, ValueError):
        return
    now = datetime.datetime.now(datetime.UTC)
    if not pem.not_valid_before_utc <= now <= pem.not_valid_after_utc:
        log.warning("--tls-cert %s is valid from %s to %s only, not now: its peers will refuse it", cert,
                    pem.not_valid_before_utc, pem.not_valid_after_utc)


def _check_pair(cert: str, key: str) -> None:
    import ssl

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")   # no TTY prompt
    except ssl.SSLError as exc:
        what = "is not the key of --tls-cert" if "MISMATCH" in str(exc).upper() else \
            "and --tls-cert are not a PEM certificate and its PEM key"
        raise ConfigError(f"--tls-key {key} {what} ({exc.reason or exc})") from None


def _check_ca(ca: str) -> None:
    import ssl

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=ca)
    except ssl.SSLError as exc:
        raise ConfigError(f"--tls-ca {ca} holds no PEM certificate ({exc.reason or exc})") from None


def channel_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    """TLS credentials of a client: the CA that verifies the server, a client certificate with its key (both or
    neither: gRPC aborted the process on one without the other). A file that cannot be read is a ConfigError."""
    if bool(cert) != bool(key):
        raise ConfigError("a client certificate needs its key: give --tls-cert and --tls-key together "
                          "(tls_cert= and tls_key= in colibri.Client)")

    def read(flag: str, path: str | None) -> bytes | None:
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{flag} {path}: {exc.strerror or exc}") from None

    creds = read("--tls-ca", ca), read("--tls-key", key), read("--tls-cert", cert)     # each readable, then PEM:
    if ca:                                       # gRPC took any bytes and failed each handshake instead
        _check_ca(ca)
    if cert and key:
        _check_pair(cert, key)
    return grpc.ssl_channel_credentials(root_certificates=creds[0], private_key=creds[1], certificate_chain=creds[2])


def client_channel(target: str, options: list, ca: str | None = None, cert: str | None = None,
                   key: str | None = None, aio: bool = False) -> grpc.Channel:
    """A plaintext channel, or TLS when a CA (and optionally a client certificate) is given; a grpc.aio
    channel when `aio`."""
    api = grpc.aio if aio else grpc
    if not (ca or cert or key):
        return api.insecure_channel(target, options=options)
    return api.secure_channel(target, channel_credentials(ca, cert, key), options=options)


def self_signed(directory: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> TlsFiles:
    """A new CA and one certificate it signs (for `hosts`, usable by servers and clients alike), written as
    ca.pem, cert.pem, key.pem in `directory` (created with mode 0700, the files 0600; `TlsFiles.remove` deletes
    them). A directory that cannot be written is a ColibriError naming it, the files begun there removed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "colibri throw-away CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "colibri")])).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    pems = {"ca.pem": ca.public_bytes(pem), "cert.pem": cert.public_bytes(pem),
            "key.pem": key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())}
    files = TlsFiles(str(directory / "cert.pem"), str(directory / "key.pem"), str(directory / "ca.pem"),
                     directory=str(directory))
    try:
        _private_dir(directory)
        for name, data in pems.items():
            _write_private(directory / name, data)
    except OSError as exc:
        files.remove()
        raise ColibriError(f"cannot write the throw-away TLS files to {directory} ({exc.strerror or exc}); set "
                           f"COLIBRI_CACHE_DIR to a writable directory") from exc
    return files


def _private_dir(directory: Path) -> None:
    """`directory`, created if need be, a real directory of this user with mode 0700 (an existing one that
    another user owns, or a link, is refused: it could hand the private key to someone else)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ColibriError(f"{directory} exists and is not a directory of this user; remove it, or set "
                           f"COLIBRI_CACHE_DIR to a directory of your own")
    os.chmod(directory, 0o700)


def _write_private(path: Path, data: bytes) -> None:
    """`data` into `path`, readable by its owner only from the first byte (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
