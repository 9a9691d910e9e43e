"""Evidence: manifests, hash-chained logs, atomic writes, run directories."""

from lla.evidence.files import atomic_write_bytes
from lla.evidence.files import canonical_json
from lla.evidence.files import sha256_file
from lla.evidence.hashlog import HashLog
from lla.evidence.hashlog import verify_log
from lla.evidence.manifest import verify_manifest
from lla.evidence.manifest import write_manifest
