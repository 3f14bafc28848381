# memfs: the two commands a new user needs are `make mount` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
MNT    ?= /mnt/memfs
SIZE   ?= 4G
# more `memfs mount` arguments, e.g. MOUNT_ARGS="-o passthrough"
MOUNT_ARGS ?=
# pytest processes (pytest-xdist).  The suite mostly waits (servers starting,
# deadlines, recalls), so 2 run it in about half the time of 1, on 2 CPUs too.
TEST_WORKERS ?= 2
MEMFS   = $(VENV)/bin/memfs

.PHONY: install mount umount test lint bench bench-fs bench-tcp bench-bb bench-cluster bench-shared bench-mds bench-memd bench-journal bench-array clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup-debian.sh scripts/link-pyverbs.sh \
		scripts/build-pyfuse3.sh scripts/pyfuse3/0001-init-connection.patch \
		scripts/pyfuse3/0002-receive-before-waiting.patch \
		scripts/pyfuse3/0003-extra-init-flags.patch \
		scripts/pyfuse3/0004-fallocate.patch \
		scripts/pyfuse3/0005-locks.patch \
		scripts/pyfuse3/0006-reply-threads.patch \
		scripts/pyfuse3/0007-passthrough.patch
	./scripts/setup-debian.sh
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	./scripts/build-pyfuse3.sh $(VENV)
	$(VENV)/bin/pip install -q -e '.[test]'
	./scripts/link-pyverbs.sh $(VENV)
	touch $@

mount: install
	@mkdir -p $(MNT)
	$(MEMFS) mount $(MNT) --size $(SIZE) $(MOUNT_ARGS)
	@echo "memfs is mounted at $(MNT)"
	@head -c 64M /dev/urandom > /tmp/memfs-demo.$$$$ && \
	  cp /tmp/memfs-demo.$$$$ $(MNT)/demo.bin && \
	  sha256sum /tmp/memfs-demo.$$$$ $(MNT)/demo.bin && \
	  cmp /tmp/memfs-demo.$$$$ $(MNT)/demo.bin && echo "demo.bin: 64 MiB written and read back identical" && \
	  rm -f /tmp/memfs-demo.$$$$
	@ls -l $(MNT)
	@df -h $(MNT)
	@echo "unmount with: make umount MNT=$(MNT)   (or: umount $(MNT))"

umount:
	$(MEMFS) umount $(MNT)

test: install
	$(VENV)/bin/ruff check memfs tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -ra -n $(TEST_WORKERS) --dist worksteal

lint: install
	$(VENV)/bin/ruff check memfs tests bench
	$(VENV)/bin/mypy

# memfs vs tmpfs (fio, metadata), then the tcp data path vs raw loopback sockets, then the
# burst buffer: writing into memfs --backing DIR vs into DIR (a disk directory) directly,
# then cluster mode (memd + mds + client on loopback) vs embedded, then the mds under load,
# then memfs.array (direct numpy save/load) vs numpy and h5py.
bench: bench-fs bench-tcp bench-bb bench-cluster bench-shared bench-mds bench-journal bench-array

# memfs vs tmpfs vs bindfs (Debian's, a compiled FUSE filesystem); draws docs/bench-fs.png
bench-fs: install
	@command -v bindfs >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bindfs >/dev/null)
	@$(VENV)/bin/python -c "import matplotlib" 2>/dev/null || $(VENV)/bin/pip install -q matplotlib
	$(VENV)/bin/python bench/fsbench.py --chart docs/bench-fs.png $(BENCH_ARGS)

bench-tcp: install
	$(VENV)/bin/python bench/tcpbench.py $(TCP_BENCH_ARGS)

# BB_BENCH_ARGS="--throttle 200M,2000": DIR on an emulated slow disk (loop + cgroup v1 blkio
# throttle; the header says which writes it limits).
bench-bb: install
	$(VENV)/bin/python bench/bbbench.py $(BB_BENCH_ARGS)

# CLUSTER_BENCH_ARGS="--code ../other-checkout": run another checkout's memfs (a baseline).
bench-cluster: install
	$(VENV)/bin/python bench/clusterbench.py $(CLUSTER_BENCH_ARGS)

# one shared file vs a file per process, written from 2 client mounts (IOR's two layouts);
# SHARED_BENCH_ARGS="--xfer 1M --rounds 5" varies it.
bench-shared: install
	$(VENV)/bin/python bench/sharedbench.py $(SHARED_BENCH_ARGS)

# one memd under P processes x C connections of 16 KiB READs: reads/s, memd CPU per read;
# MEMD_BENCH_ARGS="--code ../other-checkout" measures another checkout's memd.
bench-memd: install
	$(VENV)/bin/python bench/memdbench.py $(MEMD_BENCH_ARGS)

# MDS_BENCH_ARGS="--profile /tmp/mds.txt": also py-spy the mds ($(VENV)/bin/pip install py-spy).
bench-mds: install
	$(VENV)/bin/python bench/mdsbench.py $(MDS_BENCH_ARGS)

# creates from 4 clients on an mds with --journal vs without (group commit; goal 0.7)
bench-journal: install
	$(VENV)/bin/python bench/mdsbench.py --mode create --journal-compare $(JOURNAL_BENCH_ARGS)

# memfs.array vs numpy through the mount, numpy and h5py on tmpfs, and (cluster) raw
# loopback TCP; ARRAY_BENCH_ARGS="--size 256M --rounds 5 --only embedded" varies it.
bench-array: install
	@$(VENV)/bin/python -c "import h5py" 2>/dev/null || $(VENV)/bin/pip install -q h5py
	$(VENV)/bin/python bench/arraybench.py $(ARRAY_BENCH_ARGS)

clean:
	rm -rf $(VENV) *.egg-info
