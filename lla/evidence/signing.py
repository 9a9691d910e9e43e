"""Signing a run's seal with an SSH key, so that a reviewer checks it against a published key.

A run's seal hash (`rundir.anchor`) chains every log entry and so every logged file's sha256;
a run rewritten and re-chained from scratch verifies on its own, and only a reference held
elsewhere exposes it. `verify --expect=HASH` compares with a published hash; a signature
binds the hash to a key instead, so that one published public key vouches for every run its
holder seals. The signer is OpenSSH's `ssh-keygen -Y sign` (OpenSSH >= 8.1, on every Linux
and macOS machine, no root access or extra package), in the namespace `NAMESPACE`, over the
line `lla-seal <hash>`; it is checked with `ssh-keygen -Y verify` against an allowed-signers
file (ssh-keygen(1), ALLOWED SIGNERS).
"""

import shutil
import subprocess

NAMESPACE = "lla-seal"


class SigningError(ValueError):
  """ssh-keygen is missing, or refused to sign (an unreadable or passphrase-protected key)."""


def message(seal_hash: str) -> bytes:
  """The bytes that are signed: one line naming the seal."""
  return f"lla-seal {seal_hash}\n".encode()


def _ssh_keygen() -> str:
  path = shutil.which("ssh-keygen")
  if path is None:
    raise SigningError("ssh-keygen not found on PATH (OpenSSH >= 8.1 signs and verifies seals)")
  return path


def sign(seal_hash: str, key_file: str) -> bytes:
  """An SSH signature (armoured, bytes) of the seal by the private key `key_file`."""
  proc = subprocess.run([_ssh_keygen(), "-Y", "sign", "-q", "-f", key_file, "-n", NAMESPACE],
                        input=message(seal_hash), capture_output=True, check=False,
                        timeout=60)
  if proc.returncode != 0 or not proc.stdout.startswith(b"-----BEGIN SSH SIGNATURE-----"):
    detail = proc.stderr.decode(errors="replace").strip().replace("\n", " ")
    raise SigningError(f"ssh-keygen could not sign with {key_file}: {detail or 'no signature'}")
  return proc.stdout


def check(seal_hash: str, signature_file: str, signers_file: str, identity: str) -> str | None:
  """Why the signature in `signature_file` is not `identity`'s signature of the seal, as
  listed in `signers_file` (one line), or None when it is."""
  proc = subprocess.run([_ssh_keygen(), "-Y", "verify", "-f", signers_file, "-I", identity,
                         "-n", NAMESPACE, "-s", signature_file], input=message(seal_hash),
                        capture_output=True, check=False, timeout=60)
  if proc.returncode == 0:
    return None
  detail = (proc.stderr or proc.stdout).decode(errors="replace").strip().replace("\n", " ")
  return (f"{signature_file}: not a valid signature of seal {seal_hash} by {identity!r} "
          f"listed in {signers_file}: {detail}")
