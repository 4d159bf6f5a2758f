# dsv4_sm120: DeepSeek-V4-Flash on 8x RTX PRO 6000 Blackwell (sm_120) with SGLang 0.5.23.
# `make help` lists the targets.

SHELL := /bin/bash
VENV ?= .venv
# absolute: the patch tool runs the environment's python from other directories
VENV_ABS := $(abspath $(VENV))
PY := $(VENV_ABS)/bin/python
DSV4_SM120_CACHE ?= $(HOME)/.cache/dsv4_sm120
export DSV4_SM120_CACHE
# SGLANG_ROOT=/path/to/site-packages/sglang patches that tree instead of the one in $(VENV).
SGLANG_ROOT ?=
ROOT_ARG := $(if $(SGLANG_ROOT),--sglang-root $(abspath $(SGLANG_ROOT)),)
PATCH_PY := $(if $(wildcard $(PY)),$(PY),python3)
PATCHING := DSV4_SM120_ORIG_PYTHONPATH="$$PYTHONPATH" PYTHONPATH=$(CURDIR)/overlay $(PATCH_PY) -m dsv4_sm120.patching

# Every target refuses a retired setting name (CHANGELOG.md; dsv4_sm120.settings.RENAMED) set in the environment or
# on make's command line, instead of ignoring it.
RETIRED_NAMES := $(shell PYTHONPATH=$(CURDIR)/overlay python3 -m dsv4_sm120.retired_names \
  $(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $v)),$v)) 2>/dev/null)
ifneq ($(RETIRED_NAMES),)
$(error $(RETIRED_NAMES))
endif

.DEFAULT_GOAL := help
.PHONY: help setup apply-patches revert-patches check-patches patch-status lock-patches test test-gpu \
        bench-attention bench-moe bench-fp8 bench-kv bench-allreduce bench-tables launch-tables tune-fp8 calibrate convert-nvfp4 serve serve-mtp stop measure profile profile-summary verify settings freeze mutate

# `## text` after a target describes a user target, `##m text` a maintainer target; `make help` lists
# them in two sections, each in file order.
help: ## list the targets
	@echo "dsv4_sm120 — serve DeepSeek-V4-Flash on 8x RTX PRO 6000 Blackwell (sm_120) with SGLang 0.5.23"
	@echo
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | awk -F'\t' '{printf "  make %-16s %s\n", $$1, $$2}'
	@echo
	@echo "Maintainer targets (changing the patch series, the pinned environment or the launch tables):"
	@grep -E '^[a-zA-Z0-9_-]+:.*##m ' $(MAKEFILE_LIST) | sed -E 's/:.*##m /\t/' | awk -F'\t' '{printf "  make %-16s %s\n", $$1, $$2}'
	@echo
	@echo "Variables: VENV=$(VENV) (environment), SGLANG_ROOT=<sglang package dir> (patch another tree), DSV4_SM120_CACHE=$(DSV4_SM120_CACHE)"
	@echo "           ATTN_VARIANTS / MOE_VARIANTS (launch variants bench-attention / bench-moe time next to the defaults; empty = none), ARGS=... (more bench options)"
	@echo "           BENCH_OUT=$(BENCH_OUT): where every bench-* target appends its rows (outside the tree; the project's recorded rows: BENCH_OUT=bench/results)"
	@echo "Serving is configured by environment variables: bash serve/serve_dsv4_tp4.sh --help-vars lists them."

setup: ## create the pinned environment in VENV (sglang==0.5.23, router, nixl); no system-wide installs
	@scripts/setup_env.sh $(VENV_ABS)

apply-patches: ## apply patches/series to the SGLang in VENV (or SGLANG_ROOT) and install dsv4_sm120 there
	@if [ -z "$(SGLANG_ROOT)" ] && [ ! -x "$(PY)" ]; then \
	  echo "[dsv4_sm120.patching] error: no environment at $(VENV): run \`make setup\` first (or pass SGLANG_ROOT=/path/to/sglang)"; exit 2; fi
	@$(PATCHING) apply $(ROOT_ARG) $(if $(SGLANG_ROOT),$(if $(wildcard $(PY)),--python $(PY),--no-install),--python $(PY))

revert-patches: ## restore every patched SGLang file byte-for-byte and uninstall dsv4_sm120 from VENV
	@if [ -z "$(SGLANG_ROOT)" ] && [ ! -x "$(PY)" ]; then \
	  echo "[dsv4_sm120.patching] error: no environment at $(VENV): nothing to revert (run \`make setup\` first)"; exit 2; fi
	@$(PATCHING) revert $(ROOT_ARG) $(if $(SGLANG_ROOT),,--python $(PY))

patch-status: ## say whether the SGLang tree is patched, and with which series
	@if [ -z "$(SGLANG_ROOT)" ] && [ ! -x "$(PY)" ]; then \
	  echo "[dsv4_sm120.patching] error: no environment at $(VENV): run \`make setup\` first (or pass VENV=<environment> or SGLANG_ROOT=/path/to/sglang)"; exit 2; fi
	@$(PATCHING) status $(ROOT_ARG) $(if $(SGLANG_ROOT),,--python $(PY))

check-patches: ## verify the series on a pristine scratch copy of the pinned wheel (cached download; touches no env)
	@$(PATCHING) check

lock-patches: ##m rewrite patches/targets.lock after changing a patch
	@$(PATCHING) lock

test: ## the CPU test suite (creates/updates the cached test env, then pytest tests/)
	@scripts/run_tests.sh

GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)
test-gpu: ## GPU tests (any CUDA GPU; needs torch + triton only)
	@$(GPU_PY) -c 'import importlib.util as u, sys; sys.exit(3 if u.find_spec("torch") is None else 0 if __import__("torch").cuda.is_available() else 4)'; \
	case $$? in 0) ;; \
	  3) echo "[test-gpu] error: torch is not importable from $(GPU_PY): run \`make setup\` (or pass VENV=...)"; exit 2;; \
	  4) echo "[test-gpu] error: no CUDA GPU is visible to torch (torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES=$${CUDA_VISIBLE_DEVICES-unset}): the GPU tests need one, none were run"; exit 2;; \
	  *) echo "[test-gpu] error: $(GPU_PY) could not import torch (see above)"; exit 2;; esac
	$(GPU_PY) -m pytest tests/gpu -q

# The make target a command runs under (DSV4_SM120_MAKE_TARGET): its hints then name the make command
# (`make calibrate ARGS=--dry-run`) rather than a bare option that make would read as its own.
HINTED_TARGETS := bench-attention bench-moe bench-fp8 bench-kv bench-allreduce tune-fp8 calibrate convert-nvfp4 measure profile verify mutate
$(HINTED_TARGETS): export DSV4_SM120_MAKE_TARGET = $@

# Every bench run (attention, moe, fp8, kv, allreduce) appends its rows to $(BENCH_OUT)/<subject>.csv: by default outside the
# tracked tree, in $(DSV4_SM120_CACHE)/bench. The project's own recorded rows are bench/results/<subject>.csv
# (maintainers: BENCH_OUT=bench/results). `make bench-tables` and `make launch-tables` read bench/results unless
# BENCH_OUT is given (bench/results/README.md).
BENCH_OUT ?= $(DSV4_SM120_CACHE)/bench
BENCH_ROWS := $(if $(filter file,$(origin BENCH_OUT)),bench/results,$(BENCH_OUT))
# launch variants timed next to the default at the tp4_decode case (H=16 SWA128+c4, the TP4 decode shape;
# docs/attention.md); the run ends with the best one per batch size and, when one wins everywhere, the
# DSV4_SM120_ATTN_CONFIG line that selects it. Each variant costs a few Triton compiles on the first run;
# ATTN_VARIANTS= skips them.
# impl=tiled: the tiled body with its own defaults; SPAN=0 / DEC_LATE=0: the register body with per-cache splits /
# carrying the raw bytes; BLOCK_N=64,num_warps=8,waves=1: one 8-warp CTA per SM; BLOCK_N=16: smaller blocks;
# KCVT=0: the conversion-pipe e4m3 decode.
ATTN_VARIANTS ?= impl=tiled;spanning_splits=0;late_decode=0;BLOCK_N=64,num_warps=8,waves=1;BLOCK_N=16;e4m3_int_decode=0;impl=wspec
bench-attention: ## sparse MLA decode benchmark + correctness (any CUDA GPU); appends to BENCH_OUT/attention.csv
	$(if $(wildcard $(PY)),$(PY),python3) bench/bench_attention.py --qk-modes bf16,fp8 --variants '$(ATTN_VARIANTS)' \
		--results $(BENCH_OUT)/attention.csv $(ARGS)

# apre=0: the fp4 path with the activation quantization inside every GEMM program
MOE_VARIANTS ?= apre=0
bench-moe: ## NVFP4 fused MoE benchmark + correctness (any CUDA GPU); appends to BENCH_OUT/moe.csv
	$(if $(wildcard $(PY)),$(PY),python3) bench/bench_moe.py --variants '$(MOE_VARIANTS)' --results $(BENCH_OUT)/moe.csv $(ARGS)

bench-fp8: ## tune SGLang's FP8 block GEMM (quick) and append what it measured to BENCH_OUT/fp8.csv
	$(if $(wildcard $(PY)),$(PY),python3) bench/bench_fp8.py --results $(BENCH_OUT)/fp8.csv $(ARGS)

bench-kv: ## PD KV transfer: NIXL/UCX moving one TP4 rank's DSv4 KV pages between two GPUs vs a peer copy (1k-128k prompts); appends to BENCH_OUT/kv.csv
	$(if $(wildcard $(PY)),$(PY),python3) bench/bench_kv.py --results $(BENCH_OUT)/kv.csv $(ARGS)

bench-allreduce: ## TP all-reduce per server group: FlashInfer PCIe-IPC vs NCCL LL/LL128/Simple at decode and prefill sizes, verified (2+ GPUs); appends to BENCH_OUT/allreduce.csv
	$(if $(wildcard $(PY)),$(PY),python3) bench/bench_allreduce.py --results $(BENCH_OUT)/allreduce.csv $(ARGS)

bench-tables: ## regenerate bench/results/<subject>_<gpu>.md from the committed rows (one per GPU the rows hold; GPU=name: that one only; BENCH_OUT=dir: tables of your rows, in dir)
	@for s in attention moe fp8 kv allreduce; do \
	  if [ -f $(BENCH_ROWS)/$$s.csv ]; then python3 bench/results_table.py table $$s --results $(BENCH_ROWS)/$$s.csv \
	    $(if $(GPU),--gpu '$(GPU)',) $(if $(filter-out bench/results,$(BENCH_ROWS)),--out $(BENCH_ROWS)/$$s.md,) || exit $$?; fi; done

launch-tables: ##m write GPU's attention and MoE launch tables from its launch-sweep rows in bench/results (or BENCH_OUT; GPU=name)
	@test -n "$(GPU)" || { echo "launch-tables: name the GPU as its rows spell it, e.g. GPU='NVIDIA H200'" >&2; exit 2; }
	@for s in attention moe; do python3 bench/results_table.py launch $$s --results $(BENCH_ROWS)/$$s.csv --gpu '$(GPU)' || exit $$?; done

tune-fp8: ## tune SGLang's Triton FP8 block GEMM for this GPU (quick search; ARGS=... for more); writes configs/fp8/
	PYTHONPATH=$(CURDIR)/overlay $(if $(wildcard $(PY)),$(PY),python3) -m dsv4_sm120.tune_fp8 $(or $(ARGS),--quick)

calibrate: ## time every candidate of each decision on this GPU at the serve shapes, gate vs float64; writes configs/profiles/<GPU>.json + .md + .png (ARGS=--quick, --decisions, --dry-run)
	PYTHONPATH=$(CURDIR)/overlay $(if $(wildcard $(PY)),$(PY),python3) -m dsv4_sm120.calibrate $(ARGS)

convert-nvfp4: ## convert an MXFP4 checkpoint: make convert-nvfp4 SRC=... DST=...
	@if [ -z "$(SRC)" ] || [ -z "$(DST)" ]; then echo "usage: make convert-nvfp4 SRC=<mxfp4 checkpoint dir> DST=<output dir> [ARGS=--verify]"; exit 2; fi
	PYTHONPATH=$(CURDIR)/overlay $(if $(wildcard $(PY)),$(PY),python3) -m dsv4_sm120.convert_nvfp4 "$(SRC)" "$(DST)" $(ARGS)

serve: ## preflight, then PD-disaggregated TP4 prefill (GPU0-3) + TP4 decode (GPU4-7) + router, supervised
	VENV=$(VENV) bash serve/serve_dsv4_tp4.sh

serve-mtp: ## the same with MTP speculative decoding
	VENV=$(VENV) bash serve/serve_dsv4_mtp.sh

stop: ## stop the running deployment, whatever LOG_DIR it was started with (SIGTERM, then SIGKILL after a grace period; RUN_DIR=... picks one of several)
	bash serve/stop.sh $(RUN_DIR)

measure: ## decode throughput at C=1,8,16 against the running deployment (JSON, table, PNG)
	VENV=$(VENV) $(if $(wildcard $(PY)),$(PY),python3) bench/measure.py $(ARGS)

profile: ## torch-profiler trace of the decode server under load, summarised by kernel group
	VENV=$(VENV) $(if $(wildcard $(PY)),$(PY),python3) bench/profile_capture.py $(ARGS)

profile-summary: ## summarise a trace file offline: make profile-summary TRACE=path
	@if [ -z "$(TRACE)" ]; then echo "usage: make profile-summary TRACE=<trace.json[.gz]>"; exit 2; fi
	python3 bench/profile_summary.py $(TRACE)

verify: ## the whole deployment, ours vs stock SGLang (+ MTP when the checkpoint has a draft): greedy tokens, GSM8K, measure, profile; one report (ARGS=--dry-run, --stages, --variants)
	DSV4_SM120_ORIG_PYTHONPATH="$$PYTHONPATH" PYTHONPATH=$(CURDIR)/overlay VENV=$(VENV) \
		$(if $(wildcard $(PY)),$(PY),python3) -m dsv4_sm120.serving.verify $(ARGS)

settings: ## list every environment variable the product reads (name, values, default, who reads it, meaning)
	@PYTHONPATH=$(CURDIR)/overlay $(PATCH_PY) -m dsv4_sm120.settings

# mutmut on the serve-time safety code with the tests that cover it (scripts/mutate_targets.txt); minutes per module
# on two cores, not part of `make test`. docs/DEVELOPING.md, "Mutation testing".
MODULES ?=
mutate: ##m mutation testing (mutmut): make mutate [MODULES='overlay/dsv4_sm120/x.py ...'] [ARGS=--dry-run]; report in DSV4_SM120_CACHE/mutate/report.txt
	@python3 scripts/mutate.py $(if $(strip $(MODULES)),--modules '$(strip $(MODULES))',) $(ARGS)

freeze: ##m regenerate requirements/constraints.txt from VENV
	@{ echo "# pip freeze of the pinned environment (sglang==0.5.23 + requirements/runtime.txt), made by make freeze on $$(date -u +%F)."; \
	   echo "# Python $$($(PY) -c 'import sys; print(sys.version.split()[0])'), $$(uname -m). Regenerate with: make freeze VENV=..."; \
	   $(PY) -m pip freeze --exclude-editable | grep -v -E '^(sglang( @|==)|dsv4.sm120)'; } > requirements/constraints.txt
