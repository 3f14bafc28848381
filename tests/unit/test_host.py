"""memfs.host: malloc tuning for the mount daemon's megabyte request buffers."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Three 1 MiB buffers alive at once, then freed, as concurrent FUSE writes or remote
# reads leave them; counts the page faults of 200 such rounds in a fresh interpreter.
_ROUNDS = textwrap.dedent("""
    import resource, sys
    from memfs.host import tune_malloc
    if sys.argv[1] == "tuned":
        assert tune_malloc()
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = bytearray(1 << 20); del a
    start = faults()
    for _ in range(200):
        a, b, c = bytearray(1 << 20), bytearray(1 << 20), bytearray(1 << 20)
        del a, b, c
    print(faults() - start)
""")


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode], check=True, capture_output=True, text=True
    ).stdout
    return int(out)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tuned_malloc_reuses_request_buffers() -> None:
    """Untuned glibc gives the freed megabytes back and faults them in again each round
    (about 600 faults a round); tuned, the heap keeps them."""
    assert _faults("plain") > 200 * 256
    assert _faults("tuned") < 2000
