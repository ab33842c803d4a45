"""Certificates and keys for the local control plane, as envtest and kubeadm lay them out.

One self-signed CA signs the kube-apiserver's serving certificate and a client certificate
per identity (the admin in ``system:masters``; the scheduler and controller manager as the
users their bootstrap RBAC roles name). A separate RSA key pair signs service-account tokens.

Kueue's webhooks get their own RSA CA and serving certificate (`ensure_kueue_pki`), shaped the
way Kueue's certificate rotator checks them, so it keeps them instead of minting its own.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=365)
#: Kueue's rotator (open-policy-agent cert-controller) replaces certificates that expire within
#: 90 days; ours are renewed before that, so the rotator never has to.
KUEUE_RENEW_BEFORE = datetime.timedelta(days=120)
KUEUE_NAMESPACE = "kueue-system"
#: Kueue derives these from its configuration's defaults (`<webhookServiceName>.<namespace>.svc`
#: and the CA name `kueue-ca`); the rotator verifies the certificates against them.
KUEUE_SERVICE_DNS = f"kueue-webhook-service.{KUEUE_NAMESPACE}.svc"
KUEUE_CA_NAME = "kueue-ca"
#: The files Kueue's Secret holds (and `ensure_kueue_pki` writes).
KUEUE_FILES = ("ca.crt", "ca.key", "tls.crt", "tls.key")

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


@dataclass(frozen=True)
class Identity:
    """A client identity: its file stem, user name (CN) and groups (O)."""

    stem: str
    user: str
    groups: tuple[str, ...] = ()


ADMIN = Identity("admin", "rlhf-admin", ("system:masters",))
SCHEDULER = Identity("kube-scheduler", "system:kube-scheduler")
CONTROLLER_MANAGER = Identity("kube-controller-manager", "system:kube-controller-manager")
CLIENTS = (ADMIN, SCHEDULER, CONTROLLER_MANAGER)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _pem_rsa_pkcs1(key: rsa.RSAPrivateKey) -> bytes:
    """``RSA PRIVATE KEY`` (PKCS#1): the only key format Kueue's rotator parses."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


def _cert(
    subject: x509.Name,
    key: PrivateKey,
    issuer: x509.Name,
    issuer_key: PrivateKey,
    *,
    ca: bool = False,
    server_names: tuple[str, ...] = (),
    server_ips: tuple[str, ...] = (),
    client: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [ExtendedKeyUsageOID.SERVER_AUTH]
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if server_names or server_ips:
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def ensure_pki(pki: Path, service_ip: str) -> None:
    """Create the CA, serving, client and service-account keys in `pki` unless present.

    `service_ip` is the first address of the service CIDR: in-cluster clients reach the
    API server as that IP, so it goes into the serving certificate.
    """
    if (pki / "ca.crt").exists():
        return
    pki.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlhf-local-ca")])
    ca = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)

    server_key = _key()
    server = _cert(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]),
        server_key,
        ca_name,
        ca_key,
        server_names=(
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ),
        server_ips=("127.0.0.1", service_ip),
    )
    _write(pki / "apiserver.key", _pem_key(server_key))
    _write(pki / "apiserver.crt", _pem_cert(server))

    for ident in CLIENTS:
        key = _key()
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in ident.groups]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, ident.user))
        cert = _cert(x509.Name(attrs), key, ca_name, ca_key, client=True)
        _write(pki / f"{ident.stem}.key", _pem_key(key))
        _write(pki / f"{ident.stem}.crt", _pem_cert(cert))

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write(pki / "sa.key", _pem_key(sa_key))
    _write(
        pki / "sa.pub",
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    )
    _write(pki / "ca.key", _pem_key(ca_key))
    # Written last: its presence marks the directory complete.
    _write(pki / "ca.crt", _pem_cert(ca))


def _kueue_pki_valid(pki: Path) -> bool:
    """All four files exist and the serving certificate outlives `KUEUE_RENEW_BEFORE`."""
    if not all((pki / name).exists() for name in KUEUE_FILES):
        return False
    cert = x509.load_pem_x509_certificate((pki / "tls.crt").read_bytes())
    return cert.not_valid_after_utc > datetime.datetime.now(datetime.UTC) + KUEUE_RENEW_BEFORE


def ensure_kueue_pki(pki: Path) -> bool:
    """Kueue's webhook CA and serving certificate in `pki`; True when they were (re)made.

    What Kueue's rotator accepts, so that it keeps them: RSA keys in PKCS#1 PEM, a CA with the
    DNS SAN ``kueue-ca``, and a serving certificate (serverAuth) for the webhook Service's DNS
    name, valid beyond 90 days. It also names 127.0.0.1, the address the API server calls the
    webhooks at. Remade when missing or within `KUEUE_RENEW_BEFORE` of expiring.
    """
    if _kueue_pki_valid(pki):
        return False
    pki.mkdir(parents=True, exist_ok=True)
    (pki / "tls.crt").unlink(missing_ok=True)  # an interrupted run leaves no stale pair
    ca_key = _rsa_key()
    ca_name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kueue"),
            x509.NameAttribute(NameOID.COMMON_NAME, KUEUE_CA_NAME),
        ]
    )
    ca = _cert(ca_name, ca_key, ca_name, ca_key, ca=True, server_names=(KUEUE_CA_NAME,))
    key = _rsa_key()
    serving = _cert(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, KUEUE_SERVICE_DNS)]),
        key,
        ca_name,
        ca_key,
        server_names=(KUEUE_SERVICE_DNS,),
        server_ips=("127.0.0.1",),
    )
    _write(pki / "ca.key", _pem_rsa_pkcs1(ca_key))
    _write(pki / "ca.crt", _pem_cert(ca))
    _write(pki / "tls.key", _pem_rsa_pkcs1(key))
    # Written last: its presence (and validity) marks the directory complete.
    _write(pki / "tls.crt", _pem_cert(serving))
    return True
