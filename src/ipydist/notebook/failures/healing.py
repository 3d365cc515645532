"""Notebook side of ``--elastic``: after a rank died, the cluster heals around the survivors.

The cell in which a rank died ends as before (``RankDied``, the survivors released), and a
:class:`Heal` starts at once, in a thread of the kernel, so that the cell's message is not held
back: the survivors make the world again with a replacement for each dead rank
(``ipydist.rank.calls.heal``), the replacement registers with the controller as a new engine
(the cluster maps the rank to it), and rank 0 copies its variables and random states to it
(``ipydist.rank.calls.copy_state``). The next cell, ``pull``, ``push`` or ``%dist_status``
waits for the heal and says what it did, or, should it fail, what to do instead.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from ipydist import protocol
from ipydist.errors import ClusterError, RankTimeout
from ipydist.notebook import ipp
from ipydist.notebook.failures.recovery import holders_of_the_group
from ipydist.notebook.launch import launchers, processes
from ipydist.specs import describe_ranks

#: How long a heal's start may take (spawning a replacement, its torch import, its
#: registration) before it is given up.
HEAL_SECONDS = 60.0
#: A copy of this many bytes or more says how long it took, and its rate.
SAY_RATE_FROM_BYTES = 64 << 20
#: How long a heal's copy of rank 0's state may go without moving
#: (:data:`~ipydist.protocol.HEAL_PROGRESS_KEY`) before it is given up: a copy that moves is
#: never cut off, however large the state.
COPY_STALL_SECONDS = 60.0


class Heal:
    """One heal, for the ranks ``dead`` of ``cluster``, run in a thread."""

    def __init__(self, cluster, dead: list[int], words, min_np: int | None = None):
        self.cluster = cluster
        self.dead = sorted(dead)
        self.words = words
        self.restart = words.restart
        #: The fewest ranks the cluster may go on with when a replacement cannot be started
        #: (None: as many as it had, so it never goes on with fewer).
        self.min_np = cluster.size if min_np is None else min_np
        self.started = time.monotonic()
        self.lines: list[str] = []
        self.failed: str | None = None
        #: The replacements registered (a failure then removes them, or stops the cluster).
        self.joined = False
        #: What it is doing now, and the copy's (bytes sent, of how many), for %dist_status.
        self.phase = "starting the replacement"
        self.progress: tuple[int, int] | None = None
        self._thread = threading.Thread(target=self._run, name="ipydist-heal", daemon=True)

    def start(self) -> Heal:
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def describe(self) -> str:
        """Where the heal is, in a sentence (``%dist_status`` shows it while it runs)."""
        text = (f"{describe_ranks(self.dead)} {'is' if len(self.dead) == 1 else 'are'} being "
                f"replaced ({time.monotonic() - self.started:.0f} s): {self.phase}")
        if self.progress is not None:
            sent, total = self.progress
            text += f", {sent / 2**20:.0f} of {total / 2**20:.0f} MB"
        return text + "."

    def wait(self) -> list[str]:
        """Wait for the heal to end; the lines that say what it did."""
        self._thread.join()
        return self.lines

    def _run(self) -> None:
        try:
            self.lines = self._heal()
        except Exception as e:  # one state the message names, never a rank without state
            self.lines = self._failed(e)

    def _failed(self, error: Exception) -> list[str]:
        """A heal that failed leaves the cluster in one of two states, which the line names:
        the survivors alone, renumbered (the replacements, if they joined, removed), where
        ``--min-np`` allows it; else a cluster that refuses cells until it is restarted."""
        cluster, why = self.cluster, f"{error}"
        survivors = [r for r in range(cluster.size) if r not in self.dead]
        if self.joined and survivors and len(survivors) >= self.min_np:
            try:
                cluster.call(protocol.LEAVE, self.dead, timeout=HEAL_SECONDS, ending=self.dead)
            except Exception as e:
                why += f"; removing the replacement failed too: {e}"
            else:
                cluster.keep_ranks(survivors)
                which = "its replacement was" if len(self.dead) == 1 else "their replacements were"
                scale = self.words.scale.replace("N", str(len(survivors) + len(self.dead)))
                return [f"{describe_ranks(self.dead)} could not be given rank {survivors[0]}'s "
                        f"state ({why}), so {which} removed: the cluster goes on with "
                        f"{cluster.size} ranks (--min-np {self.min_np}), renumbered from 0, "
                        f"each with its state. {scale} tries again."]
        self.failed = why
        cluster.unusable = (f"Replacing {describe_ranks(self.dead)} failed ({why}), so the "
                            "cluster refuses cells")
        return [cluster.refusal(self.restart)]

    def _heal(self) -> list[str]:
        cluster = self.cluster
        survivors = [r for r in range(cluster.size) if r not in self.dead]
        if not survivors or not processes.alive(cluster.launcher_process()):
            raise ClusterError("mpiexec ended the job, so no rank is left to heal around "
                               "(a lost host's daemon ends it)")
        known = set(cluster.client.ids)
        deadline = self.started + HEAL_SECONDS
        # each replacement where its rank ran, unless that host lost every rank it had
        alive_hosts = {cluster.ranks[r].host for r in survivors}
        where = [cluster.ranks[r].host for r in self.dead]
        hosts = where if all(h in alive_hosts for h in where) else None
        spares = len(cluster.spare_pids)
        request = cluster.view(survivors).apply_async(
            protocol.on_rank, protocol.HEAL, self.dead, True, hosts, rank_env(cluster),
            cluster.plan.can_spawn)
        replies = take_new_ranks(cluster, request, known, len(self.dead), deadline)
        cluster.spare_pids = replies[0].spares
        self.joined = not replies[0].not_replaced
        if not_replaced := replies[0].not_replaced:
            if len(survivors) < self.min_np:
                raise ClusterError(f"{not_replaced} (--min-np {len(survivors)} would have let "
                                   "the others go on)")
            return [self._went_on(replies, survivors)]
        for rank in self.dead:  # for %dist_status
            cluster.ranks[rank] = replace(cluster.ranks[rank], replacement=True)
        root = survivors[0]
        self.phase = f"copying rank {root}'s state"
        copied = copy_state(cluster, root, self.dead, cluster.size, self._copied)
        self.phase = "resetting hvd.elastic states"
        states = cluster.call(protocol.ELASTIC_RESET, True, timeout=HEAL_SECONDS)
        one = len(self.dead) == 1
        pids = ", ".join(str(cluster.ranks[r].pid) for r in self.dead)
        by = _by_spares(spares, len(cluster.spare_pids), len(self.dead))
        line = (f"{describe_ranks(self.dead)} {'was' if one else 'were'} replaced in "
                f"{time.monotonic() - self.started:.1f} s{by} (pid {pids}), "
                f"{'its' if one else 'their'} {copied}; the other ranks kept theirs"
                f"{holders_of_the_group(replies, 'the new group')}.")
        if states[0]:
            line += (f" {_states(states[0])} went back to {'its' if states[0] == 1 else 'their'}"
                     " last commit() on every rank, synced from rank 0, reset callbacks run.")
        return [line]

    def _copied(self, progress: tuple[int, int]) -> None:
        self.progress = progress

    def _went_on(self, replies: list[protocol.HealReport], survivors: list[int]) -> str:
        """The replacements could not be started, and the survivors went on as the world
        (renumbered from 0): the cluster follows, and says so."""
        cluster, was = self.cluster, self.cluster.size
        cluster.keep_ranks(survivors)
        states = cluster.call(protocol.ELASTIC_RESET, True, timeout=HEAL_SECONDS)[0]
        one = len(self.dead) == 1
        line = (f"{describe_ranks(self.dead)} could not be replaced "
                f"({replies[0].not_replaced}); the cluster goes on with {cluster.size} ranks "
                f"(--min-np {self.min_np})")
        moved = [(old, new) for new, old in enumerate(survivors) if old != new]
        if moved:
            line += (f": {describe_ranks([o for o, _ in moved])} "
                     f"{'is' if len(moved) == 1 else 'are'} now "
                     f"{describe_ranks([n for _, n in moved])}")
        line += _followed(replies, cluster.size, "are gone")
        if states:
            line += f"; {_states(states)} went back to their last commit(), reset callbacks run"
        scale = self.words.scale.replace("N", str(was))
        return (line + f"; every rank kept its state. {scale} starts "
                f"{'it' if one else 'them'} again once the cause is gone.")


def _by_spares(before: int, after: int, replaced: int) -> str:
    """How many of the replacements were hot spares, and how many spares are left, as a
    clause ("" when there were none)."""
    used = before - after
    if not used:
        return ""
    which = "a hot spare" if used == 1 == replaced else (
        "hot spares" if used == replaced else f"{used} hot spares and {replaced - used} new")
    return f" by {which} ({after} left)"


def _followed(replies: list[protocol.HealReport], size: int, gone: str) -> str:
    """What followed the new size on the ranks that stayed (their ``rebound`` samplers,
    ``sets_removed``), as clauses of the line that says what happened."""
    text = ""
    if names := sorted({name for reply in replies for name in reply.rebound}):
        text += f"; samplers now split the data {size} ways: {', '.join(names)}"
    if removed := replies[0].sets_removed:
        text += f"; removed, as ranks in them {gone}: {', '.join(removed)}"
    return text


def _states(count: int) -> str:
    return f"{count} hvd.elastic state{'s' if count > 1 else ''}"


def rank_env(cluster) -> list[str]:
    """The names of the variables mpiexec gave the ranks (ipydist's, the user's ``--env``,
    ipyparallel's connection folder): a spawned rank must get them too."""
    return sorted({*cluster.plan.env, *launchers.IPP_ENV})


def take_new_ranks(cluster, request, known: set[int], count: int, deadline: float
                   ) -> list[protocol.HealReport]:
    """Wait for ``request`` (the ranks' heal or resize) and for ``count`` engines not in
    ``known`` to register; attach them and give each its rank in ``cluster``. Returns the
    ranks' replies (when they say ``not_replaced``, no engine is waited for)."""
    client = cluster.client
    new: list[int] = []
    while not (request.ready() and (len(new) >= count or _not_replaced(request))):
        if time.monotonic() > deadline:
            ended = "ended" if request.ready() else "had not ended"
            raise RankTimeout(f"not done within {HEAL_SECONDS:g} s: the ranks' part {ended}, "
                               f"{len(new)} of {count} new ranks registered")
        if not processes.alive(cluster.launcher_process()):
            raise ClusterError("mpiexec ended")
        if request.ready() and not request.successful():
            request.get()  # a rank's error: the heal cannot go on
        new = sorted(set(client.ids) - known)
        time.sleep(0.05)
    replies = request.get()
    infos = [client[engine_id].apply_sync(protocol.on_rank, protocol.ATTACH) for engine_id in new]
    for engine_id, info in sorted(zip(new, infos), key=lambda pair: pair[1].rank):
        cluster.replace_rank(info.rank, engine_id, info)
    return replies


def _not_replaced(request) -> bool:
    """Whether the ranks' heal went on without replacements (they could not be started)."""
    return request.successful() and bool(request.get()[0].not_replaced)


def copy_state(cluster, root: int, to: list[int], was_size: int,
               on_progress=lambda progress: None) -> str:
    """Copy ``root``'s variables to the new ranks ``to``; says what was copied. No deadline
    while the copy moves: ended (RankTimeout) once it has not moved for COPY_STALL_SECONDS.
    ``on_progress`` gets (bytes sent, of how many) as ``root`` says them."""
    ranks = list(range(cluster.size))
    request = cluster.view(ranks).apply_async(protocol.on_rank, protocol.COPY_STATE, root, to,
                                              was_size)
    seen, moved = None, time.monotonic()
    began = moved

    def look() -> None:  # what root said last, passed on when it moved
        nonlocal seen, moved
        progress = ipp.published(request, ranks, root, protocol.HEAL_PROGRESS_KEY)
        if progress is not None and tuple(progress) != seen:
            seen, moved = tuple(progress), time.monotonic()
            on_progress(seen)

    while not ipp.wait(request, 0.2):
        look()
        if time.monotonic() - moved > COPY_STALL_SECONDS:
            late = ipp.still_running(request, ranks)
            cluster.abort([ipp.msg_id(request, ranks, r) for r in late], late)
            where = (f"at {seen[0] / 2**20:.0f} of {seen[1] / 2**20:.0f} MB" if seen
                     else "before any of it was sent")
            raise RankTimeout(f"the copy of rank {root}'s state stopped moving {where} for "
                              f"{COPY_STALL_SECONDS:g} s ({describe_ranks(late)} still in it)")
    look()  # its last word, when it came before the reply
    copied = request.get()
    failed = [f"rank {r}: {reply.failed}" for r, reply in enumerate(copied) if reply.failed]
    if failed:
        raise ClusterError(f"loading rank {root}'s variables failed on {'; '.join(failed)}")
    size, took = copied[root].bytes, time.monotonic() - began
    rate = (f" in {took:.1f} s, {size / took / 2**20:.0f} MB/s"
            if size >= SAY_RATE_FROM_BYTES else "")
    if copied[root].on_device:
        rate += f"; {copied[root].on_device / 2**20:.1f} MB of it from GPU to GPU"
    text = (f"process state, variables and random states copied from rank {root} "
            f"({size / 2**20:.1f} MB{rate})")
    if skipped := copied[root].skipped:
        text += (f"; {len(skipped)} variable{'s' * (len(skipped) > 1)} not copied (using "
                 f"{'it' if len(skipped) == 1 else 'one'} there says so): {', '.join(skipped)}")
    if by_value := copied[root].by_value:
        text += f"; sent by value, as the new rank could not import them: {', '.join(by_value)}"
    rebound = sorted({name for reply in copied for name in reply.rebound})
    if rebound:
        text += f"; given the new rank's part of the data: {', '.join(rebound)}"
    return text


def scale(cluster, size: int) -> str:
    """Grow or shrink ``cluster`` to ``size`` ranks, keeping every rank's state: new ranks
    get rank 0's (as a replacement does), ranks from ``size`` up leave. Says what it did."""
    started = time.monotonic()
    deadline = started + HEAL_SECONDS
    was = cluster.size
    if size < was:
        cluster.call(protocol.RESIZE, size, timeout=HEAL_SECONDS, ending=range(size, was))
        cluster.drop_ranks(size)
        what = f"{describe_ranks(range(size, was))} left"
    else:
        spares = len(cluster.spare_pids)
        if size - was > spares and not cluster.plan.can_spawn:
            raise ClusterError(
                f"{was} ranks -> {size}: {spares or 'no'} hot spare{'s' * (spares != 1)} left, "
                f"and {protocol.NO_SPAWN_ON_ONE_HOST}; scale to at most {was + spares}, or "
                "restart with more --spares or with --elastic.")
        known = set(cluster.client.ids)
        request = cluster.view(list(range(was))).apply_async(
            protocol.on_rank, protocol.RESIZE, size, rank_env(cluster), cluster.plan.can_spawn)
        grown = take_new_ranks(cluster, request, known, size - was, deadline)[0]
        cluster.spare_pids = grown.spares
        if grown.not_replaced:  # a spare counted here had died: the ranks stayed as they were
            raise ClusterError(f"{was} ranks -> {size}: {grown.not_replaced}; the cluster goes "
                               f"on with its {was} ranks, each with its state.")
        added = list(range(was, size))
        by = _by_spares(spares, len(cluster.spare_pids), size - was)
        try:
            copied = copy_state(cluster, 0, added, was)
        except Exception as e:  # never a rank without state taking cells
            try:
                cluster.call(protocol.LEAVE, added, timeout=HEAL_SECONDS, ending=added)
            except Exception as left:
                cluster.unusable = (f"{was} ranks -> {size}: the new ranks could not be given "
                                    f"rank 0's state ({e}), nor removed ({left}), so the "
                                    "cluster refuses cells")
                raise ClusterError(f"{cluster.unusable}: restart it.") from e
            cluster.keep_ranks(list(range(was)))
            raise ClusterError(f"{was} ranks -> {size}: the new ranks could not be given rank "
                               f"0's state ({e}), so they were removed; the cluster goes on "
                               f"with its {was} ranks, each with its state.") from e
        what = f"{describe_ranks(added)} started{by}, {copied}"
    replies = cluster.view(list(range(min(was, size)))).apply_sync(
        protocol.on_rank, protocol.RESIZED, was)
    states = cluster.call(protocol.ELASTIC_RESET, False, timeout=HEAL_SECONDS)[0]
    line = f"{was} ranks -> {size} in {time.monotonic() - started:.1f} s: {what}"
    line += _followed(replies, size, "left")
    if states:
        line += f"; {_states(states)} synced from rank 0, reset callbacks run"
    return line + "; every rank kept its state."
