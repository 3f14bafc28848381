"""memfs: a userspace FUSE filesystem over pooled memory volumes."""

__version__ = "0.1.0"
