"""Peak memory and time of `python -m dsv4_sm120.convert_nvfp4` on one large synthetic shard.

Writes a DeepSeek-V4-Flash-shaped checkpoint whose single shard holds a 1 GiB BF16
embedding plus N real-size routed experts (w1/w3 [2048, 4096/2] I8, w2 [4096, 2048/2] I8,
E8M0 scales per 32), streamed to disk (never held in memory), then runs the converter
(and, with --verify, the verifier) in child processes under /usr/bin/time -v and prints
max RSS and wall time as JSON.

    PYTHONPATH=overlay python bench/convert_nvfp4_peak.py --workdir /tmp/nvfp4_peak --experts 320 --verify
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from dsv4_sm120 import convert_nvfp4 as C

H, I, V = 4096, 2048, 129280


def write_source(root: Path, n_experts: int, seed: int = 0) -> int:
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    plan = [C.OutTensor("embed.weight", "BF16", (V, H), None)]
    for e in range(n_experts):
        layer, ex = divmod(e, 256)
        for w, (n, k) in (("w1", (I, H)), ("w2", (H, I)), ("w3", (I, H))):
            pre = f"layers.{layer}.ffn.experts.{ex}.{w}"
            plan.append(C.OutTensor(f"{pre}.weight", "I8", (n, k // 2), None))
            plan.append(C.OutTensor(f"{pre}.scale", "F8_E8M0", (n, k // 32), None))
    fn = "model-00001-of-00001.safetensors"
    w = C.ShardWriter(root / f".{fn}.partial", root / fn, plan, {"format": "pt"})
    for t in plan:
        w.begin(t.name)
        if t.dtype == "F8_E8M0":
            x = torch.randint(118, 127, t.shape, dtype=torch.uint8, generator=g)
        elif t.dtype == "BF16":
            x = None
            rows = 8192
            for r in range(0, t.shape[0], rows):
                blk = torch.randn(min(rows, t.shape[0] - r), t.shape[1], generator=g).to(torch.bfloat16)
                w.write(C.tensor_bytes(blk))
            continue
        else:
            x = torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g)
        w.write(C.tensor_bytes(x))
    _, size = w.commit()
    (root / C.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {t.name: fn for t in plan}}))
    (root / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": H,
        "moe_intermediate_size": I, "swiglu_limit": 10.0,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}}))
    return size


def timed(cmd, env) -> dict:
    t = time.time()
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env)
    wall = time.time() - t
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-3000:])
        raise SystemExit(f"failed: {cmd}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    return {"wall_s": round(wall, 1), "max_rss_mib": round(rss / 1024, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--experts", type=int, default=320, help="routed experts in the shard (320 -> ~5.1 GB)")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    src, dst = a.workdir / "src", a.workdir / "dst"
    shutil.rmtree(a.workdir, ignore_errors=True)
    t = time.time()
    size = write_source(src, a.experts)
    gen_s = time.time() - t
    env = dict(os.environ)
    py = sys.executable
    res = {"shard_bytes": size, "experts": a.experts, "generate_s": round(gen_s, 1),
           "torch": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    res["idle_python_torch"] = timed([py, "-c", "import torch, dsv4_sm120.convert_nvfp4"], env)
    res["convert"] = timed([py, "-m", "dsv4_sm120.convert_nvfp4", str(src), str(dst), "--no-progress", "-q"], env)
    res["rerun_resume_check"] = timed([py, "-m", "dsv4_sm120.convert_nvfp4", str(src), str(dst), "--no-progress",
                                       "-q"], env)
    if a.verify:
        res["verify"] = timed([py, "-m", "dsv4_sm120.convert_nvfp4", str(src), str(dst), "--verify-only",
                               "--no-progress", "-q"], env)
    res["output_bytes"] = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    print(json.dumps(res, indent=1))
    if not a.keep:
        shutil.rmtree(a.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
