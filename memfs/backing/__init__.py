"""memfs as a burst buffer: write-behind to a backing directory, stage-in, eviction.

The parts (each module's docstring says why it is its own):

* :mod:`.dirside`    every syscall on the backing directory DIR: identity, temporary
                     copies, publish, namespace operations;
* :mod:`.tracker`    which files are dirty, at which version, with which chunks;
                     the dirty cap's counter;
* :mod:`.mirror`     the ordered queue of namespace operations (:class:`.mirror.NsKind`)
                     and the task that applies them to DIR;
* :mod:`.residency`  what is in the pool: fetch from DIR, eviction, room for writes;
* :mod:`.writeback`  the scheduler and workers that copy versions to DIR and publish;
* :mod:`.tickets`    ``memfs flush`` / ``memfs stage-in`` requests and their progress;
* :mod:`.status`     the typed status shared by the daemon, the CLI and the metrics;
* :mod:`.meta`       :class:`.meta.BackedMeta`, the :class:`memfs.meta.Meta` facade
                     that wires them together and is the store's watcher.

Nothing is imported here: the CLI reads :mod:`.status` without trio.
"""
