"""The client side of TLS: one way to build the ``ssl.SSLContext`` a client trusts a
``tls://`` broker with, from files or from the environment.

The command line (``--tls-ca``/``--tls-cert``/``--tls-key``) and :func:`msgq_trio.connect`
(when no ``ssl_context`` is given) build theirs here, so a program started with
``MSGQ_TRIO_SOCKET=tls://...`` and ``MSGQ_TRIO_TLS_CA`` connects the way ``msgq-trio``
does, e.g. a user program under the fault runner.
"""

from __future__ import annotations

import os
import ssl

from ..errors import UsageError


def client_context(
    ca: str | None,
    cert: str | None = None,
    key: str | None = None,
    *,
    names: tuple[str, str] = ("TLS CA bundle", "TLS client certificate"),
) -> ssl.SSLContext:
    """A context that trusts ``ca`` (a PEM bundle; None: the system's trust store) and
    presents ``cert``/``key`` (a client certificate; ``key`` None: in ``cert``).
    ``names`` say where the two came from, for the error (``--tls-ca``, ...).

    Raises:
        UsageError: a file cannot be read or is not what it should be (names it).
    """
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"{names[0]} {ca}: cannot load the CA bundle: {exc}") from None
    if cert:
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise UsageError(
                f"{names[1]} {cert}: cannot load the certificate and key: {exc}"
            ) from None
    return ctx


def client_context_from_env() -> ssl.SSLContext:
    """:func:`client_context` of ``$MSGQ_TRIO_TLS_CA``, ``$MSGQ_TRIO_TLS_CERT`` and
    ``$MSGQ_TRIO_TLS_KEY`` (each optional).

    Raises:
        UsageError: as :func:`client_context`.
    """
    env = os.environ.get
    return client_context(
        env("MSGQ_TRIO_TLS_CA") or None,
        env("MSGQ_TRIO_TLS_CERT") or None,
        env("MSGQ_TRIO_TLS_KEY") or None,
        names=("$MSGQ_TRIO_TLS_CA", "$MSGQ_TRIO_TLS_CERT"),
    )
