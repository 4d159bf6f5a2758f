"""End-to-end measurement against a running deployment: decode throughput (``measure``), a torch-profiler capture
of the decode server (``profile_capture``) and its per-kernel-group summary (``profile_summary``). The commands
are ``bench/measure.py``, ``bench/profile_capture.py`` and ``bench/profile_summary.py`` (``make measure``,
``make profile``, ``make profile-summary``)."""
