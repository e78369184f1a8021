"""Roles of the Hourglass layout: which ranks run the CONV trunk, which the FC head.

Rank order (documented contract): with ``n`` ranks and ``F`` FC ranks, world ranks
``0 .. C-1`` (``C = n - F``) are CONV ranks and the LAST ``F`` ranks ``C .. n-1`` are FC ranks,
so world rank 0 (the one that logs and writes the run directory) is always a CONV rank.
CONV ranks are mapped to FC ranks in contiguous balanced blocks: with ``q, r = divmod(C, F)``,
the first ``r`` FC ranks serve ``q + 1`` CONV ranks and the others ``q`` (counts differ by at
most one). Example: 5 ranks, ``F = 2``: CONV 0, 1 -> FC 3; CONV 2 -> FC 4.

:func:`plan_layout` is pure (sizes in, ranks out) and raises the one :class:`LayoutError`
every rank can evaluate before any collective. :class:`Layout` then splits ``MPI.COMM_WORLD``
with ``Comm.Split`` into a CONV and an FC communicator, duplicates ``COMM_WORLD`` for the
activation point-to-point traffic (so it never interferes with Horovod's communicator), and
initialises Horovod with one process set built from the rank's role communicator
(``hvd.init(comm, process_sets=[hvd.ProcessSet(role_comm)])``, Horovod's "static process sets
from MPI communicators"). If Horovod is already initialised, it is shut down and initialised
again with the process sets (process sets built before that become invalid).

Ending: Horovod's shutdown is global. When ONE process shuts Horovod down (``hvd.shutdown()``,
which Horovod also registers with ``atexit``, so a process that simply ends does it), the
background threads of ALL processes stop and free their process sets, and any collective another
rank posts after that fails with "Process set provided does not exist, or has not been
registered" (or "Horovod has been shut down"). The roles do different work, so a rank can end
while the others still exchange (an FC rank with nothing left to do while the CONV ranks flush
their SGC sync). :meth:`Layout.close` therefore waits until every rank got there (a barrier
with a deadline) before shutting Horovod down, and a process that ends without calling it runs
it at exit (before Horovod's own exit hook), except after an uncaught exception, where waiting
for the others would only delay the error.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Union

#: Default deadline (seconds) of :meth:`Layout.close`'s wait for the other ranks.
EXIT_TIMEOUT_S = 300.0
_HOROVOD_GENERATION = [0]  # bumped by every Layout that (re-)initialises Horovod


class LayoutError(ValueError):
    """An impossible Hourglass layout; raised identically on every rank before any collective."""


@dataclass(frozen=True)
class LayoutPlan:
    """Ranks of each role and the CONV -> FC mapping for one world size.

    Attributes:
        world_size: ranks in ``COMM_WORLD``.
        conv_ranks: world ranks running the CONV trunk (``0 .. C-1``).
        fc_ranks: world ranks running the FC head (the last ``F``).
        fc_of: ``fc_of[c]`` is the FC world rank serving CONV world rank ``c``.
    """

    world_size: int
    conv_ranks: List[int]
    fc_ranks: List[int]
    fc_of: Dict[int, int]

    @property
    def n_conv(self) -> int:
        return len(self.conv_ranks)

    @property
    def n_fc(self) -> int:
        return len(self.fc_ranks)

    def convs_of(self, fc_rank: int) -> List[int]:
        """CONV world ranks served by FC world rank ``fc_rank`` (ascending)."""
        return [c for c in self.conv_ranks if self.fc_of[c] == fc_rank]

    def role(self, rank: int) -> str:
        return "fc" if rank in self.fc_ranks else "conv"


def check_fc_workers(world_size: int, fc_workers: Union[int, str]) -> None:
    """Raise :class:`LayoutError` unless ``fc_workers`` FC ranks fit in ``world_size`` ranks.

    Valid: ``world_size >= 2``; ``fc_workers`` is ``"auto"`` or an integer with
    ``1 <= fc_workers <= world_size - fc_workers`` (at least one CONV rank, and no more FC ranks
    than CONV ranks).
    """
    if not isinstance(world_size, int) or world_size < 2:
        raise LayoutError(
            f"the Hourglass layout needs at least 2 ranks (1 CONV + 1 FC), got {world_size}: "
            f"run under mpirun -np 2 or more, or use layout=data_parallel")
    if fc_workers == "auto":
        return
    if isinstance(fc_workers, bool) or not isinstance(fc_workers, int):
        raise LayoutError(f"hourglass.fc_workers={fc_workers!r} is invalid: use auto or an integer >= 1")
    if fc_workers < 1:
        raise LayoutError(f"hourglass.fc_workers={fc_workers} is invalid: at least 1 FC rank is needed")
    n_conv = world_size - fc_workers
    if n_conv < 1:
        raise LayoutError(
            f"hourglass.fc_workers={fc_workers} leaves no CONV rank in {world_size} ranks: "
            f"use at most {world_size // 2} FC ranks (or fc_workers=auto)")
    if fc_workers > n_conv:
        raise LayoutError(
            f"hourglass.fc_workers={fc_workers} is more than the {n_conv} CONV ranks left of "
            f"{world_size}: use at most {world_size // 2} FC ranks (or fc_workers=auto)")


def plan_layout(world_size: int, fc_workers: int) -> LayoutPlan:
    """The rank plan for ``world_size`` ranks with ``fc_workers`` FC ranks (pure, no MPI).

    Raises:
        LayoutError: see :func:`check_fc_workers` (``"auto"`` must be resolved first).
    """
    if fc_workers == "auto":
        raise LayoutError("plan_layout needs a number of FC ranks: resolve fc_workers=auto first")
    check_fc_workers(world_size, fc_workers)
    n_conv = world_size - fc_workers
    conv_ranks = list(range(n_conv))
    fc_ranks = list(range(n_conv, world_size))
    q, r = divmod(n_conv, fc_workers)
    fc_of, c = {}, 0
    for j, fc in enumerate(fc_ranks):
        for _ in range(q + 1 if j < r else q):
            fc_of[conv_ranks[c]] = fc
            c += 1
    return LayoutPlan(world_size, conv_ranks, fc_ranks, fc_of)


class Layout:
    """CONV and FC roles over ``comm`` (``MPI.COMM_WORLD``) with Horovod process sets.

    Args:
        comm: the world communicator (default ``MPI.COMM_WORLD``).
        fc_workers: number of FC ranks, or ``"auto"`` (cost model, needs ``cost``).
        cost: for ``"auto"``: a zero-argument callable returning
            :class:`hgsgc.hourglass.costmodel.CostInputs` measured on this rank. Every rank
            measures; the per-field medians go into :func:`~hgsgc.hourglass.costmodel.choose_fc_workers`
            on rank 0, whose choice is broadcast.
        link: for ``"auto"``: a zero-argument COLLECTIVE callable (every rank calls it, after the
            measurements) returning the link dict of
            :func:`hgsgc.hourglass.costmodel.link_inputs` (``alpha_s``, ``beta_Bps``,
            ``source``); default: ``link_inputs(comm)``, the ping-pong probe. Its ``alpha`` and
            ``beta`` replace the cost inputs' and it is reported as ``cost_report["link"]``.
        boundary: for ``"auto"``: an optional zero-argument COLLECTIVE callable (every rank
            calls it, after the link) returning :func:`hgsgc.hourglass.costmodel.probe_boundary`'s
            dict (the boundary message's round trips, e.g. ``lambda: probe_boundary(comm, act,
            grad, *boundary_sample(split, x, M))``); rank 0 turns it into ``boundary_msg_s`` by
            :func:`~hgsgc.hourglass.costmodel.boundary_message_inputs` on the median inputs and
            the link (reported as ``cost_report["boundary_message"]``). None (default): the
            cost inputs' ``boundary_msg_s`` as they are (0 unless the callable set it).
        log: callable for the cost-model inputs and choice (rank 0 only); None: silent.
        init_horovod: initialise Horovod with the role process set (default True).

    Attributes:
        rank, world_size, role (``"conv"``/``"fc"``), is_conv, is_fc, plan (:class:`LayoutPlan`),
        role_comm (this rank's CONV or FC communicator), p2p (a ``Dup`` of ``comm`` for
        activations), process_set (the Horovod process set of this rank's role),
        my_fc (CONV ranks: the FC world rank they send to), my_convs (FC ranks: CONV world ranks
        they serve), role_root (lowest world rank of this role), cost_report (dict, ``"auto"``).

    Raises:
        LayoutError: impossible layout, identically on every rank, before any collective.
        RuntimeError: the cost measurement failed on some rank (raised on every rank).
    """

    def __init__(self, comm=None, fc_workers: Union[int, str] = 1, *,
                 cost: Optional[Callable[[], "object"]] = None, link: Optional[Callable[[], dict]] = None,
                 boundary: Optional[Callable[[], dict]] = None, log: Optional[Callable] = None,
                 init_horovod: bool = True):
        from mpi4py import MPI

        self.world = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.world.Get_rank()
        self.world_size = self.world.Get_size()
        check_fc_workers(self.world_size, fc_workers)  # before any collective
        if fc_workers == "auto" and cost is None:
            raise LayoutError("hourglass.fc_workers=auto needs the cost-model inputs (cost=...)")
        self.cost_report = None
        if fc_workers == "auto":
            fc_workers = self._auto(cost, link, log, boundary)
        self.plan = plan_layout(self.world_size, fc_workers)
        self.role = self.plan.role(self.rank)
        self.is_fc = self.role == "fc"
        self.is_conv = not self.is_fc
        self.role_comm = self.world.Split(1 if self.is_fc else 0, self.rank)
        self.p2p = self.world.Dup()
        self.my_fc = self.plan.fc_of.get(self.rank)
        self.my_convs = self.plan.convs_of(self.rank) if self.is_fc else []
        ranks = self.plan.fc_ranks if self.is_fc else self.plan.conv_ranks
        self.role_ranks = list(ranks)
        self.role_root = ranks[0]
        self.role_index = ranks.index(self.rank)
        self.process_set = None
        if init_horovod:
            self._init_horovod()

    # -------------------------------------------------------------------------------------
    @property
    def n_fc(self) -> int:
        return self.plan.n_fc

    @property
    def n_conv(self) -> int:
        return self.plan.n_conv

    def _collective(self, fn, what: str):
        """Call the COLLECTIVE callable ``fn`` (``link=`` or ``boundary=`` of ``"auto"``).

        If it raises on this rank, the other ranks are blocked inside it waiting for this one,
        and no agreement step can reach them: this rank prints one line (``hgsgc: error on rank
        R: Type: message (in the collective boundary= callable of Layout(..., "auto"))``) and
        ends the whole job with ``Abort(1)`` on the layout's communicator, also without
        :func:`hgsgc.cli.run_guarded`. A one-rank world re-raises the error instead.
        """
        try:
            return fn()
        except Exception as exc:
            if self.world_size == 1:
                raise
            from hgsgc.faults import one_line

            print(f"hgsgc: error on rank {self.rank}: {one_line(exc)} (in the collective {what}= "
                  f'callable of Layout(..., "auto"))', file=sys.stderr, flush=True)
            self.world.Abort(1)

    def _auto(self, cost, link, log, boundary=None) -> int:
        import dataclasses

        from hgsgc.hourglass import costmodel
        from hgsgc.hourglass.costmodel import CostInputs, choose_fc_workers, link_inputs, with_link

        try:
            mine, err = cost(), None
        except Exception as exc:  # report on every rank instead of hanging the others
            mine, err = None, f"rank {self.rank}: {type(exc).__name__}: {exc}"
        gathered = self.world.allgather((mine, err))
        errors = [e for _, e in gathered if e]
        if errors:
            raise RuntimeError("fc_workers=auto: cost measurement failed on " + "; ".join(errors))
        # collective: every rank (a failure on one rank ends the job, see _collective)
        lk = self._collective(link, "link") if link is not None else link_inputs(self.world)
        probe = self._collective(boundary, "boundary") if boundary is not None else None
        report, err = None, None
        if self.rank == 0:
            try:
                inputs = with_link(CostInputs.median([g for g, _ in gathered]), lk)
                msg = None
                if probe is not None:
                    msg = costmodel.boundary_message_inputs(probe, inputs.act_bytes, inputs.grad_bytes,
                                                            inputs.codec_s, inputs.alpha, inputs.bandwidth)
                    inputs = dataclasses.replace(inputs, boundary_msg_s=msg["boundary_msg_s"])
                report = choose_fc_workers(inputs, self.world_size)
                report["link"] = lk
                report["boundary_message"] = msg
            except Exception as exc:  # broadcast, so no rank waits for a report that never comes
                err = f"{type(exc).__name__}: {exc}"
        report, err = self.world.bcast((report, err), root=0)
        if err:
            raise RuntimeError("fc_workers=auto: " + err)
        self.cost_report = report
        if log is not None and self.rank == 0:
            from hgsgc.hourglass.costmodel import format_report

            log(format_report(report))
        return int(report["fc_workers"])

    def _init_horovod(self):
        import atexit

        import horovod.tensorflow as hvd

        if hvd.is_initialized():
            hvd.shutdown()
        ps = hvd.ProcessSet(self.role_comm)
        hvd.init(comm=self.world, process_sets=[ps])
        if sorted(ps.ranks) != sorted(self.role_ranks):  # pragma: no cover - Horovod contract
            raise RuntimeError(f"Horovod process set {ps.ranks} != role ranks {self.role_ranks}")
        self.process_set = ps
        _HOROVOD_GENERATION[0] += 1
        self._generation = _HOROVOD_GENERATION[0]
        self._closed = False
        # registered after hvd.init, so it runs BEFORE Horovod's own atexit shutdown (LIFO)
        atexit.register(self._close_at_exit)

    def close(self, timeout_s: float = EXIT_TIMEOUT_S) -> bool:
        """Wait until every rank of the world called ``close``, then shut Horovod down.

        Collective over the layout's world (an ``Ibarrier`` on :attr:`p2p`, waited for with
        :func:`hgsgc.faults.wait_for_peers`). Call it on every rank when the layout's work is
        done; a process that ends without calling it calls it at exit (see the module
        docstring). Idempotent; does nothing for a layout built with ``init_horovod=False``.

        Args:
            timeout_s: seconds to wait for the other ranks (``<= 0``: no deadline). On the
                deadline a warning names the setting and Horovod is shut down anyway.

        Returns:
            True if every rank arrived before Horovod was shut down, False after the deadline
            (or when there was nothing to close).
        """
        if getattr(self, "_closed", True):
            return False
        self._closed = True
        from hgsgc.faults import StallError, wait_for_peers

        arrived = True
        try:
            wait_for_peers([self.p2p.Ibarrier()], None, "every rank to finish with the Hourglass "
                           "layout before Horovod shuts down (Layout.close)", float(timeout_s))
        except StallError as exc:
            arrived = False
            print(f"hgsgc: rank {self.rank}: {exc}; shutting Horovod down anyway", file=sys.stderr, flush=True)
        import horovod.tensorflow as hvd

        if hvd.is_initialized() and self._generation == _HOROVOD_GENERATION[0]:
            hvd.shutdown()  # (a later Layout's hvd.init replaced this one's Horovod: leave it)
        return arrived

    def _close_at_exit(self):
        if getattr(sys, "last_value", None) is not None:  # an uncaught exception ends this rank
            return
        self.close()

    def describe(self) -> str:
        groups = ", ".join(f"FC {f} <- CONV {self.plan.convs_of(f)}" for f in self.plan.fc_ranks)
        return (f"Hourglass layout: {self.n_conv} CONV ranks {self.plan.conv_ranks}, "
                f"{self.n_fc} FC ranks {self.plan.fc_ranks}; {groups}")
