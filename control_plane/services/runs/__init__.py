"""Runs: a job from submit to its end, and each attempt's life in between.

The job (``jobs``: submit, cancel) and its shipped code (``code``, ``code_upload``); an attempt:
allocated (``allocation``), its nodes' status reports merged and decided (``status_reports``), ended
and its GPUs released (``attempts``); fencing the reports about it (``fencing``); the
in-process restart of healthy ranks (``parking``, ``handover``); its progress, watchdogs and time
limit (``progress``, ``watchdog``, ``limits``); the checkpoint interval chosen for it
(``intervals``); a recovery's phases (``recovery_budget``, pure); its workers' logs (``logs``) and
their retention (``retention``).
"""
