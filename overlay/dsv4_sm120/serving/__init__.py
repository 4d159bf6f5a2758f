"""Serving glue for the PD-disaggregated DeepSeek-V4-Flash deployment.

Standard library only (plus ``nixl``/``numpy`` inside :mod:`.nixl_check`), so the
launcher runs with any Python 3.10+ and never imports torch or SGLang itself.

Modules
-------
* :mod:`.plan`       environment variables -> a deployment plan (commands, env, ports; replicas per GPU group),
  :mod:`.plan_text` its dry-run text, :mod:`.profile_choices` what it takes from the machine profile (each
  server's TP all-reduce, the recorded serving shape)
* :mod:`.envfiles`   ``serve/env/*.env`` parser
* :mod:`.preflight`  checks run before anything starts (one clear line per failure); :mod:`.memory_check` the
  weights + KV against each server's GPU memory
* :mod:`.supervisor` start, health-wait, supervise, tear down, stop
* :mod:`.deploy`     the CLI behind ``serve/serve_dsv4_tp4.sh``, ``serve_dsv4_mtp.sh``, ``stop.sh``
* :mod:`.standin`    a small HTTP server standing in for an SGLang server (tests, rehearsal)
* :mod:`.nixl_check` two NIXL agents move DSv4-layout KV pages and verify them
* :mod:`.verify`     ``make verify``; :mod:`.shapes` its shape stage (candidates started, measured, compared, the
  winner recorded), :mod:`.shape_report` its table and plot
"""
