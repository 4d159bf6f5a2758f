"""``python -m dsv4_sm120.machine_profile status --gpu NAME``: whether a machine profile applies (the serve
preflight's profile check; :func:`dsv4_sm120.machine_profile.main`)."""

from dsv4_sm120.machine_profile import main

raise SystemExit(main())
