"""Leases: which client sessions may cache what, and recalling that before a change.

The metadata server registers a session as a *holder* of every inode whose
state it sends that session (attributes, a directory's entries, a file's chunk
map).  A holder may serve that state from its caches (its own and its kernel's)
for as long as its lease is valid.  Before the server applies a change, it
*recalls* the affected inodes from every other holder: a RECALL frame over the
holder's metadata connection, answered by RECALLED once the holder has dropped
what it cached (its kernel's too) and finished the data transfers that used the
old chunk map.  Only then is the change applied and its caller answered, so a
change is visible on every node when the call that made it returns.

Kinds of holding (CephFS capabilities and Lustre LDLM locks in miniature):

* **read** (every holder): attributes, entries (also negative lookups: a
  directory's holders hear of every name added or removed in it), chunk map.
  A recall notifies: the holder drops the named state and stays a holder, so it
  hears of later changes too (a directory's kernel dentries outlive any one
  lookup).  ``touched`` says whether a holder has fetched state since its last
  recall; untouched holders of a regular file have nothing cached and are not
  asked again; untouched holders of a directory keep only the names the recall
  did not name (``ClientCache.drop_names``), and hear of every later change of
  a name there.
* **write** (at most one session per file, and only while no other session has
  fetched the file's state): it may write the chunks it holds without asking,
  and keeps the file's size and mtime itself, sending them now and then
  (``settle``); it also sets the file's mode, owner and times itself (no set-ID
  bits), and sends each ``setattr_at`` without waiting, before its next call and
  before any answer to a recall.  Any other session's call that reads or changes the file first
  revokes the write lease: the holder answers with its exact size and mtime,
  which are applied before that call runs.  Unused preallocated chunks (past
  EOF) are freed when a write lease ends.
* **create** (a write lease on a directory; at most one session, and only while
  no other session holds the directory at all): it may create regular files in
  it without waiting for the server (CephFS's asynchronous creates).  It names
  the new inode itself, from numbers reserved for it (``reserve_inos``), and
  sends ``create_at`` calls (in ``made`` calls) that it does not wait for; any other session's call
  that reads or changes the directory (a lookup or listing in it, its
  attributes, a change of its entries) first revokes the lease, and the holder
  answers only once every create it made has been answered, so that call sees
  them all.  A holder that does not answer is evicted as usual; it sends its
  unanswered creates again when it registers (in order, before anything else).

Time bounds (``term`` and ``recall_timeout``): a client trusts its caches only
until ``term`` seconds after it *sent* the last request the server answered;
the server counts from when it *received* the session's last frame, which is
later.  A holder that does not answer a recall within ``recall_timeout`` is
evicted (its connection closed, all its holdings dropped) and the change waits
until that holder's own lease has surely run out (``last_heard + term``), then
goes ahead.  A holder with no connection is treated the same way.  So no change
ever waits longer than ``recall_timeout + term`` for a client, and an evicted
or partitioned client has stopped trusting its caches by the time the change
is applied.

* **writing** (marks, no right): a session that was sent where to write a
  file's data without a write lease moves its bytes after that answer (its
  client may have answered the write(2) already: posted); until it answers a
  recall of the file (once its transfers landed) or closes it, another
  session's chunk-map read, and the first round of any change's recalls
  (also while a recall of it is under way), recall it first (:meth:`wrote`).

Everything here runs in the server's trio loop; methods that do not await are
atomic.  The wait for acknowledgements is the only await: while an inode is
being recalled, state about it that is sent out is marked not cacheable
(:meth:`register` returns False); a receiver of a chunk map (or of a
truncate's tail to zero) then is recalled again before the change is applied
(it may be using the old map for one transfer), a receiver of anything else
holds nothing and is not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from memfs.meta.contention import Contention, Span, overlap
from memfs.wire import WireError

log = logging.getLogger(__name__)

#: how long a client trusts its caches after the request of its last answered call
LEASE_TERM = 4.0
#: how long a holder has to answer a recall before it is evicted
RECALL_TIMEOUT = 2.0


@dataclass(frozen=True, slots=True)
class Item:
    """One inode a change conflicts with."""

    ino: int
    #: entries of directory *ino* that are added, removed or replaced (b"..": a moved
    #: directory's parent; b".": the directory itself goes, its holders forget it)
    names: tuple[bytes, ...] = ()
    #: a directory: every holder hears of it (its kernel may hold dentries under it)
    directory: bool = False
    #: only a write lease conflicts (a read by another session: a "glimpse")
    write_only: bool = False
    #: the bytes a read or write of a contended file touches (memfs.meta.contention):
    #: receivers of maps elsewhere in the file are not recalled; None: the whole file
    span: Span | None = None

    def to_wire(self, revoke: bool) -> list[Any]:
        return [self.ino, list(self.names), revoke]


def items_from_wire(v: Any) -> list[tuple[int, list[bytes], bool]]:
    """Decode a RECALL payload: ``[[ino, [name, ...], revoke_write], ...]``."""
    if type(v) is not list:
        raise WireError("recall: expected a list")
    out = []
    for x in v:
        if type(x) is not list or len(x) != 3:
            raise WireError("recall item: expected [ino, names, revoke]")
        ino, names, revoke = x
        if type(ino) is not int or type(names) is not list or type(revoke) is not bool:
            raise WireError("recall item: bad types")
        if not all(type(n) is bytes for n in names):
            raise WireError("recall item: names must be bytes")
        out.append((ino, names, revoke))
    return out


#: a report's span of written bytes: not said (written anywhere)
ANYWHERE = (-1, -1)

Settle = tuple[int, int, int, tuple[int, int]]


def settles_from_wire(v: Any) -> list[Settle]:
    """Decode the sizes of a RECALLED payload or a registration: ``[[ino, size,
    mtime_ns(, lo, hi)], ...]`` of write leases (``[lo, hi)``: the bytes written under
    the lease; without it, anywhere)."""
    if type(v) is not list:
        raise WireError("recalled: expected a list")
    out = []
    for x in v:
        if type(x) is not list or len(x) not in (3, 5) or not all(type(n) is int for n in x):
            raise WireError("recalled item: expected [ino, size, mtime_ns, lo, hi]")
        if x[1] < 0:
            raise WireError("recalled item: negative size")
        out.append((x[0], x[1], x[2], (x[3], x[4]) if len(x) == 5 else ANYWHERE))
    return out


class Holder(Protocol):
    """A client session as the lease table sees it (``memfs.meta.server_conn.Session``)."""

    #: server time (trio clock) the session's last frame arrived
    last_heard: float
    #: times it has (re-)registered: an eviction's forget is for the registration
    #: that did not answer, not for a later one
    registrations: int

    def send_recall(self, rid: int, payload: list[Any]) -> bool:
        """Queue a RECALL frame behind the session's earlier replies; False if it has
        no connection."""

    def evict(self, reason: str) -> None:
        """Close the session's connection (it did not answer a recall)."""


@dataclass(eq=False)
class _Waiting:
    holder: Holder
    done: trio.Event = field(default_factory=trio.Event)


class LeaseTable:
    """Holders and write leases per inode; see the module docstring."""

    def __init__(
        self, *, term: float = LEASE_TERM, recall_timeout: float = RECALL_TIMEOUT,
        settle: Callable[[int, int | None, int, tuple[int, int]], None] | None = None,
        lost: Callable[[Holder, int], None] | None = None,
        unsaid: Callable[[Holder], None] | None = None,
    ) -> None:
        self.term = term
        self.recall_timeout = recall_timeout
        #: apply a revoked write lease's last size and mtime (None: unknown), mark what
        #: it wrote, free its unused preallocation: ``settle(ino, size, mtime_ns, span)``
        self.settle = settle
        #: a write lease of a holder ended without its word: ``lost(holder, ino)``
        #: (called before ``settle(ino, None, 0)`` frees what it took ahead)
        self.lost = lost
        #: what a holder held is being taken without its word (evicted, cut off,
        #: gone): ``unsaid(holder)``, at the eviction and again (a no-op then, unless
        #: it registered meanwhile) before anything it held is freed
        self.unsaid = unsaid
        #: ino -> holder -> touched (fetched state since its last recall)
        self.holders: dict[int, dict[Holder, bool]] = {}
        self.writers: dict[int, Holder] = {}
        self._inos_of: dict[Holder, set[int]] = {}
        self._recalling: dict[int, int] = {}
        #: ino -> sessions that changed its data through the server (no write lease:
        #: a burst-buffer mds, or a file another session reads) and may still be moving
        #: the bytes: another session's chunk-map read recalls them first, and they
        #: answer once those transfers landed (a "glimpse" of a writer without a lease)
        #: (with the mark's number: an answer clears only marks it was asked about)
        self.writing: dict[int, dict[Holder, int]] = {}
        #: ino -> sessions sent where to write without a write lease, with the mark of
        #: the last such answer, until they confirm those bytes landed (a recall's
        #: answer, their close): the write-back waits for them (``writes_landed``)
        self.placed: dict[int, dict[Holder, int]] = {}
        #: ino -> the number of the last mark (a read that waited compares)
        self.wrote_seq: dict[int, int] = {}
        self._marks = 0
        self._marked_of: dict[Holder, set[int]] = {}
        #: ino -> the session whose change of it is under way, and how many
        #: (memfs.meta.gates: a change that may wait after its recall)
        self._changing: dict[int, tuple[Holder, int]] = {}
        self._waiting: dict[int, _Waiting] = {}
        self._next_rid = 1
        #: files written from several sessions at once, and the ranges of maps sent of them
        self.contention = Contention()
        #: counters for status and tests
        self.recalls_sent = 0
        self.evictions = 0

    # -- granting ------------------------------------------------------------------------

    def register(self, holder: Holder, inos: Iterable[int], *, transfer: bool = False,
                 span: Span | None = None) -> bool:
        """*holder* is being sent the state of *inos*; True if it may cache it.

        While an inode is being recalled, what is sent of it is not cacheable, and
        the receiver holds nothing after it (its kernel gets no time to cache it
        either) unless it names chunks the receiver transfers to (*transfer*: a
        chunk map, a truncate's tail to zero): the change must wait for that
        transfer, so its receiver is asked again.
        (Marking every receiver touched let a client that stats a file in a loop
        hold off another's chmod of it for as long as the loop ran: each recall
        made its next stat a call, which asked for another recall.)  Of a contended
        file nothing is cacheable, and a transfer's receiver is marked for its
        *span* only (memfs.meta.contention).
        """
        cacheable = True
        recalling = self._recalling
        changing = self._changing
        contention = self.contention
        for ino in inos:
            hs = self.holders.get(ino)
            if hs is None:
                hs = self.holders[ino] = {}
            if holder not in hs:
                mine = self._inos_of.get(holder)
                if mine is None:
                    mine = self._inos_of[holder] = set()
                mine.add(ino)
            if contention.contended(ino):
                cacheable = False
                hs[holder] = hs.get(holder, False)
                if transfer:
                    # Marked writing with no ranges: a recall under way took them, and
                    # its bytes there may still fly: the whole file until it answers.
                    told = (holder in self.writing.get(ino, ())
                            and holder not in contention.spans.get(ino, ()))
                    contention.sent(holder, ino, None if told else span)
                continue
            if transfer and any(h is not holder for h in self.writing.get(ino, ())):
                # Another session's bytes may be on their way (its reads were not
                # recalled where the call's conflicts were limited to its range, the
                # file contended then): a map is used once, never cached or widened.
                cacheable = False
            w = self.writers.get(ino)
            if (ino in recalling or (ino in changing and changing[ino][0] is not holder)
                    or (w is not None and w is not holder)):
                # (Another session's write lease: it changes the file without asking,
                # so nothing would recall this.  Its callers revoke it first; a call
                # that waited after that may find it granted again meanwhile.)
                cacheable = False
                hs[holder] = transfer or hs.get(holder, False)
            else:
                hs[holder] = True
        return cacheable

    def begin_change(self, holder: Holder, ino: int) -> None:
        """*holder*'s change of *ino* is under way and may wait before it is applied:
        until :meth:`end_change`, what other sessions are sent of *ino* is not cacheable
        (they would keep the state from before the change)."""
        h, n = self._changing.get(ino, (holder, 0))
        assert h is holder, "one session's change at a time (memfs.meta.gates)"
        self._changing[ino] = (holder, n + 1)

    def end_change(self, holder: Holder, ino: int) -> None:
        h, n = self._changing[ino]
        if n > 1:
            self._changing[ino] = (h, n - 1)
        else:
            del self._changing[ino]

    def grant_write(self, holder: Holder, ino: int) -> bool:
        """Make *holder* the writer of *ino* if no other session has its state (and
        the file is not contended)."""
        if ino in self._recalling or self.contention.contended(ino):
            return False
        w = self.writers.get(ino)
        if w is not None:
            return w is holder
        for h, touched in self.holders.get(ino, {}).items():
            if touched and h is not holder:
                return False
        if any(h is not holder for h in self.contention.spans.get(ino, ())):
            return False  # (pages of it elsewhere: the next change recalls them first)
        self.writers[ino] = holder
        return True

    def grant_directory(self, holder: Holder, ino: int) -> bool:
        """Make *holder* the creator of directory *ino* (a create lease) if no other
        session holds anything of it, touched or not (their kernels may hold names)."""
        if ino in self._recalling:
            return False
        w = self.writers.get(ino)
        if w is not None:
            return w is holder
        if any(h is not holder for h in self.holders.get(ino, ())):
            return False
        self.writers[ino] = holder
        return True

    def is_writer(self, holder: Holder, ino: int) -> bool:
        return self.writers.get(ino) is holder

    def release_write(self, holder: Holder, ino: int) -> bool:
        """*holder* gives its write lease back (it settled); False if it had none."""
        if self.writers.get(ino) is holder:
            del self.writers[ino]
            return True
        return False

    def wrote(self, holder: Holder, ino: int, *, placed: bool = False) -> None:
        """*holder* was sent (*placed*), or is about to be, where to write *ino*'s data
        without a write lease: until it answers a recall of *ino* (or closes it), its
        bytes may still be on their way, and what another session reads meanwhile
        would be old, cached for good."""
        self._marks += 1
        self.writing.setdefault(ino, {})[holder] = self.wrote_seq[ino] = self._marks
        self._marked_of.setdefault(holder, set()).add(ino)
        if placed:
            self.placed.setdefault(ino, {})[holder] = self._marks

    def unconfirmed(self, ino: int) -> bool:
        """May bytes of writes placed in *ino* still be on their way?  A session sent
        where to write without a write lease has not confirmed them yet.  (A write
        lease's holder reports what it wrote, the write placed by the call that
        granted the lease included, only once those bytes have landed, and its
        report makes the file dirty again.)"""
        return bool(self.placed.get(ino))

    def done_writing(self, holder: Holder, ino: int, mark: int | None = None) -> None:
        """*holder*'s writes of *ino* have all landed (its last close of it), or those
        made until its mark *mark* (it answered a recall sent then)."""
        ps = self.placed.get(ino)
        if ps is not None and holder in ps and (mark is None or ps[holder] <= mark):
            del ps[holder]
            if not ps:
                del self.placed[ino]
        ws = self.writing.get(ino)
        if ws is not None and holder in ws and (mark is None or ws[holder] == mark):
            del ws[holder]
            if not ws:
                del self.writing[ino]
                self.wrote_seq.pop(ino, None)
            mine = self._marked_of[holder]
            mine.discard(ino)
            if not mine:
                del self._marked_of[holder]

    def others_writing(self, holder: Holder | None, ino: int) -> bool:
        return any(h is not holder for h in self.writing.get(ino, ()))

    # -- recalling ------------------------------------------------------------------------

    def needs_recall(self, holder: Holder | None, items: Iterable[Item], *, first: bool = True) -> bool:
        """Would :meth:`recall` have anything to do (no await needed otherwise)?

        *first* False: after a recall of these items, only holders that fetched state
        since (or a writer) still need one; directories' other holders have heard.
        Reads :attr:`writers`, :attr:`holders`, :attr:`writing` and the ranges of
        contended files only: the server's ``may_wait`` takes the first three
        empty for "nothing to recall" (state read here must be added there; a
        session with ranges of a file is always among its holders).
        """
        spans = self.contention.spans
        for it in items:
            w = self.writers.get(it.ino)
            if w is not None and w is not holder:
                return True
            sent = spans.get(it.ino)
            if it.write_only:
                if any(h is not holder and _writing_in(h, it, sent)
                       for h in self.writing.get(it.ino, ())):
                    return True
                continue
            for h, touched in self.holders.get(it.ino, {}).items():
                if h is not holder and (touched or (first and it.directory)):
                    return True
            if sent is not None and any(h is not holder and overlap(s, it.span)
                                        for h, s in sent.items()):
                return True
            # A session whose bytes may be on their way (a recall of it under way
            # already marked it told): recall()'s first round asks it too.
            if first and any(h is not holder and _writing_in(h, it, sent)
                             for h in self.writing.get(it.ino, ())):
                return True
        return False

    async def recall(self, holder: Holder | None, items: list[Item], *, once: bool = False) -> None:
        """Take back what sessions other than *holder* hold of *items* (see module doc).

        *holder* None: a change made by the server itself (eviction, stage-in).
        *once*: only from those holding them now, not again from those that fetch
        them meanwhile (the caller made what they fetch harmless first).
        """
        inos = {it.ino for it in items}
        for ino in inos:
            self._recalling[ino] = self._recalling.get(ino, 0) + 1
        try:
            first = True
            while True:
                if once and not first:
                    return  # (before a round that would mark its targets told)
                targets: dict[Holder, list[list[Any]]] = {}
                took: dict[Holder, set[int]] = {}
                for it in items:
                    w = self.writers.get(it.ino)
                    hs = self.holders.get(it.ino, {})
                    # Writers without a lease: in the first round only (one that writes
                    # again meanwhile is the caller's to look for again, within its time).
                    ws = self.writing.get(it.ino, ()) if first else ()
                    # Receivers of maps of a contended file: where they overlap it.
                    sent = self.contention.spans.get(it.ino)
                    for h, touched in hs.items():
                        if h is holder:
                            continue
                        revoke = w is h
                        if (revoke or (h in ws and _writing_in(h, it, sent))
                                or (not it.write_only and (
                                    touched or (first and it.directory)
                                    or (sent is not None and h in sent and overlap(sent[h], it.span))))):
                            targets.setdefault(h, []).append(it.to_wire(revoke))
                            hs[h] = False
                            if sent is not None and h in sent:
                                self.contention.take(h, it.ino)  # (its answer ends them)
                                took.setdefault(h, set()).add(it.ino)
                    if w is not None and w is not holder and w not in hs:
                        targets.setdefault(w, []).append(it.to_wire(True))
                    for h in ws:
                        if h is not holder and h not in hs and _writing_in(h, it, sent):
                            targets.setdefault(h, []).append(it.to_wire(False))
                if not targets:
                    return
                first = False
                async with trio.open_nursery() as nursery:
                    for h, payload in targets.items():
                        nursery.start_soon(self._recall_one, h, payload, took.get(h, set()))
        finally:
            for ino in inos:
                n = self._recalling[ino] - 1
                if n:
                    self._recalling[ino] = n
                else:
                    del self._recalling[ino]

    async def _recall_one(self, h: Holder, payload: list[list[Any]], taken: set[int]) -> None:
        """Recall *payload* from *h* (*taken*: the files whose ranges it was sent went
        with this recall, memfs.meta.contention)."""
        rid = self._next_rid
        self._next_rid = rid % 0xFFFFFFFF + 1
        registered = h.registrations  # (one since: what it holds now was sent since)
        w = _Waiting(h)
        self._waiting[rid] = w
        self.recalls_sent += 1
        marks = [(ino, m) for ino, _names, _revoke in payload
                 if (m := self.writing.get(ino, {}).get(h)) is not None]
        ended = False  # answered, or the holder forgotten
        try:
            answered = False
            if h.send_recall(rid, payload):
                with trio.move_on_after(self.recall_timeout):
                    await w.done.wait()
                    answered = True
            if answered:  # its sizes were applied as the answer was read
                for ino, mark in marks:  # it answered once those transfers ended
                    self.done_writing(h, ino, mark)
                for ino, _names, revoke in payload:
                    if revoke and self.writers.get(ino) is h:  # revoked, nothing settled
                        del self.writers[ino]
                        if self.settle is not None:
                            self.settle(ino, None, 0, ANYWHERE)
                ended = True
                return
            # No answer: the client is stopped, hung or cut off.  Make sure it can no
            # longer renew its lease, wait until it has run out, then forget it.
            self.evictions += 1
            log.warning("a client did not answer a recall within %.1f s: evicting it "
                        "(its caches expire %.1f s after it was last heard from)",
                        self.recall_timeout, self.term)
            registrations = h.registrations
            h.evict("did not answer a recall")
            # Its leases are being taken without its word even if it registers again
            # within its term: shut out what it may still have in flight now.
            if self.unsaid is not None:
                self.unsaid(h)
            await trio.sleep_until(h.last_heard + self.term)
            if h.registrations == registrations:  # else its registration forgot it all
                self.forget(h)
            ended = True
        finally:
            del self._waiting[rid]
            if not ended:
                # Given up (the caller's deadline, a glimpse that stops waiting) before
                # the holder answered or was forgotten: it may still hold all it held,
                # so the next change recalls it again (recall() marked it as told),
                # and, of a contended file, any read (its ranges went with the recall).
                for ino, _names, _revoke in payload:
                    hs = self.holders.get(ino)
                    if hs is not None and h in hs:
                        hs[h] = True
                        if ino in taken and h.registrations == registered:
                            self.contention.sent(h, ino, None)

    def recalled(self, holder: Holder, rid: int, settles: list[Settle]) -> None:
        """A RECALLED frame from *holder* (unknown or late ones are ignored)."""
        w = self._waiting.get(rid)
        if w is None or w.holder is not holder:
            log.debug("late or unknown recall acknowledgement %d", rid)
            return
        # Applied now, before any later frame of the holder is read: a reply to one
        # of those tells it that its sizes are in (and durable once that reply goes).
        for ino, size, mtime, span in settles:
            if self.writers.get(ino) is holder:
                del self.writers[ino]
                if self.settle is not None:
                    self.settle(ino, size, mtime, span)
        w.done.set()

    def forget(self, holder: Holder, *, said: bool = False) -> None:
        """Drop everything *holder* holds (it reconnected afresh, or was evicted, or is gone).

        Its write leases end without a size from it: their unused preallocation is
        freed, and (unless *said*: it has just reported every size it had) ``lost``
        hears of each.  Recalls waiting for its answer end now: it holds nothing any
        more.
        """
        lost = None if said else self.lost
        if not said and self.unsaid is not None:
            self.unsaid(holder)
        for w in self._waiting.values():
            if w.holder is holder:
                w.done.set()
        if not said:
            # (Registering again, its bytes may still be on their way: its marks
            # stay, and readers still wait for it.)
            for ino in list(self._marked_of.get(holder, ())):
                self.done_writing(holder, ino)
        self.contention.forget(holder)
        for ino in self._inos_of.pop(holder, ()):
            hs = self.holders.get(ino)
            if hs is not None:
                hs.pop(holder, None)
                if not hs:
                    del self.holders[ino]
            if self.writers.get(ino) is holder:
                del self.writers[ino]
                if lost is not None:
                    lost(holder, ino)
                if self.settle is not None:
                    self.settle(ino, None, 0, ANYWHERE)
        for ino in [i for i, w in self.writers.items() if w is holder]:
            del self.writers[ino]
            if lost is not None:
                lost(holder, ino)
            if self.settle is not None:
                self.settle(ino, None, 0, ANYWHERE)

    def destroyed(self, ino: int) -> None:
        """Inode *ino* no longer exists (after its holders were recalled)."""
        for h in list(self.writing.get(ino, ())):
            self.done_writing(h, ino)
        self.placed.pop(ino, None)
        self.contention.destroyed(ino)
        hs = self.holders.pop(ino, None)
        for h in hs or ():
            mine = self._inos_of.get(h)
            if mine is not None:
                mine.discard(ino)
        self.writers.pop(ino, None)

    def holds(self, holder: Holder) -> int:
        return len(self._inos_of.get(holder, ()))


def _writing_in(h: Holder, it: Item, sent: dict[Any, list[Span]] | None) -> bool:
    """Do *h*'s bytes on their way (it is marked writing) concern *it*?  Unless the
    file is contended and *h* was sent maps of other ranges only."""
    return it.span is None or sent is None or h not in sent or overlap(sent[h], it.span)
