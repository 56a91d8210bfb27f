"""bench/mixed_cluster.py's KindLedger: which constrained waits a pass could have avoided (issue 15)."""

from __future__ import annotations

from bench.mixed_cluster import KindLedger, MixedJob


def job(gpus: int, kinds: tuple[str, ...] | None) -> MixedJob:
    return MixedJob(gpus, 600, None, kinds, "research", 0, 0.0)


def ledger() -> KindLedger:
    led = KindLedger()
    led.add_node("scarce-0", "p100", 1)
    led.add_node("plenty-0", "h100", 8)
    return led


def test_flexible_job_placed_before_any_constrained_job_waited_is_not_counted_as_avoidable():
    """A flexible job took the only p100 while no job named p100 (it could have gone to h100): a
    p100 job that comes later waits beside it, but only preemption could have avoided that."""
    led = ledger()
    led.reserved([])
    led.placed([(0, job(1, None), "p100", [("scarce-0", 1)])], waiting=[])
    led.account([job(1, ("p100",))], 60.0)
    assert (led.idle_job_s, led.movable_job_s, led.unclaimed_job_s) == (0.0, 0.0, 60.0)


def test_flexible_job_placed_while_a_constrained_job_waited_is_counted_as_avoidable():
    led = ledger()
    led.reserved([])
    waiting = [job(1, ("p100",))]
    led.placed([(0, job(1, None), "p100", [("scarce-0", 1)])], waiting=waiting)
    led.account(waiting, 60.0)
    assert (led.idle_job_s, led.movable_job_s, led.unclaimed_job_s) == (0.0, 60.0, 0.0)
    led.ended(0)  # its GPU is back: the constrained job now waits beside an idle GPU it fits
    led.account(waiting, 60.0)
    assert led.idle_job_s == 60.0


def test_a_flexible_job_that_could_not_run_elsewhere_is_never_counted():
    led = ledger()
    led.add_node("plenty-1", "h100", 8)
    led.reserved([])
    big = job(8, None)  # both h100 nodes are taken by the pass: nowhere else to go
    led.placed([(0, big, "h100", [("plenty-0", 8)]), (1, big, "h100", [("plenty-1", 8)]),
                (2, job(1, None), "p100", [("scarce-0", 1)])], waiting=[job(8, ("h100",))])
    led.account([job(8, ("h100",))], 60.0)
    assert (led.idle_job_s, led.movable_job_s, led.unclaimed_job_s) == (0.0, 0.0, 0.0)


def test_flexible_job_that_took_gpus_no_waiting_job_could_use_is_not_counted_as_avoidable():
    """An h100 job waits for a whole node (8 GPUs); a flexible 1-GPU job takes the last free GPU of
    a node where 7 run: nothing the waiting job could use then. When the 7 end, the waiting job
    would fit only with that GPU back: not avoidable without preemption."""
    led = ledger()
    led.reserved([])
    waiting = [job(8, ("h100",))]
    led.placed([(0, job(7, ("h100",)), "h100", [("plenty-0", 7)])], waiting=waiting)
    led.placed([(1, job(1, None), "h100", [("plenty-0", 1)])], waiting=waiting)
    led.ended(0)
    led.account(waiting, 60.0)
    assert (led.idle_job_s, led.movable_job_s, led.unclaimed_job_s) == (0.0, 0.0, 60.0)
