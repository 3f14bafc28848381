"""The shortest path a user takes: mount, write, read, df, umount."""

from __future__ import annotations

import hashlib
import os

from tests.conftest import Mounted


def test_write_read_df(mnt: Mounted) -> None:
    data = os.urandom(3 << 20)
    (mnt / "f").write_bytes(data)
    assert hashlib.sha256((mnt / "f").read_bytes()).digest() == hashlib.sha256(data).digest()
    st = os.statvfs(mnt.path)
    assert st.f_blocks * st.f_frsize == 512 << 20
    assert (st.f_blocks - st.f_bfree) * st.f_frsize >= 3 << 20
