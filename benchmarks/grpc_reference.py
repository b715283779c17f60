"""The practical limit of this machine for the message path: the same bytes through gRPC with TLS
on loopback, no Flower.

A server process and a client process (grpcio, TLS with a fresh self-signed certificate, one
channel). Each of ``count`` calls sends one message of ``size`` bytes and gets one of the same size
back (one unary RPC: one HTTP/2 stream each way), as a round sends each client its model and
receives one back: ``2 x count x size`` bytes. Prints (or returns) the seconds and MB/s, best of
``repeat``. Measured here while designing it (2026-12-04, the 2-core machine): one 85 MB message
one way 0.21-0.26 s (320-410 MB/s); a client-streamed RPC of 1-4 MiB messages was far slower
(16-73 MB/s), so the reference uses one message per model.

    python benchmarks/grpc_reference.py --size 96886400 --count 8
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc

METHOD = "/celgc.reference.Echo/Call"
#: a message may be this large (gRPC's default is 4 MiB)
MAX_MESSAGE = 2**31 - 1
OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]


def _same(x: bytes) -> bytes:
    return x


def certificate(folder: Path) -> tuple[bytes, bytes]:
    """A self-signed certificate for 127.0.0.1 (key PEM, certificate PEM), written to ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (folder / "key.pem").write_bytes(key_pem)
    (folder / "cert.pem").write_bytes(cert_pem)
    return key_pem, cert_pem


def serve(folder: Path) -> None:
    """The server: echo each message with one of the same size; prints its port, runs until killed."""
    key, cert = (folder / "key.pem").read_bytes(), (folder / "cert.pem").read_bytes()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=OPTIONS)
    handler = grpc.unary_unary_rpc_method_handler(lambda request, _: bytes(len(request)),
                                                  request_deserializer=_same, response_serializer=_same)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("celgc.reference.Echo",
                                                                          {"Call": handler})])
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def measure(size: int, count: int, repeat: int = 3) -> dict[str, float]:
    """Best of ``repeat``: seconds to send ``count`` messages of ``size`` bytes and receive as many."""
    with tempfile.TemporaryDirectory(prefix="grpc-reference-") as tmp:
        folder = Path(tmp)
        _, cert = certificate(folder)
        proc = subprocess.Popen([sys.executable, __file__, "--serve", str(folder)], stdout=subprocess.PIPE, text=True)
        try:
            port = int(proc.stdout.readline())
            channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(cert), options=OPTIONS)
            call = channel.unary_unary(METHOD, request_serializer=_same, response_deserializer=_same)
            call(b"warm-up", timeout=60)
            payload = os.urandom(size)
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                for _ in range(count):
                    if len(call(payload, timeout=600)) != size:
                        raise RuntimeError("the reference server answered a message of another size")
                best = min(best, time.perf_counter() - t0)
            channel.close()
        finally:
            proc.kill()
            proc.wait(10)
    moved = 2 * size * count
    return {"seconds": best, "bytes": moved, "MB/s": moved / best / 1e6, "pid": proc.pid}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=85_012_520, help="bytes of one message (a model)")
    p.add_argument("--count", type=int, default=2, help="messages each way (clients of a round)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(Path(args.serve))
        return
    if args.size < 1 or args.count < 1 or args.repeat < 1:
        p.error("--size, --count and --repeat must be >= 1")
    r = measure(args.size, args.count, args.repeat)
    print(f"gRPC + TLS on loopback: {args.count} x {args.size / 1e6:.1f} MB each way in {r['seconds']:.3f} s: "
          f"{r['MB/s']:.0f} MB/s")


if __name__ == "__main__":
    main()
