"""dsv4_sm120: tensor-core kernels and SGLang glue for DeepSeek-V4-Flash on sm_120.

Submodules are imported lazily; importing the package itself never pulls in
torch or triton, so the patch machinery and the SGLang hook stay cheap.
"""

__version__ = "0.1.0"

# The one SGLang release this overlay and patches/series are written against.
SGLANG_VERSION = "0.5.23"
